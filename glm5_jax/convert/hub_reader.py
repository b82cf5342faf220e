"""Validated, slice-wise reading of a hub checkpoint into our layout (FP8 blocks dequantised on read).

`HubReader.check(plan)` compares the checkpoint with what config.json implies before anything is
written: every expected tensor present with the expected shape and a float dtype, nothing unexpected,
every FP8 weight with a ``weight_scale_inv`` of the right block shape. `read_leaf_slice` then builds any
rectangular slice of a leaf from only the hub rows it covers (a column range is cut from whole rows,
so sharding a hub tensor's input dimension over-reads by that factor), so a device on a mesh reads
just its shard and a single host never holds more than the leaf being built.
"""
from __future__ import annotations

import math
import threading

import ml_dtypes
import numpy as np

from glm5_jax.checkpoint.errors import CheckpointError
from glm5_jax.convert.plan import HubSource, LeafPlan
from glm5_jax.hf.checkpoint import check_mtp_copy
from glm5_jax.hf.layout import layout_perm, split_dims
from glm5_jax.hf.safetensors_io import SafetensorsCheckpoint

FLOAT_DTYPES = {np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float64)}
FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
SCALE_SUFFIX = "weight_scale_inv"


def scale_key(weight_key: str) -> str:
    return weight_key[: -len("weight")] + SCALE_SUFFIX


