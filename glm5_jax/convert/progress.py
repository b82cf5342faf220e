"""A one-line progress bar with bytes/s for the converters, and the process's peak resident memory."""
from __future__ import annotations

import contextlib
import gc
import resource
import sys
import time


def peak_rss_bytes() -> int:
    """High-water mark of this process's resident set (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextlib.contextmanager
def frozen_gc():
    """Moves every object alive now (jax, flax, orbax modules and the plan: millions of them) out of
    the cyclic collector's reach for the duration. The converters allocate many small objects per
    tensor, and each full collection otherwise walks all of those long-lived ones again (~7% of an
    hf-to-orbax run on one core). Objects created inside are collected as usual."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


class Progress:
    def __init__(self, label: str, total_bytes: int, stream=None, min_interval_s: float = 0.25):
        self.label, self.total = label, max(total_bytes, 1)
        self.stream = stream or sys.stderr
        self.done_bytes = self.tensors = 0
        self.start = self._last = time.perf_counter()
        self.min_interval_s = min_interval_s

    def advance(self, nbytes: int, tensors: int = 1) -> None:
        self.done_bytes += nbytes
        self.tensors += tensors
        now = time.perf_counter()
        if now - self._last >= self.min_interval_s or self.done_bytes >= self.total:
            self._last = now
            frac = min(self.done_bytes / self.total, 1.0)
            bar = "#" * int(30 * frac)
            rate = self.done_bytes / max(now - self.start, 1e-9)
            self.stream.write(f"\r{self.label} [{bar:<30}] {100 * frac:5.1f}% {_gb(self.done_bytes)}/"
                              f"{_gb(self.total)} {rate / 1e6:8.1f} MB/s")
            self.stream.flush()

    def summary(self) -> dict:
        """Print and return tensors, bytes, seconds, bytes/s and peak RSS."""
        seconds = time.perf_counter() - self.start
        result = {"tensors": self.tensors, "bytes": self.done_bytes, "seconds": seconds,
                  "bytes_per_s": self.done_bytes / max(seconds, 1e-9), "peak_rss_bytes": peak_rss_bytes()}
        self.stream.write(f"\n{self.label}: {result['tensors']} tensors, {_gb(result['bytes'])} in {seconds:.2f} s "
                          f"({result['bytes_per_s'] / 1e9:.3f} GB/s), peak RSS {_gb(result['peak_rss_bytes'])}\n")
        self.stream.flush()
        return result
