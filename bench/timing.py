"""Timing helper shared by the benchmarks that compare two or more callables in one process."""
from __future__ import annotations


def interleaved_seconds(steps_by_name: dict, steps: int, warmup: int) -> dict:
    """``warmup`` untimed calls of each step (the first compiles), then ``steps`` rounds that call every
    step once in turn -> {name: [seconds]}. Interleaving makes each side's median see the same machine
    state: on a shared host step times drift by 5-30% over minutes (HF's T=1024 step here: 5.3-7.6 s)."""
    for step in steps_by_name.values():
        for _ in range(warmup):
            step()
    times = {name: [] for name in steps_by_name}
    for _ in range(steps):
        for name, step in steps_by_name.items():
            times[name].append(step())
    return times
