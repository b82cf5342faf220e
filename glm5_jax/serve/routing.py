"""The router's policy: which replica gets a request (pure Python; `glm5_jax.serve.router` does the HTTP).

* A request naming a session (``session_id`` in the body, OpenAI's ``user`` field, or an ``X-Session-ID``
  header) goes where that session went before.
* Otherwise, if an earlier prompt sent to a replica is a prefix of this prompt (the next turn of a
  conversation: previous prompt + its completion + new input), the replica that has those rows cached
  gets it. Prompts are compared as sequences of items (token ids, characters, or chat messages) through
  rolling hashes of every prefix, so a lookup costs O(prompt length).
* New sessions go to the live replica with the fewest requests in flight (ties: the one that was given
  the fewest requests so far, then the lowest index).
* Replicas marked dead are skipped; their sessions move to a live replica on their next request.

``policy="round_robin"`` ignores sessions, prefixes and load (the baseline bench/serve.py compares with).
"""
from __future__ import annotations

import collections
import hashlib

_MOD = (1 << 61) - 1
_BASE = 1_000_003


def _item_hash(item) -> int:
    if isinstance(item, int):
        return item + 1
    return int.from_bytes(hashlib.blake2b(str(item).encode(), digest_size=8).digest(), "little")


def prefix_hashes(items) -> list[int]:
    """Rolling hash of items[:i] for i = 1..len(items) (each also keyed by its length)."""
    out, h = [], 0
    for item in items:
        h = (h * _BASE + _item_hash(item)) % _MOD
        out.append(h)
    return out


class RoutingTable:
    def __init__(self, num_replicas: int, max_entries: int = 65536, policy: str = "affinity"):
        if num_replicas < 1:
            raise ValueError("the router needs at least one replica")
        if policy not in ("affinity", "round_robin"):
            raise ValueError(f"policy={policy!r}: must be 'affinity' or 'round_robin'")
        self.policy, self._turn = policy, 0
        self.num_replicas = num_replicas
        self.alive = [True] * num_replicas
        self.in_flight = [0] * num_replicas
        self.routed = [0] * num_replicas
        self.max_entries = max_entries
        self._sessions: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._prefixes: collections.OrderedDict[tuple[int, int], int] = collections.OrderedDict()
        self.stats = collections.Counter()    # session_hits, prefix_hits, new, rerouted

    def least_loaded(self, exclude=()) -> int | None:
        live = [i for i in range(self.num_replicas) if self.alive[i] and i not in exclude]
        return min(live, key=lambda i: (self.in_flight[i], self.routed[i], i)) if live else None

    def choose(self, items, session: str | None = None, exclude=()) -> int | None:
        """The replica for a prompt (a sequence of items) and optional session id; None if all are dead."""
        usable = lambda r: r is not None and self.alive[r] and r not in exclude   # noqa: E731
        if self.policy == "round_robin":
            for _ in range(self.num_replicas):
                self._turn = (self._turn + 1) % self.num_replicas
                if usable(self._turn):
                    return self._turn
            return None
        if session is not None and usable(self._sessions.get(session)):
            self.stats["session_hits"] += 1
            return self._sessions[session]
        hashes = prefix_hashes(items)
        for n in range(len(hashes), 0, -1):
            replica = self._prefixes.get((n, hashes[n - 1]))
            if usable(replica):
                self.stats["prefix_hits"] += 1
                return replica
            if replica is not None:
                self.stats["rerouted"] += 1
                break
        self.stats["new"] += 1
        return self.least_loaded(exclude)

    def record(self, replica: int, items, session: str | None = None) -> None:
        """Remember that `replica` now holds this prompt (and the session)."""
        self.routed[replica] += 1
        if session is not None:
            self._sessions[session] = replica
            self._sessions.move_to_end(session)
            while len(self._sessions) > self.max_entries:
                self._sessions.popitem(last=False)
        hashes = prefix_hashes(items)
        if hashes:
            key = (len(hashes), hashes[-1])
            self._prefixes[key] = replica
            self._prefixes.move_to_end(key)
            while len(self._prefixes) > self.max_entries:
                self._prefixes.popitem(last=False)


def prompt_items(path: str, body: dict) -> list:
    """What a request's prompt is made of, for prefix matching: token ids, characters or messages."""
    if path.endswith("/tokens"):
        return list(body.get("prompt_ids") or [])
    if path.endswith("/chat/completions"):
        return [f"{m.get('role')}\x00{m.get('content')}" for m in body.get("messages") or [] if isinstance(m, dict)]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return []          # several prompts in one request: no affinity
