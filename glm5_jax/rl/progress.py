"""What the supervisor (glm5_jax.rl.run) prints while a run goes: a line per logged step, read from the
metrics logs the SFT run and the learner append to, and a closing summary."""
from __future__ import annotations

import json
import os
import sys
import time

from glm5_jax import storage


class LogFollower:
    """The new records of a JSON-lines log that another process appends to, one per `key` value.

    Local file: read from the last offset up to the last complete line (a half-written line waits for
    the next poll). A restarted writer may rewrite the file without its uncommitted tail (a new file:
    new inode, or shorter): it is then read again from its start, and records whose `key` is not past
    the last one returned are skipped. A remote log (parts on object storage) is re-read whole."""

    def __init__(self, path: str, key: str):
        self.path, self.key = path, key
        self.last = None                   # the `key` value of the last record returned
        self._offset, self._inode = 0, None

    def poll(self) -> list[dict]:
        new = []
        for record in self._read():
            value = record.get(self.key)
            if value is not None and (self.last is None or value > self.last):
                new.append(record)
                self.last = value
        return new

    def _read(self) -> list[dict]:
        if storage.is_remote(self.path):
            try:
                return storage.read_jsonl(self.path)
            except (OSError, ValueError):      # a part replaced while listed: the next poll reads it
                return []
        try:
            with open(self.path, "rb") as f:
                stat = os.fstat(f.fileno())
                if stat.st_ino != self._inode or stat.st_size < self._offset:
                    self._offset, self._inode = 0, stat.st_ino
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data[:data.rfind(b"\n") + 1]
        self._offset += len(complete)
        records = []
        for line in complete.splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                pass                           # not a whole record (the file changed under the read)
        return records


class Console:
    """Compact timestamped lines, flushed one by one (the output may be a pipe or a file)."""

    def __init__(self, stream=None):
        self.stream = stream

    def say(self, message: str) -> None:
        stream = self.stream or sys.stdout
        stream.write(f"{time.strftime('%H:%M:%S')} [run] {message}\n")
        stream.flush()


def _f(x) -> str:
    return f"{x:.3f}"


def sft_line(record: dict, steps: int) -> str:
    parts = [f"sft step {record['step']}/{steps}", f"loss {_f(record['loss'])}"]
    if "eval_loss" in record:
        parts.append(f"eval loss {_f(record['eval_loss'])}")
    return "  ".join(parts)


def version_line(record: dict, num_versions: int) -> str:
    """One learner step (= policy version): reward of the batch trained on, its staleness (learner
    version minus the version that sampled it), the held-out eval when the learner ran one."""
    parts = [f"step {record['version']}/{num_versions}"]
    if "mean_reward" in record:
        parts += [f"reward {_f(record['mean_reward'])}", f"staleness {record['staleness']}"]
    else:
        parts.append("(the SFT policy)")
    if "eval_exact_match" in record:
        parts.append(f"eval {_f(record['eval_exact_match'])}")
    if record.get("dropped_stale"):
        parts.append(f"dropped {record['dropped_stale']}")
    if "elapsed" in record:
        parts.append(f"{record['elapsed']:.1f} s")
    return "  ".join(parts)


def outcome_line(records: list[dict], seconds: float, wall_seconds: float, restarts: dict) -> str:
    """The run's outcome from its metrics records (one per version) and the supervisor's counts; `seconds`
    from the start of the RL processes, `wall_seconds` including the SFT stage before them."""
    trained = [r for r in records if "mean_reward" in r]
    restarted = {role: n for role, n in restarts.items() if n}
    restart_text = f"restarts {sum(restarted.values())}" + \
        (" (" + ", ".join(f"{role} {n}" for role, n in restarted.items()) + ")" if restarted else "")
    outcome = [f"done: {records[-1]['version'] if records else 0} steps in {seconds:.1f} s"
               + (f" ({wall_seconds:.1f} s with the SFT)" if wall_seconds - seconds >= 1 else "")]
    if trained:
        best = max(trained, key=lambda r: r["mean_reward"])
        outcome.append(f"reward final {_f(trained[-1]['mean_reward'])}, best {_f(best['mean_reward'])} "
                       f"(step {best['version']})")
    evals = [r for r in records if "eval_exact_match" in r]
    if evals:
        first, last = evals[0], evals[-1]
        outcome.append(f"eval {_f(first['eval_exact_match'])} (step {first['version']}) -> "
                       f"{_f(last['eval_exact_match'])} (step {last['version']})")
    if records:
        outcome.append(f"staleness max {records[-1].get('staleness_max', 0)}, "
                       f"dropped {records[-1].get('dropped_stale', 0)}")
    outcome.append(restart_text)
    return "; ".join(outcome)
