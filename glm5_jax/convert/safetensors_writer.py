"""Streaming writer of sharded safetensors checkpoints (any numpy dtype incl. bf16 and fp8 via ml_dtypes).

Every tensor's name, dtype and shape are known before the first byte is written (`ShardLayout`), so
each shard's header is final when the shard is opened, the shard count is known for the
``model-0000i-of-0000n.safetensors`` names, and tensor data is written straight through in order:
the writer never holds more than the tensor it is given. Each shard is fsynced once, when complete.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np

from glm5_jax import storage
from glm5_jax.hf.safetensors_io import DTYPES, INDEX_FILE

DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def tensor_bytes(dtype, shape) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


class ShardLayout:
    """Tensors (name, dtype, shape) in write order, packed greedily into shards of at most
    `max_shard_bytes` (a tensor larger than that gets a shard of its own)."""

    def __init__(self, tensors: list[tuple[str, np.dtype, tuple[int, ...]]], max_shard_bytes: int):
        self.tensors = tensors
        self.shards: list[list[tuple[str, np.dtype, tuple[int, ...]]]] = [[]]
        size = 0
        for name, dtype, shape in tensors:
            nbytes = tensor_bytes(dtype, shape)
            if self.shards[-1] and size + nbytes > max_shard_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append((name, np.dtype(dtype), tuple(shape)))
            size += nbytes
        self.total_size = sum(tensor_bytes(d, s) for _, d, s in tensors)

    def file_name(self, i: int) -> str:
        return f"model-{i + 1:05d}-of-{len(self.shards):05d}.safetensors"


def _header(entries) -> bytes:
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in entries:
        nbytes = tensor_bytes(dtype, shape)
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)               # data starts 8-byte aligned


class ShardedSafetensorsWriter:
    """``write(name, array)`` in the layout's order, then ``close()`` writes the index json."""

    def __init__(self, out_dir: str, layout: ShardLayout):
        self.out_dir, self.layout = out_dir, layout
        self._order = [(i, e) for i, shard in enumerate(layout.shards) for e in shard]
        self._next = 0
        self._file = None
        self._shard = -1

    def write(self, name: str, array: np.ndarray) -> None:
        shard, (want_name, dtype, shape) = self._order[self._next]
        if name != want_name or array.dtype != dtype or tuple(array.shape) != shape:
            raise ValueError(f"writer expected {want_name} {dtype.name}{list(shape)}, got {name} "
                             f"{array.dtype.name}{list(array.shape)}")
        if shard != self._shard:
            self._open(shard)
        # Straight from the array's buffer (`tofile` dups the fd, fdopens and seeks on every call).
        self._file.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
        self._next += 1

    def _close_shard(self):
        """Flush and fsync the finished shard (once per shard, not per tensor), so that the directory
        renamed into place on success holds data that is on disk."""
        if self._file:
            self._file.flush()
            if not storage.is_remote(self.out_dir):      # an object is durable once its upload is finalised
                os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def _open(self, shard: int):
        self._close_shard()
        self._shard = shard
        header = _header(self.layout.shards[shard])
        self._file = storage.path(storage.join(self.out_dir, self.layout.file_name(shard))).open("wb")
        self._file.write(len(header).to_bytes(8, "little"))
        self._file.write(header)

    def close(self) -> None:
        if self._next != len(self._order):
            raise ValueError(f"writer closed after {self._next} of {len(self._order)} tensors")
        self._close_shard()
        weight_map = {name: self.layout.file_name(i) for i, shard in enumerate(self.layout.shards)
                      for name, _, _ in shard}
        storage.write_atomically(storage.join(self.out_dir, INDEX_FILE), json.dumps(
            {"metadata": {"total_size": self.layout.total_size}, "weight_map": weight_map}, indent=2).encode())