class HubReader:
    """``empty``: (key, shape) of 0-size tensors that may be present and carry no parameter
    (`hf.layout.empty_shared_experts`); ``copies``: (copy, main) tensors that may be present and must
    equal the main one (`hf.layout.mtp_copies`)."""

    def __init__(self, ckpt: SafetensorsCheckpoint, block_size=(128, 128), empty=(), copies=()):
        self.ckpt = ckpt
        self.block_size = tuple(block_size)
        self.empty, self.copies = dict(empty), dict(copies)
        self._scratch = threading.local()      # per-thread hub-order buffer, reused from leaf to leaf

    def scratch(self, shape, dtype) -> np.ndarray:
        """An uninitialised array of `shape` and `dtype` backed by this thread's reused buffer (grown to
        the largest request). Reading hub tensors into fresh memory costs a page fault and a kernel
        page clear per page; the buffer only ever holds data that is copied out before the next call."""
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        buf = getattr(self._scratch, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._scratch.buf = None
            buf = self._scratch.buf = np.empty(max(nbytes, 1), np.uint8)
        return buf[:nbytes].view(dtype).reshape(shape)

    def is_fp8(self, key: str) -> bool:
        return key.endswith(".weight") and scale_key(key) in self.ckpt

    def dtype(self, key: str) -> np.dtype:
        return self.ckpt.dtype(key)

    def check(self, plan: list[LeafPlan]) -> None:
        """Raise `CheckpointError` naming the first problem; return silently when the checkpoint fits."""
        expected = {}
        for leaf in plan:
            for key in leaf.hub_keys():
                expected[key] = leaf.hub_shape
        present = set(self.ckpt.keys())
        missing = sorted(k for k in expected if k not in present)
        if missing:
            raise CheckpointError(f"{self.ckpt.dir}: {len(missing)} tensors that config.json implies are missing, "
                                  f"e.g. {missing[:5]}")
        scales = {scale_key(k) for k in list(expected) + list(self.copies) if k.endswith(".weight")}
        unexpected = sorted(present - set(expected) - scales - set(self.empty) - set(self.copies))
        if unexpected:
            raise CheckpointError(f"{self.ckpt.dir}: {len(unexpected)} unexpected tensors (not in the model that "
                                  f"config.json describes), e.g. {unexpected[:5]}")
        for key, shape in expected.items():
            got = tuple(self.ckpt.shape(key))
            if got != shape:
                raise CheckpointError(f"{key}: shape {list(got)} in the checkpoint, config.json implies {list(shape)}")
            dtype = self.dtype(key)
            if self.is_fp8(key):
                if dtype != FP8_DTYPE:
                    raise CheckpointError(f"{key}: has a {SCALE_SUFFIX} but dtype {dtype.name}, expected float8_e4m3fn")
                br, bc = self.block_size
                want = (math.ceil(shape[0] / br), math.ceil(shape[1] / bc)) if len(shape) == 2 else None
                got_scale = tuple(self.ckpt.shape(scale_key(key)))
                scale_dtype = self.dtype(scale_key(key))
                if scale_dtype not in FLOAT_DTYPES:
                    raise CheckpointError(f"{scale_key(key)}: FP8 scale dtype {scale_dtype.name} is not a float dtype")
                if want is None or got_scale != want:
                    raise CheckpointError(f"{scale_key(key)}: FP8 scale shape {list(got_scale)} does not match weight "
                                          f"{list(shape)} with {br}x{bc} blocks (expected {list(want or ())})")
            elif dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"{key}: dtype {dtype.name} is not a float dtype the model can load"
                                      + (" (FP8 weight without weight_scale_inv)" if dtype == FP8_DTYPE else ""))
        for key, shape in self.empty.items():
            if key in present and tuple(self.ckpt.shape(key)) != shape:
                raise CheckpointError(f"{key}: shape {list(self.ckpt.shape(key))}, but n_shared_experts=0 "
                                      f"implies {list(shape)}")
        for copy, main in self.copies.items():
            if copy in present:
                check_mtp_copy(copy, main, self.ckpt.shape,
                               lambda key, rows: self.block(key, rows, slice(0, self.ckpt.shape(key)[1])))

    def block(self, key: str, rows: slice, cols: slice | None) -> np.ndarray:
        """Hub tensor `key` restricted to a row range (and column range for 2-D tensors); FP8 dequantised."""
        w = self.ckpt.read_rows(key, rows)          # whole rows; a column range is cut from them
        if cols is None:
            return w
        if not self.is_fp8(key):
            return w[:, cols]
        br, bc = self.block_size
        s = self.ckpt.read_rows(scale_key(key), slice(0, self.ckpt.shape(scale_key(key))[0]))[rows.start // br: -(-rows.stop // br), cols.start // bc: -(-cols.stop // bc)]
        s = np.repeat(np.repeat(s.astype(np.float32), br, 0), bc, 1)
        r0, c0 = rows.start % br, cols.start % bc
        s = s[r0: r0 + rows.stop - rows.start, c0: c0 + cols.stop - cols.start]
        return w[:, cols].astype(np.float32) * s

    def read_ours(self, key: str, layout: str, heads: int | None, index: tuple[slice, ...],
                  hub_order: bool = False) -> np.ndarray:
        """``to_ours(tensor)[index]`` reading only the hub rows and columns the slice covers. With
        `hub_order`, `index` and the result are in the split hub layout (`split_dims`, before the
        transpose to ours)."""
        rows, cols = split_dims(self.ckpt.shape(key), layout, heads)
        perm = layout_perm(layout, len(rows + cols))
        split_index = list(index) if hub_order else [None] * len(perm)
        for our_axis, sl in enumerate(() if hub_order else index):
            split_index[perm[our_axis]] = sl
        row_span, row_local = _span(rows, split_index[:len(rows)])
        col_span, col_local = _span(cols, split_index[len(rows):]) if cols else (None, ())
        block = self.block(key, row_span, col_span)
        n_rows = row_span.stop - row_span.start
        split_shape = (n_rows // math.prod(rows[1:]),) + rows[1:]
        if cols:
            split_shape += ((col_span.stop - col_span.start) // math.prod(cols[1:]),) + cols[1:]
        block = block.reshape(split_shape)[row_local + col_local]
        return block if hub_order else block.transpose(perm)


def _span(dims, slices):
    """Flat range of a hub axis split into `dims` covering `slices` (whole inner dims), and the slices
    relative to that range."""
    inner = math.prod(dims[1:])
    first = slices[0]
    flat = slice(first.start * inner, first.stop * inner)
    return flat, (slice(0, first.stop - first.start),) + tuple(slices[1:])


def normalize_index(index, shape) -> tuple[slice, ...]:
    """A device index (tuple of slices, possibly shorter than `shape`) as explicit unit-step slices."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for sl, n in zip(index, shape):
        start, stop, step = sl.indices(n)
        if step != 1:
            raise ValueError(f"strided slice {sl} is not supported")
        out.append(slice(start, stop))
    return tuple(out)


def read_leaf_slice(reader: HubReader, leaf: LeafPlan, index, dtype) -> np.ndarray:
    """``leaf[index]`` in our layout as a new array of `dtype`, assembled from hub tensors: they are
    read straight into place in hub order (`leaf.hub_order_shape`), then one transpose of the whole
    slice gives our layout (much faster than transposing tensor by tensor)."""
    perm = leaf.hub_to_ours_perm
    index = normalize_index(index, leaf.shape)
    hub_index = [None] * len(perm)
    for our_axis, sl in enumerate(index):
        hub_index[perm[our_axis]] = sl
    identity = perm == tuple(range(len(perm)))
    hub_slice_shape = tuple(s.stop - s.start for s in hub_index)
    # Without a transpose the hub-order array is the result; otherwise it is scratch, copied out below.
    out = aligned_empty(hub_slice_shape, dtype) if identity else reader.scratch(hub_slice_shape, dtype)
    if leaf.stacked:
        layer_range, rest = range(hub_index[0].start, hub_index[0].stop), hub_index[1:]
        for j, layer in enumerate(layer_range):
            _read_source(reader, leaf.sources[layer], rest, out[j])
    else:
        _read_source(reader, leaf.sources[0], hub_index, out)
    return out if identity else transpose_copy(out, perm)


TRANSPOSE_BLOCK = 64
ALIGN = 64


def aligned_empty(shape, dtype) -> np.ndarray:
    """`np.empty` starting on a 64-byte boundary. jax's CPU client adopts such a buffer in
    `device_put` / `make_array_from_callback` instead of copying it (a whole extra pass over every
    leaf otherwise), so the caller must not write to it after handing it over; read_leaf_slice's
    results are fresh arrays that nothing else references."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start: start + nbytes].view(dtype).reshape(shape)


def transpose_copy(src: np.ndarray, perm: tuple[int, ...]) -> np.ndarray:
    """``np.ascontiguousarray(src.transpose(perm))``, copied in blocks of `TRANSPOSE_BLOCK` along the
    source axis that becomes the result's last axis: numpy's strided copy of a whole leaf walks the
    source with a large stride and runs several times slower than these cache-sized blocks."""
    result = aligned_empty(tuple(src.shape[p] for p in perm), src.dtype)
    # Copy as same-width unsigned integers: numpy's own strided loops, not ml_dtypes' per-element
    # copy functions for bfloat16 / float8 (a bit copy either way).
    bits = np.dtype(f"u{src.dtype.itemsize}")
    src, out = src.view(bits), result.view(bits)
    axis = perm[-1]
    n = src.shape[axis]
    if n <= TRANSPOSE_BLOCK:
        np.copyto(out, src.transpose(perm))
        return result
    for start in range(0, n, TRANSPOSE_BLOCK):
        block = slice(start, min(start + TRANSPOSE_BLOCK, n))
        src_index = (slice(None),) * axis + (block,)
        out[..., block] = src[src_index].transpose(perm)
    return result


def _read_source(reader: HubReader, src: HubSource, hub_index, out):
    if src.experts:
        for j, e in enumerate(range(hub_index[0].start, hub_index[0].stop)):
            _read_tensor(reader, src.key.format(e=e), src, hub_index[1:], out[j])
    else:
        _read_tensor(reader, src.key, src, hub_index, out)


def _read_tensor(reader: HubReader, key: str, src: HubSource, hub_index, out):
    """One hub tensor's slice (in split hub layout) into `out`."""
    rows, cols = split_dims(reader.ckpt.shape(key), src.layout, src.heads)
    whole = all(sl.start == 0 and sl.stop == n for sl, n in zip(hub_index, rows + cols))
    if whole and not reader.is_fp8(key) and reader.dtype(key) == out.dtype:
        reader.ckpt.read_rows(key, slice(0, reader.ckpt.shape(key)[0]), out)     # straight into place
    else:
        out[...] = reader.read_ours(key, src.layout, src.heads, hub_index, hub_order=True)
