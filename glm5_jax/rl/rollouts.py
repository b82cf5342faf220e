"""Rollout batches on disk (TITO records, docs/training.md#batch-order-and-staleness) and their crash-safe exchange.

Layout under ``<workdir>/rollouts/``: ``tmp/`` partial writes, ``ready/g<gen>_s<seq>.rollout`` whole
files only (docs/training.md#rollout-files-are-whole: temp file -> fsync -> rename -> fsync of the directory),
``rejected/`` files the
learner found corrupt (counted, never trained on).

File format: an ``.npz`` payload, then a 48-byte trailer ``sha256(payload) | len(payload) u64 | MAGIC``.
A truncated or half-written file (which an ArrayRecord reader would see as *empty*, docs/architecture.md#moe-routing)
fails the
trailer or checksum test and raises `CorruptRollout`; it is never admitted.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import struct

import numpy as np

from glm5_jax import storage

MAGIC = b"GLM5RL01"
_TRAILER = struct.Struct("<32sQ8s")
_NAME = re.compile(r"^g(\d{3})_s(\d{7})\.rollout$")


class CorruptRollout(ValueError):
    """A rollout file that is truncated, half-written, or does not hold a valid batch."""


@dataclasses.dataclass
class RolloutBatch:
    """N = prompts x group_size samples of one batch; C = max_new_tokens."""
    prompt_tokens: np.ndarray       # int32 [N, P] right-padded with 0
    prompt_lengths: np.ndarray      # int32 [N]
    completion_tokens: np.ndarray   # int32 [N, C] exactly the sampler's ids, 0 after each row's end
    completion_lengths: np.ndarray  # int32 [N] generated tokens incl. EOS
    logprobs: np.ndarray            # float32 [N, C] behaviour log-probs recorded by the sampler (0 after end)
    loss_mask: np.ndarray           # float32 [N, C] 1 on model-generated tokens that enter the loss
    rewards: np.ndarray             # float32 [N]
    group_ids: np.ndarray           # int32 [N] samples of one prompt share a group id
    versions: np.ndarray            # int32 [N, K] policy versions that produced each sample (single-turn: K = 1,
                                    # the version it started with; multi-turn: one per turn, -1 padded)
    meta: dict                      # generator, seq, ordinal, sampler settings, timings
    # int32 [N, C] the version that sampled each completion token (-1 on environment tokens and padding);
    # optional: records written before in-flight weight updates lack it (`per_token_versions`)
    token_versions: np.ndarray | None = None
    # routing replay (rl.replay_experts / rl.replay_topk; glm5_jax/model/routing_replay.py), optional, per position
    # t of the learner's row (prompt, then completion: T = P + C), in model layer order, -1 where not recorded:
    routed_experts: np.ndarray | None = None    # int16 [N, T, L_moe, K] the experts each MoE layer routed to
    selected_slots: np.ndarray | None = None    # int16 (int32 past 32767 slots) [N, T, L_full, k] the top-k slots

    ARRAYS = {"prompt_tokens": (np.int32, 2), "prompt_lengths": (np.int32, 1), "completion_tokens": (np.int32, 2),
              "completion_lengths": (np.int32, 1), "logprobs": (np.float32, 2), "loss_mask": (np.float32, 2),
              "rewards": (np.float32, 1), "group_ids": (np.int32, 1), "versions": (np.int32, 2)}
    OPTIONAL = {"token_versions": (np.int32, 2), "routed_experts": (np.int16, 4),
                "selected_slots": ((np.int16, np.int32), 4)}

    def arrays(self) -> dict[str, np.ndarray]:
        """The record's arrays: every required field, and each optional one that is present."""
        return {name: getattr(self, name) for name in (*self.ARRAYS, *self.OPTIONAL)
                if getattr(self, name) is not None}

    def per_token_versions(self) -> np.ndarray:
        """int32 [N, C]: the version that sampled each completion token. A record without
        ``token_versions`` labels every token of a row with the row's oldest version (what the batch-level
        staleness rule assumed), so a per-token rule never treats an old record as fresher than it was."""
        if self.token_versions is not None:
            return self.token_versions
        v = np.where(self.versions >= 0, self.versions, np.iinfo(np.int32).max).min(axis=1)
        return np.broadcast_to(v[:, None], self.completion_tokens.shape).astype(np.int32)

    def validate(self) -> "RolloutBatch":
        n = None
        for name, (dtype, ndim) in {**self.ARRAYS, **self.OPTIONAL}.items():
            a = getattr(self, name)
            if a is None and name in self.OPTIONAL:
                continue
            dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
            if not isinstance(a, np.ndarray) or a.dtype not in dtypes or a.ndim != ndim:
                raise CorruptRollout(f"field {name}: expected {'/'.join(np.dtype(d).name for d in dtypes)} with "
                                     f"{ndim} dims, got "
                                     f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
            if n is None:
                n = a.shape[0]
            if a.shape[0] != n:
                raise CorruptRollout(f"field {name} has {a.shape[0]} rows, prompt_tokens has {n}")
        C = self.completion_tokens.shape[1]
        for name in ("logprobs", "loss_mask", "token_versions"):
            if getattr(self, name) is not None and getattr(self, name).shape[1] != C:
                raise CorruptRollout(f"field {name} has width {getattr(self, name).shape[1]}, completions {C}")
        for name in ("routed_experts", "selected_slots"):
            if getattr(self, name) is not None and getattr(self, name).shape[1] != self.prompt_tokens.shape[1] + C:
                raise CorruptRollout(f"field {name} covers {getattr(self, name).shape[1]} positions, the rows "
                                     f"{self.prompt_tokens.shape[1] + C}")
        if np.any(self.completion_lengths < 0) or np.any(self.completion_lengths > C):
            raise CorruptRollout(f"completion_lengths outside [0, {C}]")
        if np.any(self.prompt_lengths < 1) or np.any(self.prompt_lengths > self.prompt_tokens.shape[1]):
            raise CorruptRollout("prompt_lengths outside [1, P]")
        if not np.all(np.isfinite(self.logprobs)):
            raise CorruptRollout("non-finite logprobs")
        return self


def routing_fields(arrays: dict, names) -> dict:
    """The record fields of a sampler's recorded routing (`routing_replay.extract`: {name: [N, T, L, X]}) for
    ``names``, in the record's compact dtypes: int16, the slots int32 when a row has more than 32767."""
    fields = {}
    for name in names:
        a = np.asarray(arrays[name])
        fields[name] = a.astype(np.int16 if name == "routed_experts" or a.shape[1] <= 32767 else np.int32)
    return fields


def rollout_name(generator: int, seq: int) -> str:
    return f"g{generator:03d}_s{seq:07d}.rollout"


def parse_name(name: str) -> tuple[int, int] | None:
    m = _NAME.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


class RolloutDirs:
    def __init__(self, workdir: str):
        root = storage.join(storage.absolute(workdir), "rollouts")
        self.tmp, self.ready, self.rejected = (storage.join(root, d) for d in ("tmp", "ready", "rejected"))
        for d in (self.tmp, self.ready, self.rejected):
            storage.makedirs(d)

    def path(self, generator: int, seq: int) -> str:
        return storage.join(self.ready, rollout_name(generator, seq))

    def seqs_of(self, generator: int) -> list[int]:
        """Sequence numbers of this generator's files in ready/, sorted."""
        found = (parse_name(storage.basename(p)) for p in storage.glob(self.ready, "*.rollout"))
        return sorted(s for g_s in found if g_s and g_s[0] == generator for s in [g_s[1]])

    def clear_tmp(self, generator: int) -> None:
        """Removes this generator's partial writes (from a previous life of it)."""
        prefix = f"g{generator:03d}_"
        for path in storage.glob(self.tmp, prefix + "*"):
            storage.remove(path)

    def reject(self, path: str) -> None:
        storage.move(path, storage.join(self.rejected, storage.basename(path)))


def encode(batch: RolloutBatch) -> bytes:
    batch.validate()
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(batch.meta, sort_keys=True).encode(), np.uint8), **batch.arrays())
    payload = buf.getvalue()
    return payload + _TRAILER.pack(hashlib.sha256(payload).digest(), len(payload), MAGIC)


