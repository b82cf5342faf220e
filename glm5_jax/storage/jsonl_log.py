"""An append-only JSON-lines log that survives a kill at any moment, locally and on object storage.

Local: one file, each record appended and closed (as `open(path, "a")`).
Object storage has no append, so the log is a prefix ``<path>.parts/`` of numbered part objects; each
record rewrites the current part whole (one atomic upload holding every line of that part so far) and a
part holds at most `lines_per_part` lines, so no record is ever lost and no upload grows without bound.
Readers (`read_jsonl`) concatenate the parts in order.
"""
from __future__ import annotations

import json
import os

from glm5_jax.storage.atomic import write_atomically
from glm5_jax.storage.paths import glob, is_remote, join, read_text, remove

LINES_PER_PART = 1000


def _parts_dir(p: str) -> str:
    return p.rstrip("/") + ".parts"


def _lines(text: str) -> list[str]:
    return [line + "\n" for line in text.splitlines() if line.strip()]


def _parts(p: str) -> list[str]:
    return glob(_parts_dir(p), "*.jsonl")


def read_jsonl(p) -> list[dict]:
    """Every record of the log at `p` (a local file or the parts of a remote one), in order; [] if none."""
    p = os.fspath(p)
    if not is_remote(p):
        return [json.loads(line) for line in _lines(read_text(p))] if os.path.exists(p) else []
    return [json.loads(line) for part in _parts(p) for line in _lines(read_text(part))]


class JsonlLog:
    """Appends records to the log at `path`. `keep(record) -> bool`, when given, is applied once on opening:
    records it rejects (logged by a run killed after its last checkpoint) are dropped."""

    def __init__(self, path, keep=None, lines_per_part: int = LINES_PER_PART):
        self.path, self.lines_per_part = os.fspath(path), lines_per_part
        self.remote = is_remote(self.path)
        if not self.remote:
            if keep is not None and os.path.exists(self.path):
                lines = _lines(read_text(self.path))
                kept = [line for line in lines if keep(json.loads(line))]
                if kept != lines:
                    write_atomically(self.path, "".join(kept).encode())
            return
        parts = _parts(self.path)
        if keep is not None:          # newest part first, so a kill half-way leaves a prefix of the old log
            for part in reversed(parts):
                lines = _lines(read_text(part))
                kept = [line for line in lines if keep(json.loads(line))]
                if not kept:
                    remove(part)
                elif kept != lines:
                    write_atomically(part, "".join(kept).encode())
            parts = _parts(self.path)
        self._index = int(os.path.basename(parts[-1]).split(".")[0]) if parts else 0
        self._current = _lines(read_text(parts[-1])) if parts else []
        if len(self._current) >= lines_per_part:
            self._index, self._current = self._index + 1, []

    def append(self, record: dict) -> None:
        line = json.dumps(record) + "\n"
        if not self.remote:
            with open(self.path, "a") as f:
                f.write(line)
            return
        self._current.append(line)
        write_atomically(join(_parts_dir(self.path), f"{self._index:06d}.jsonl"), "".join(self._current).encode())
        if len(self._current) >= self.lines_per_part:
            self._index, self._current = self._index + 1, []

    def records(self) -> list[dict]:
        return read_jsonl(self.path)

