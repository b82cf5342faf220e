"""Lazy, validating access to HF safetensors checkpoints (single file or sharded with an index).

The format (docs/architecture.md#checkpoint-layout-hf-keys): 8-byte little-endian header length, a JSON header mapping
each tensor name to
``dtype``, ``shape`` and ``data_offsets`` (relative to the end of the header), then raw row-major data.
Files are memory-mapped, so reading one tensor touches only its bytes; bf16 and fp8 map to `ml_dtypes`.
FP8 block-quantised weights (``weight_scale_inv``, docs/architecture.md#fp8-block-quantisation) are dequantised on read.
"""
from __future__ import annotations

import json
import math
import os
import struct
import threading
import weakref

import ml_dtypes
import numpy as np

from glm5_jax import storage
from glm5_jax.checkpoint.errors import CheckpointError

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2**20


class SafetensorsFile:
    """One memory-mapped .safetensors file with a validated header."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = storage.getsize(path)
            with storage.path(path).open("rb") as f:
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
                (header_len,) = struct.unpack("<Q", prefix)
                if header_len > min(size - 8, MAX_HEADER_BYTES):
                    raise CheckpointError(f"{path}: corrupt safetensors header length {header_len} "
                                          f"(file has {size} bytes)")
                raw = f.read(header_len)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
        try:
            header = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        data_len = size - self._data_start
        self.entries = {}
        for name, e in header.items():
            try:
                dtype, shape, (begin, end) = DTYPES[e["dtype"]], tuple(e["shape"]), e["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {e!r}") from None
            if end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
                raise CheckpointError(f"{path}: tensor {name!r} {e['dtype']}{list(shape)} has data_offsets "
                                      f"{[begin, end]} that do not match its size")
            if end > data_len:
                raise CheckpointError(f"{path}: truncated: tensor {name!r} ends at byte {end} of the data "
                                      f"section but the file holds {data_len}")
            self.entries[name] = (dtype, shape, begin)
        self._mmap = None
        self._fd = None
        self._remote_lock = threading.Lock()

    def tensor(self, name: str) -> np.ndarray:
        """A read-only view of one tensor (memory-mapped; copy it to keep it)."""
        dtype, shape, begin = self.entries[name]
        count = math.prod(shape)
        start = self._data_start + begin
        if storage.is_remote(self.path):           # object storage: a ranged read of the tensor's bytes
            return self._read_remote(start, np.empty(count * dtype.itemsize, np.uint8), name).view(dtype).reshape(shape)
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mmap[start:start + count * dtype.itemsize].view(dtype).reshape(shape)


    def read_rows(self, name: str, rows: slice, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``[rows.start, rows.stop)`` of a tensor read with plain positional reads into `out` (a
        C-contiguous array of the right dtype and size) or a new array. Unlike `tensor`, nothing stays
        mapped in this process, so a streaming reader's resident memory does not grow with what it read."""
        dtype, shape, begin = self.entries[name]
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        n_rows = rows.stop - rows.start
        if out is None:
            out = np.empty((n_rows,) + tuple(shape[1:]), dtype)
        elif out.dtype != dtype or out.nbytes != n_rows * row_bytes or not out.flags.c_contiguous:
            raise ValueError(f"read_rows({name!r}): out {out.dtype}{list(out.shape)} does not fit {n_rows} rows")
        if storage.is_remote(self.path):
            self._read_remote(self._data_start + begin + rows.start * row_bytes, out.reshape(-1).view(np.uint8), name)
            return out
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
            weakref.finalize(self, os.close, self._fd)
        view = memoryview(out.reshape(-1).view(np.uint8))
        offset, done = self._data_start + begin + rows.start * row_bytes, 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(f"{self.path}: truncated while reading tensor {name!r}")
            done += n
        return out

    def _read_remote(self, offset: int, out_u8: np.ndarray, name: str) -> np.ndarray:
        with self._remote_lock:          # one object handle, shared by reader threads
            if self._fd is None:
                self._fd = storage.path(self.path).open("rb")
                weakref.finalize(self, self._fd.close)
            self._fd.seek(offset)
            data = self._fd.read(out_u8.nbytes)
        if len(data) != out_u8.nbytes:
            raise CheckpointError(f"{self.path}: truncated while reading tensor {name!r}")
        out_u8[:] = np.frombuffer(data, np.uint8)
        return out_u8


class SafetensorsCheckpoint:
    """All tensors of an HF checkpoint directory by name, across shards."""

    def __init__(self, hf_dir: str):
        self.dir = hf_dir
        index_path = storage.join(hf_dir, INDEX_FILE)
        if storage.exists(index_path):
            try:
                weight_map = json.loads(storage.read_text(index_path))["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_path}: not a valid safetensors index ({e})") from None
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                if not storage.isfile(storage.join(hf_dir, shard)):
                    raise CheckpointError(f"{index_path} names shard {shard!r}, which does not exist in {hf_dir}")
        else:
            shards = sorted(f for f in storage.listdir(hf_dir) if f.endswith(".safetensors")) if storage.isdir(hf_dir) else []
            if not shards:
                raise CheckpointError(f"{hf_dir}: no *.safetensors files and no {INDEX_FILE}")
            weight_map = None
        self.files = {s: SafetensorsFile(storage.join(hf_dir, s)) for s in shards}
        self.location = {}
        for shard, f in self.files.items():
            for name in f.entries:
                if weight_map is not None and weight_map.get(name) not in (None, shard):
                    continue
                self.location[name] = f
        if weight_map is not None:
            for name, shard in weight_map.items():
                if name not in self.files[shard].entries:
                    raise CheckpointError(f"{index_path}: tensor {name!r} is mapped to {shard!r}, which lacks it")

    def keys(self):
        return self.location.keys()

    def __contains__(self, name):
        return name in self.location

    def shape(self, name):
        return self._file(name).entries[name][1]

    def dtype(self, name) -> np.dtype:
        return self._file(name).entries[name][0]

    def _file(self, name):
        try:
            return self.location[name]
        except KeyError:
            raise CheckpointError(f"{self.dir}: missing tensor {name!r}") from None

    def raw(self, name: str) -> np.ndarray:
        return self._file(name).tensor(name)

    def read_rows(self, name: str, rows: slice, out: np.ndarray | None = None) -> np.ndarray:
        return self._file(name).read_rows(name, rows, out)

    def get(self, name: str, block_size=(128, 128)) -> np.ndarray:
        """Tensor `name`; FP8 weights with a ``weight_scale_inv`` sibling come back dequantised (fp32)."""
        w = self.raw(name)
        scale_name = name[: -len("weight")] + "weight_scale_inv" if name.endswith(".weight") else None
        if scale_name and scale_name in self.location:
            return dequantize_fp8(w, self.raw(scale_name), block_size, name)
        return w


def dequantize_fp8(w8_OI: np.ndarray, scale_inv: np.ndarray, block_size, name="") -> np.ndarray:
    """W[r, c] = W8[r, c] * scale_inv[r // br, c // bc]; ragged edges use ceil blocks
    (docs/architecture.md#fp8-block-quantisation)."""
    br, bc = block_size
    rows, cols = w8_OI.shape
    expect = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != expect:
        raise CheckpointError(f"{name}: FP8 scale shape {list(scale_inv.shape)} does not match weight "
                              f"{list(w8_OI.shape)} with {br}x{bc} blocks (expected {list(expect)})")
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), br, 0), bc, 1)[:rows, :cols]
    return w8_OI.astype(np.float32) * scale