def decode(blob: bytes, where: str = "rollout") -> RolloutBatch:
    if len(blob) < _TRAILER.size:
        raise CorruptRollout(f"{where}: {len(blob)} bytes, shorter than the trailer (truncated)")
    digest, length, magic = _TRAILER.unpack(blob[-_TRAILER.size:])
    if magic != MAGIC:
        raise CorruptRollout(f"{where}: no end marker (truncated or not a rollout file)")
    payload = blob[:-_TRAILER.size]
    if length != len(payload) or hashlib.sha256(payload).digest() != digest:
        raise CorruptRollout(f"{where}: length or checksum mismatch (half-written or damaged)")
    try:
        with np.load(io.BytesIO(payload), allow_pickle=False) as z:
            optional = set(z.files) - set(RolloutBatch.ARRAYS) - {"meta"}
            if not set(RolloutBatch.ARRAYS) | {"meta"} <= set(z.files) or optional - set(RolloutBatch.OPTIONAL):
                raise CorruptRollout(f"{where}: fields {sorted(z.files)}")
            fields = {name: z[name] for name in (*RolloutBatch.ARRAYS, *optional)}
            meta = json.loads(z["meta"].tobytes().decode())
    except CorruptRollout:
        raise
    except Exception as e:
        raise CorruptRollout(f"{where}: unreadable payload: {e}") from None
    return RolloutBatch(meta=meta, **fields).validate()


def write_atomically(path: str, data: bytes, tmp_dir: str) -> None:
    """tmp file -> fsync -> rename -> fsync(dir): `path` either does not exist or is complete.
    On object storage one upload straight to `path` gives the same (an object appears whole, a killed
    upload leaves none), so `tmp_dir` is not used there.

    Background: docs/training.md#rollout-files-are-whole.
    """
    if storage.is_remote(path):
        storage.write_atomically(path, data)
        return
    tmp = storage.join(tmp_dir, f"{storage.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(storage.dirname(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_batch(dirs: RolloutDirs, generator: int, seq: int, batch: RolloutBatch) -> str:
    path = dirs.path(generator, seq)
    write_atomically(path, encode(batch), dirs.tmp)
    return path


def content_sha256(batch: RolloutBatch) -> str:
    """sha256 of the TITO arrays (not the meta, whose timings differ between identical batches); an absent
    optional field adds nothing, so a record written before it existed keeps its hash."""
    digest = hashlib.sha256()
    for name, a in batch.arrays().items():
        digest.update(f"{name}|{a.dtype}|{a.shape}|".encode())
        digest.update(np.ascontiguousarray(a).tobytes())
    return digest.hexdigest()


def read_batch(path: str) -> tuple[RolloutBatch, str]:
    """(batch, content_sha256 of it); raises CorruptRollout for anything but a whole valid file."""
    batch = decode(storage.read_bytes(path), path)
    return batch, content_sha256(batch)
