"""Compiler-visible matmul FLOPs of one HLO instruction: `dot`, `ragged-dot` and `convolution` (2 x output
elements x contracted size). The TPU compiler writes batched matmuls as convolutions with a dilated or padded
"spatial" batch dim; those count only the window taps that meet real input elements."""
from __future__ import annotations

import math
import re

from glm5_jax.cost.hlo_cost.parsing import arrays_of


def _conv_taps(out_n: int, n: int, w: int, stride: int, lo: int, lhs_dilate: int, rhs_dilate: int) -> int:
    """(output position, window tap) pairs along one spatial dim that meet a real input element: not a
    hole of the lhs dilation, not padding. Output o's tap j reads padded position o*stride + j*rhs_dilate,
    which holds input element p when it equals lo + p*lhs_dilate with 0 <= p < n."""
    taps = 0
    last = (n - 1) * lhs_dilate                     # input positions 0, d, ..., last (after removing lo)
    for o in range(out_n):
        base = o * stride - lo
        if rhs_dilate == 1:                         # taps are the interval [base, base + w - 1]
            a, b = max(base, 0), min(base + w - 1, last)
            if b >= a:
                taps += b // lhs_dilate - (-(-a // lhs_dilate)) + 1
        else:
            taps += sum(1 for j in range(w) if 0 <= base + j * rhs_dilate <= last
                        and (base + j * rhs_dilate) % lhs_dilate == 0)
    return taps


def _window(attrs: str, key: str, count: int, default: int) -> list[int]:
    m = re.search(r"window=\{[^}]*\b" + key + r"=([0-9x_]+)", attrs)
    if not m:
        return [default] * count
    return [int(v) for v in m.group(1).split("x")]


def matmul_flops(shape: str, opcode: str, operand_shapes: list[str], attrs: str) -> float:
    out = arrays_of(shape)
    ins = [arrays_of(t) for t in operand_shapes[:2]]
    if not out or len(ins) < 2 or not ins[0] or not ins[1]:
        return 0.0
    out_elems = math.prod(out[0][1])
    lhs, rhs = ins[0][0][1], ins[1][0][1]
    if opcode in ("dot", "ragged-dot"):
        m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", attrs)
        dims = [int(d) for d in m.group(1).split(",") if d] if m else []
        return 2.0 * out_elems * math.prod(lhs[d] for d in dims)
    # convolution: per output element, (kernel elements / output features / window) multiply-adds per
    # window tap that meets a real input element. The TPU compiler writes batched matmuls as convolutions
    # whose "spatial" dim is the batch, dilated (size = lhs_dilate = batch) or padded (input size 1,
    # pad = size - 1): most taps there meet dilation holes or padding and do no work.
    m = re.search(r"dim_labels=([^_]*)_([^-]*)->(\w+)", attrs)
    if not m or "o" not in m.group(2) or len(m.group(2)) != len(rhs) or len(m.group(1)) != len(lhs) \
            or len(m.group(3)) != len(out[0][1]):
        return 0.0
    lhs_labels, rhs_labels, out_labels = m.group(1), m.group(2), m.group(3)
    # the window lists the spatial dims by number (0, 1, ...), whatever order the labels name them in
    spatial = sorted(c for c in rhs_labels if c.isdigit())
    sizes = _window(attrs, "size", len(spatial), 1)
    if "size=" not in attrs:
        sizes = [rhs[rhs_labels.index(c)] for c in spatial]
    strides = _window(attrs, "stride", len(spatial), 1)
    lhs_dilate = _window(attrs, "lhs_dilate", len(spatial), 1)
    rhs_dilate = _window(attrs, "rhs_dilate", len(spatial), 1)
    pad = re.search(r"window=\{[^}]*\bpad=([0-9_x\-]+)", attrs)
    pads = [int(p.split("_")[0]) for p in pad.group(1).split("x")] if pad else [0] * len(spatial)
    macs_per_tap = math.prod(rhs) / rhs[rhs_labels.index("o")] / math.prod(sizes)
    per_position = out_elems
    taps = 1
    for i, c in enumerate(spatial):
        out_n = out[0][1][out_labels.index(c)]
        n = lhs[lhs_labels.index(c)]
        per_position /= out_n
        taps *= _conv_taps(out_n, n, sizes[i], strides[i], pads[i], lhs_dilate[i], rhs_dilate[i])
    return 2.0 * per_position * taps * macs_per_tap


