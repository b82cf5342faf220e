"""Matmul FLOPs, HBM bytes and collectives of an optimized HLO module with every loop body multiplied by
its trip count.

XLA's `compiled.cost_analysis()` visits a `while` body once, so for a model whose layers run in a
`scan` (and attention chunks in a `lax.map`) it reports the cost of roughly one layer. This walks the
optimized HLO text instead and counts, per computation:

* compiler-visible FLOPs of `dot`, `convolution` and `ragged-dot` (2 x output elements x contracted
  size; elementwise work is not counted: it is small next to the matmuls of this model);
* kernel FLOPs of Mosaic custom calls (`tpu_custom_call`): the `pl.CostEstimate` a Pallas kernel
  declares, which the TPU lowering writes into the call's backend config
  (``custom_call_config.cost_estimate``), else for the ragged-dot lowering 2 x m x k x n from its shapes;
  megablox grouped matmuls, given the rows their groups hold, by the row tiles they visit;
* bytes accessed by each top-level instruction (operands + result, or a kernel's declared bytes; a
  fusion counts at its call site, never inside), roughly what XLA's own cost analysis counts;
* every collective (`CollectiveOp`: kind, per-chip buffer bytes, replica groups, async or not), an
  all-reduce that only feeds this chip's dynamic slice (the TPU all-reduce-scatter fusion) as a
  reduce-scatter;

and adds called computations: fusions and calls once, `while` bodies x their trip count (XLA's
`known_trip_count`, else read from the loop: `i < N` in the condition, `i`'s initial constant in the
caller, its step the constant the body adds; a loop whose count cannot be read is counted once and
reported), conditionals by their dearest branch. With a `categorize` function every count is also filed
under a category read from the instruction's op_name metadata.

Checked against hand counts (tests/train/test_hlo_cost.py, test_hlo_kernels.py, test_hlo_collectives.py)
and, on GLM-5 train steps compiled for v5p, against the analytic model FLOPs of glm5_jax/cost/flops.py
(tests/train/test_compile_report.py). The TPU compiler writes batched matmuls as convolutions with a
dilated or padded "spatial" batch dim; those count only the taps that meet real input elements.
"""
from __future__ import annotations

import dataclasses
import math
import re

DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1,
               "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
# the same with its layout: minor-to-major dims, tiles T(..)(..) and memory space S(n)
_LAID_OUT = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_TILES = re.compile(r"T((?:\([0-9,]+\))+)")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLEES = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
# instructions that move no data of their own
_FREE = {"parameter", "tuple", "get-tuple-element", "constant", "bitcast", "after-all", "partition-id",
         "replica-id", "opt-barrier", "while", "conditional", "call", "iota"}
# an asynchronous call (e.g. a collective the TPU compiler offloads to the SparseCores: call-start on the
# "sparsecore" execution thread, then call-done) moves nothing itself: its computation's instructions are
# charged, once; its result tuple only aliases its operands and the callee's result
_ASYNC_CALLS = {"call-start", "async-start"}


@dataclasses.dataclass
class HloCost:
    flops: float = 0.0                 # compiler-visible matmuls (dot / convolution / ragged-dot)
    bytes_accessed: float = 0.0
    loops: list = dataclasses.field(default_factory=list)   # (body, trip count or None), every loop once
    kernel_flops: float = 0.0          # Mosaic custom calls (Pallas kernels, the ragged-dot lowering)
    by_category: dict = dataclasses.field(default_factory=dict)   # {"flops"|"kernel_flops"|"bytes": {cat: v}}
    collectives: dict = dataclasses.field(default_factory=dict)   # CollectiveOp -> executions per step
    comm_seconds: float = 0.0          # every collective's time, summed (needs `timing`)
    exposed_comm_seconds: float = 0.0  # what the overlap rule leaves exposed
    uncounted_custom_calls: list = dataclasses.field(default_factory=list)   # kernels with no known cost
    roofline_seconds: float = 0.0      # every top-level op at max(its compute, its HBM time) (needs `timing`)
    # the top-level instructions that cost the most roofline time, loop trips multiplied in (needs `timing`)
    top_instructions: list = dataclasses.field(default_factory=list)

    @property
    def total_flops(self) -> float:
        return self.flops + self.kernel_flops

    @property
    def unknown_trip_loops(self) -> int:
        return sum(t is None for _, t in self.loops)


def _arrays(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(text)
            if dt in DTYPE_BYTES]


def _nbytes(arrays) -> int:
    return sum(DTYPE_BYTES[dt] * math.prod(shape) for dt, shape in arrays)


@dataclasses.dataclass(frozen=True)
class Array:
    """One array of an HLO shape with its TPU layout: ``tile`` the first tiling of the minor dims (e.g.
    (8, 128) for ``T(8,128)(2,1)``; () when untiled), ``subtile`` the second one ((2, 1): pairs of 16-bit
    rows share 32-bit words), ``memory_space`` the ``S(n)`` annotation (0 = HBM; 1 = VMEM; others are
    small on-chip memories).

    Two read granularities follow from the layout (https://openxla.org/xla/tiled_layout: a tile is laid
    out contiguously, rows inside it one after the other, a sub-tile's rows interleaved in one word):
    ``"tile"`` whole tiles (what a gather or a scatter touches per row, as libtpu's own cost model
    charges them) and ``"dma"`` whole sub-tile rows x tile columns (what a strided copy of a window, a
    dynamic-slice or dynamic-update-slice, moves)."""
    dtype: str
    shape: tuple
    tile: tuple = ()
    subtile: tuple = ()
    memory_space: int = 0
    minor_to_major: tuple = ()        # the layout's dim order, most minor first (default: row-major)

    @property
    def in_hbm(self) -> bool:
        return self.memory_space == 0

    def padded(self, dims=None, granularity: str = "tile") -> int:
        """Elements of the window `dims` (default: the whole array) rounded up to the granularity on the
        tiled minor dims."""
        dims = list(self.shape if dims is None else dims)
        unit = self.tile
        if granularity == "dma" and len(self.tile) == 2:
            unit = (self.subtile[0] if len(self.subtile) == 2 else 1, self.tile[1])
        # a tile's last size applies to the most minor dim of the layout, the one before to the next
        order = list(self.minor_to_major) if len(self.minor_to_major) == len(dims) else \
            list(range(len(dims)))[::-1]
        for t, d in zip(reversed(unit), order):
            dims[d] = -(-dims[d] // t) * t
        return math.prod(dims)

    def hbm_bytes(self, dims=None, granularity: str = "tile") -> int:
        """HBM bytes of reading (or writing) the window `dims` once; 0 off HBM."""
        return DTYPE_BYTES[self.dtype] * self.padded(dims, granularity) if self.in_hbm else 0


def laid_out(text: str) -> list[Array]:
    """The arrays of an HLO shape string, with their layouts."""
    out = []
    for dt, dims, layout in _LAID_OUT.findall(text):
        if dt not in DTYPE_BYTES:
            continue
        tiles = _TILES.search(layout or "")
        groups = [tuple(int(v) for v in g.split(",")) for g in re.findall(r"\(([0-9,]+)\)", tiles.group(1))] \
            if tiles else []
        space = _MEMORY_SPACE.search(layout or "")
        order = re.match(r"\{([0-9,]*)", layout or "")
        out.append(Array(dt, tuple(int(d) for d in dims.split(",") if d), groups[0] if groups else (),
                         groups[1] if len(groups) > 1 else (), int(space.group(1)) if space else 0,
                         tuple(int(d) for d in order.group(1).split(",") if d) if order else ()))
    return out


def hbm_bytes(text: str) -> int:
    """HBM bytes of every array of an HLO shape string, read or written whole (tile-padded; arrays in
    VMEM or other on-chip memories count 0)."""
    return sum(a.hbm_bytes() for a in laid_out(text))


def _split_instruction(line: str):
    """'[ROOT] %x = SHAPE opcode(OPERANDS), attrs' -> (name, shape, opcode, operand names, operands, attrs)."""
    if " = " not in line:
        return None
    lhs, rest = line.split(" = ", 1)
    name = lhs.split()[-1].lstrip("%")
    rest = rest.lstrip()
    if rest.startswith("("):                       # tuple shape: up to its matching parenthesis
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        shape, rest = rest[:i + 1], rest[i + 1:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    m = re.match(r"([\w\-]+)\(", rest)
    if not m:
        return None
    opcode, depth, start = m.group(1), 0, m.end() - 1
    for i in range(start, len(rest)):
        depth += rest[i] == "("
        depth -= rest[i] == ")"
        if depth == 0:
            operands = re.findall(r"%([\w.\-]+)", rest[start + 1:i])
            return name, shape, opcode, operands, rest[start + 1:i], rest[i + 1:]
    return None


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


def _matmul_flops(shape: str, opcode: str, operand_shapes: list[str], attrs: str) -> float:
    out = _arrays(shape)
    ins = [_arrays(t) for t in operand_shapes[:2]]
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


def parse_computations(hlo_text: str):
    """{computation name: {instruction name: (shape, opcode, operand names, raw operands, attrs)}}, entry name.
    Dicts keep the instruction order."""
    comps, entry, current, pending = {}, None, None, ""
    for raw in hlo_text.splitlines():
        line = raw.strip()
        if pending:
            # an instruction whose attributes span lines (XLA prints some kernels' backend config as
            # multi-line JSON, its continuation lines starting with "}"): joined until its braces balance
            line = pending + line
            if line.count("{") > line.count("}"):
                pending = line
                continue
            pending = ""
        if current is None:
            m = _HEADER.match(line)
            if m and not line.startswith("HloModule"):
                current = m.group(2)
                comps[current] = {}
                if m.group(1):
                    entry = current
        elif line.startswith("}"):                # "}" or "}, execution_thread=..."
            current = None
        elif line.count("{") > line.count("}"):
            pending = line
        elif line:
            parts = _split_instruction(line)
            if parts is not None:
                comps[current][parts[0]] = parts[1:]
    return comps, entry


def _constant(instrs: dict, name: str):
    """Integer value of `name` if it is a scalar constant (through copies/bitcasts/converts), else None."""
    for _ in range(8):
        if name not in instrs:
            return None
        shape, opcode, operands, raw, _ = instrs[name]
        if opcode == "constant":
            try:
                return int(raw.strip())
            except ValueError:
                return None
        if opcode not in ("copy", "bitcast", "convert") or len(operands) != 1:
            return None
        name = operands[0]
    return None


def trip_count(comps: dict, caller: str, while_operands: list[str], attrs: str, cond: str, body: str = ""):
    """Iterations of a while loop: XLA's known_trip_count, else `i < N` (or <=) in the condition with the
    counter's initial value a constant in the caller and its step the constant the body adds to it
    (`i = i + s`, s > 0); None when these cannot be read."""
    m = _TRIP.search(attrs)
    if m:
        return int(m.group(1))
    instrs = comps.get(cond, {})
    root = list(instrs.values())[-1] if instrs else None
    if root is None or root[1] != "compare" or len(root[2]) != 2:
        return None
    direction = re.search(r"direction=(\w+)", root[4])
    a, b = root[2]
    if _constant(instrs, a) is not None:          # N > i  ==  i < N
        a, b = b, a
        direction = {"GT": "LT", "GE": "LE"}.get(direction.group(1)) if direction else None
    else:
        direction = direction.group(1) if direction else None
    limit = _constant(instrs, b)
    counter = instrs.get(a)
    if limit is None or counter is None or counter[1] != "get-tuple-element" or direction not in ("LT", "LE"):
        return None
    index = int(re.search(r"index=(\d+)", counter[4]).group(1))
    init_tuple = comps[caller].get(while_operands[0]) if while_operands else None
    if init_tuple is None or init_tuple[1] != "tuple" or index >= len(init_tuple[2]):
        return None
    start = _constant(comps[caller], init_tuple[2][index])
    step = _counter_step(comps.get(body, {}), index)
    if start is None or step is None:
        return None
    span = limit - start + (direction == "LE")        # values start, start+step, ... below the bound
    return max(0, -(-span // step))


def _through_copies(instrs: dict, name: str) -> str:
    for _ in range(4):
        if name not in instrs or instrs[name][1] not in ("copy", "convert", "bitcast") or not instrs[name][2]:
            break
        name = instrs[name][2][0]
    return name


def _counter_step(instrs: dict, index: int):
    """The constant s > 0 a loop body adds to tuple element `index` of its parameter (the body's root
    tuple holds add(get-tuple-element(param, index), s) there); None when it is anything else."""
    if not instrs:
        return None
    root = list(instrs.values())[-1]
    if root[1] != "tuple" or index >= len(root[2]):
        return None
    name = _through_copies(instrs, root[2][index])
    if name not in instrs or instrs[name][1] != "add" or len(instrs[name][2]) != 2:
        return None
    for counter, other in (instrs[name][2], instrs[name][2][::-1]):
        gte = instrs.get(_through_copies(instrs, counter))
        step = _constant(instrs, other)
        if gte is not None and gte[1] == "get-tuple-element" and step is not None and step > 0 \
                and re.search(rf"index={index}\b", gte[4]):
            return step
    return None


def _params(instrs: dict) -> dict[int, str]:
    return {int(raw.strip()): n for n, (_, op, _, raw, _) in instrs.items() if op == "parameter"}


def _ints_attr(attrs: str, key: str) -> list[int]:
    m = re.search(r"\b" + key + r"=\{([0-9,]*)\}", attrs)
    return [int(v) for v in m.group(1).split(",") if v] if m else []


def _int_attr(attrs: str, key: str, default: int) -> int:
    m = re.search(r"\b" + key + r"=(\d+)", attrs)
    return int(m.group(1)) if m else default


def _index_count(indices: Array, attrs: str) -> int:
    """Slices a gather reads (updates a scatter writes): the index array's elements over its index vector."""
    dim = _int_attr(attrs, "index_vector_dim", len(indices.shape))
    per_index = indices.shape[dim] if dim < len(indices.shape) else 1
    return math.prod(indices.shape) // max(per_index, 1)


def _first(text: str) -> Array | None:
    arrays = laid_out(text)
    return arrays[0] if arrays else None


def gather_read_bytes(operand: Array, indices: Array, attrs: str) -> int:
    """HBM bytes a gather reads from its operand: every slice rounded up to the operand's tiles (a single
    row of a T(8,128) array reads the 8-row tile it lies in)."""
    return _index_count(indices, attrs) * operand.hbm_bytes(_ints_attr(attrs, "slice_sizes"))


def scatter_window(operand: Array, updates: Array, attrs: str) -> tuple[int, list[int]]:
    """(updates written, the operand window each one touches) of a scatter."""
    window_sizes = [updates.shape[d] for d in _ints_attr(attrs, "update_window_dims")]
    skipped = set(_ints_attr(attrs, "inserted_window_dims")) | set(_ints_attr(attrs, "input_batching_dims"))
    sizes = iter(window_sizes)
    window = [1 if d in skipped else next(sizes, 1) for d in range(len(operand.shape))]
    count = math.prod(updates.shape) // max(math.prod(window_sizes), 1)
    return count, window


def scatter_touched_bytes(operand: Array, updates: Array, attrs: str) -> int:
    """HBM bytes a scatter reads and writes in its operand (in place): each update's window rounded up to
    the operand's tiles, read and written back."""
    count, window = scatter_window(operand, updates, attrs)
    return 2 * count * operand.hbm_bytes(window)


def update_slice_bytes(operand: Array, update: Array) -> int:
    """HBM bytes a dynamic-update-slice writes into its operand: the update's window at DMA granularity
    (in place: the rest of the operand is not touched)."""
    return operand.hbm_bytes(update.shape, "dma")


def _slice_users(comps: dict, instrs: dict, name: str, depth: int = 0):
    """HBM bytes read through `name` when every use reads a window of it (dynamic-slice, gather: the tiles
    the windows touch), updates it in place (dynamic-update-slice: counted with the write; scatter: the
    touched tiles read and written), or passes it on to such uses; None when some use reads it whole."""
    total = 0
    users = [(n, i) for n, i in instrs.items() if name in i[2]]
    if not users or depth > 4:
        return None
    array = _first(instrs[name][0]) if name in instrs else None
    for uname, (shape, opcode, operands, _, attrs) in users:
        first = operands[0] == name and array is not None
        if opcode == "dynamic-slice" and first:
            total += array.hbm_bytes(_first(shape).shape, "dma")
        elif opcode == "gather" and first and len(operands) > 1 and operands[1] in instrs:
            total += gather_read_bytes(array, _first(instrs[operands[1]][0]), attrs)
        elif opcode == "scatter" and first and len(operands) > 2 and operands[2] in instrs:
            total += scatter_touched_bytes(array, _first(instrs[operands[2]][0]), attrs)
        elif opcode == "dynamic-update-slice" and operands[0] == name:
            pass
        elif opcode == "bitcast":
            sub = _slice_users(comps, instrs, uname, depth + 1)
            if sub is None:
                return None
            total += sub
        elif opcode == "fusion" and dict(_CALLEES.findall(attrs)).get("calls") in comps:
            inner = comps[dict(_CALLEES.findall(attrs))["calls"]]
            inner_params = _params(inner)
            for j, o in enumerate(operands):
                sub = _slice_users(comps, inner, inner_params[j], depth + 1) if o == name and j in inner_params else 0
                if sub is None:
                    return None
                total += sub
        else:
            return None
    return total


def _written_bytes(instrs: dict, name: str, depth: int = 0) -> int:
    """HBM bytes a fused computation's value `name` writes: an in-place dynamic-update-slice its update's
    tiles, an in-place scatter nothing more (its touched tiles count with the operand), else the value."""
    shape, opcode, operands, _, _ = instrs[name]
    if opcode == "dynamic-update-slice" and len(operands) > 1 and operands[1] in instrs and operands[0] in instrs:
        return update_slice_bytes(_first(instrs[operands[0]][0]), _first(instrs[operands[1]][0]))
    if opcode == "scatter" and operands and instrs.get(operands[0], ("", ""))[1] == "parameter":
        return 0
    if opcode in ("tuple", "bitcast") and depth < 4 and all(o in instrs for o in operands):
        return sum(_written_bytes(instrs, o, depth + 1) for o in operands)
    return hbm_bytes(shape)


_PASS_THROUGH = ("bitcast", "reshape", "get-tuple-element")


def _fusion_outputs(instrs: dict) -> tuple[str, list[str]]:
    """(root, the values a fused computation returns): the root tuple's operands, or the root itself."""
    root = list(instrs)[-1]
    _, op, operands, _, _ = instrs[root]
    return root, (operands if op == "tuple" else [root])


def _kernel_fusion_bytes(instrs: dict, full_in: list[int], params: dict[int, str]) -> int | None:
    """HBM bytes of a fusion the TPU compiler built around Mosaic kernels (kind=kCustom; e.g. a kernel whose
    output goes straight into a loop's stacked buffer through a dynamic-update-slice), when every kernel in
    it declares its bytes: the kernels' declared bytes (their reads and their writes, wherever they land),
    plus what the fusion's other instructions read and write. A parameter that only feeds kernels, or is
    only the buffer a dynamic-update-slice writes into in place, adds nothing more. None: not such a fusion."""
    kernels = {n for n, (_, op, _, _, attrs) in instrs.items() if op == "custom-call" and "tpu_custom_call" in attrs}
    if not kernels:
        return None
    declared = [_kernel_cost(instrs[n][0], [], instrs[n][4]) for n in kernels]
    if any(d is None or d[1] is None for d in declared):
        return None
    nbytes = sum(d[1] for d in declared)

    def from_kernel(name, depth=0):             # a kernel's output, passed through bitcasts / tuple picks
        if name in kernels:
            return True
        _, op, operands, _, _ = instrs.get(name, ("", "", [], "", ""))
        return op in _PASS_THROUGH and depth < 8 and bool(operands) and from_kernel(operands[0], depth + 1)

    def only_aliased(name, depth=0):            # every use: a kernel operand, or the buffer updated in place
        users = [(u, i) for u, i in instrs.items() if name in i[2]]
        for uname, (_, op, operands, _, _) in users:
            if uname in kernels or (op == "dynamic-update-slice" and operands[0] == name):
                continue
            if op in _PASS_THROUGH and depth < 8 and only_aliased(uname, depth + 1):
                continue
            return False
        return bool(users)

    for i, full in enumerate(full_in):
        if full and i in params and not only_aliased(params[i]):
            nbytes += full
    for out in _fusion_outputs(instrs)[1]:
        _, o_op, o_operands, _, _ = instrs[out]
        if from_kernel(out) or (o_op == "dynamic-update-slice" and len(o_operands) > 1 and from_kernel(o_operands[1])):
            continue
        nbytes += _written_bytes(instrs, out)
    return nbytes


def _instruction_bytes(comps, shape, opcode, operand_shapes, callees, attrs: str = "",
                       collective_part: str | None = None) -> float:
    """HBM bytes one top-level instruction reads and writes: operands and result at their tiled sizes,
    nothing for arrays in VMEM; windows (slices, gathers, scatters, in-place updates) by the tiles they
    touch; an async copy once (its source and its destination, not the aliased tuple); an async collective
    fusion's data once (``collective_part``: which of its fusions this is, `_collective_fusion_bytes`)."""
    arrays = [_first(t) for t in operand_shapes]
    if opcode == "custom-call" and 'custom_call_target="AllocateBuffer"' in attrs:
        return 0                        # reserves a buffer (a loop's output stack); moves nothing
    if opcode == "dynamic-slice" and arrays and arrays[0] is not None:
        return arrays[0].hbm_bytes(_first(shape).shape, "dma") + hbm_bytes(shape)
    if opcode == "dynamic-update-slice" and len(arrays) > 1 and None not in arrays[:2]:
        return update_slice_bytes(arrays[0], arrays[1]) + arrays[1].hbm_bytes()
    if opcode == "gather" and len(arrays) > 1 and None not in arrays[:2]:
        return gather_read_bytes(arrays[0], arrays[1], attrs) + arrays[1].hbm_bytes() + hbm_bytes(shape)
    if opcode == "scatter" and len(arrays) > 2 and None not in arrays[:3]:
        return scatter_touched_bytes(arrays[0], arrays[2], attrs) + arrays[1].hbm_bytes() + arrays[2].hbm_bytes()
    if opcode == "copy-start":
        destination = laid_out(shape)[:1]
        return sum(a.hbm_bytes() for a in destination) + sum(hbm_bytes(t) for t in operand_shapes)
    if opcode == "slice-start" and arrays and arrays[0] is not None and len(laid_out(shape)) > 1:
        # an async slice (v6e: a window copied into VMEM): the window read, the destination written
        destination = laid_out(shape)[1]        # ((operand), destination, s32)
        return arrays[0].hbm_bytes(destination.shape, "dma") + destination.hbm_bytes()
    if opcode.removesuffix("-start") in _ASYNC_TUPLE_COLLECTIVES and opcode.endswith("-start") \
            and shape.startswith("("):
        # its result tuple holds its operands (the buffers it reads: aliased, not copies), its results and
        # sync flags (SMEM): each buffer once, the operands read and the results written
        return hbm_bytes(shape)
    full_in = [hbm_bytes(t) for t in operand_shapes]
    if opcode != "fusion" or callees.get("calls") not in comps:
        return hbm_bytes(shape) + sum(full_in)
    instrs = comps[callees["calls"]]
    params = _params(instrs)
    if collective_part in ("start", "done"):
        return _collective_fusion_bytes(instrs, collective_part)
    in_kernel_fusion = _kernel_fusion_bytes(instrs, full_in, params)
    if in_kernel_fusion is not None:
        return in_kernel_fusion
    buffer_params, buffer_outputs = _collective_buffers(instrs) if collective_part == "compute" else (set(), set())
    if buffer_outputs:
        nbytes = sum(_written_bytes(instrs, o) for o in _fusion_outputs(instrs)[1] if o not in buffer_outputs)
    else:
        nbytes = _written_bytes(instrs, list(instrs)[-1]) if instrs else hbm_bytes(shape)
    for i, full in enumerate(full_in):
        if full == 0 or params.get(i) in buffer_params:   # off HBM (VMEM, SMEM), or the collective's buffer
            continue
        touched = _slice_users(comps, instrs, params[i]) if i in params else None
        nbytes += full if touched is None else touched
    return nbytes


def _collective_fusion_bytes(instrs: dict, part: str) -> int:
    """HBM bytes of the start or done fusion of an asynchronous collective as the TPU compiler writes it (its
    async collective fusion: a start fusion, a compute fusion the collective runs beside, a done fusion):
    the collective's data moves once, charged at the ``"start"`` fusion (its operands read, its result
    written); the ``"done"`` fusion only waits. The compute fusion: `_collective_buffers`."""
    if part == "done":
        return 0
    collectives = _collectives_in(instrs)
    return sum(hbm_bytes(instrs[o][0]) for n in collectives for o in instrs[n][2] if o in instrs) + \
        sum(hbm_bytes(instrs[n][0]) for n in collectives)


def _collectives_in(instrs: dict) -> set[str]:
    return {n for n, (_, op, _, _, _) in instrs.items() if op.removesuffix("-start") in _COLLECTIVES}


def _collective_buffers(instrs: dict) -> tuple[set[str], set[str]]:
    """(parameters, results) of an async collective's compute fusion that are the collective's buffers, not
    the compute's traffic: a parameter whose every use is the collective or the fusion's result tuple (its
    operand and result buffers, passed through), and the results that are the collective's or a parameter."""
    collectives = _collectives_in(instrs)
    root, outputs = _fusion_outputs(instrs)
    passed_through = outputs if instrs[root][1] == "tuple" else []
    params = set()
    for name in _params(instrs).values():
        users = [u for u, i in instrs.items() if name in i[2]]
        if users and all(u in collectives or (u == root and name in passed_through) for u in users):
            params.add(name)
    return params, {o for o in outputs if o in collectives or instrs[o][1] == "parameter"}


# what `categorize` is given for a fusion without metadata: this prefix + the fused computation's name
HLO_COMPUTATION_PREFIX = "hlo-computation:"
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_COST_ESTIMATE = re.compile(r'"cost_estimate"\s*:\s*\{([^}]*)\}')
# collectives whose async start returns ((operands), results, ...): all-reduce-start returns its result only
_ASYNC_TUPLE_COLLECTIVES = {"all-gather", "all-to-all", "collective-permute", "ragged-all-to-all"}
_COLLECTIVES = {"all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                "collective-permute"}


def _kernel_cost(shape: str, operand_shapes: list[str], attrs: str):
    """(FLOPs, bytes or None) of a Mosaic custom call: the kernel's declared `pl.CostEstimate` (written
    into the backend config's custom_call_config.cost_estimate), else for the ragged-dot lowering
    2 x m x k x n from its shapes (lhs [m, k], rhs [groups, k, n]); a kernel with integer results only
    (e.g. the ragged dot's group metadata) does no matmul; None when none of these applies."""
    m = _COST_ESTIMATE.search(attrs)
    if m:
        fields = dict(re.findall(r'"(\w+)"\s*:\s*"?(\d+)', m.group(1)))
        if "flops" in fields:
            nbytes = int(fields["bytes_accessed"]) if "bytes_accessed" in fields else None
            return float(fields["flops"]), nbytes
    if all(dt[0] in "sup" for dt, _ in _arrays(shape)):
        return 0.0, None                            # integer/bool results only: index bookkeeping, no matmul
    if "ragged_dot" in attrs or "ragged-dot" in attrs:
        arrays = [a for t in operand_shapes for a in _arrays(t)]
        out = _arrays(shape)
        mats = [s for _, s in arrays if len(s) >= 2]
        if out and len(mats) >= 2 and len(mats[-2]) == 2 and len(mats[-1]) == 3:
            (m_, k), n = mats[-2], out[0][1][-1]
            return 2.0 * m_ * k * n, None
    return None


# JAX's megablox grouped matmuls (jax.experimental.pallas.ops.tpu.megablox.gmm: `gmm`, and `tgmm` for the
# weight gradient) run a grid whose row-tile count is an operand: they visit only the row tiles their
# groups cover, and a tile that a group boundary cuts is visited once per group, in full. Their declared
# estimate is 2 x m x k x n over all m rows of the buffer, whatever the groups hold.
_GROUPED_MATMUL = re.compile(r"jit\((t?gmm)\)/pallas_call")


@dataclasses.dataclass(frozen=True)
class GroupedMatmulLoad:
    """What the routed experts' grouped matmuls hold, on average: ``rows`` routed rows per call (None: every
    row of the call's buffer), and whether each group starts on a row tile (``aligned``: the groups' sizes
    are padded to whole tiles, so no tile is cut)."""
    rows: float | None = None
    aligned: bool = False


def grouped_matmul_tiles(rows: float, tile: int, groups: int, aligned: bool = False) -> float:
    """Row tiles a megablox grouped matmul visits for ``rows`` rows in ``groups`` contiguous groups. Groups
    packed back to back: the tiles the rows cover plus one for each of the G - 1 boundaries, which falls
    inside a tile unless the sizes happen to be tile multiples (megablox's make_group_metadata runs a
    group's tiles from its first row rounded down to its last rounded up, so a cut tile is computed by
    both groups). Groups padded to whole tiles: the rows' tiles plus half a tile of padding per group, on
    average (within a tile of megablox's count for random sizes)."""
    if aligned:
        return rows / tile + groups / 2
    return float(math.ceil(rows / tile) + groups - 1)


def _grouped_matmul_cost(kind: str, shape: str, operand_shapes: list[str], flops: float, nbytes: int | None,
                         load: GroupedMatmulLoad):
    """(FLOPs, bytes) a megablox `gmm` / `tgmm` call executes under ``load``, from the declared (FLOPs,
    bytes). The operands say the tiling: (tile count, group offsets [G + 1], group ids [L], row-tile ids
    [L], group offset, lhs [m, k], rhs, ...), L = m / tm + G - 1 the most tiles the grid may visit. FLOPs
    and the row-proportional bytes scale by T / (m / tm) for the T = `grouped_matmul_tiles` visited; `gmm`
    reads one group's weights [k, n] per visited tile (declared for all L), `tgmm` writes each group's
    [k, n] gradient once."""
    arrays = [a for t in operand_shapes for a in _arrays(t)]
    if len(arrays) < 7 or arrays[1][0] != "s32" or len(arrays[5][1]) != 2:
        return flops, nbytes
    groups, most_tiles, m = math.prod(arrays[1][1]) - 1, math.prod(arrays[2][1]), arrays[5][1][0]
    tiles_m = most_tiles - groups + 1
    if groups < 1 or tiles_m < 1 or m % tiles_m:
        return flops, nbytes
    rows = m if load.rows is None else min(load.rows, m)
    visited = min(most_tiles, grouped_matmul_tiles(rows, m // tiles_m, groups, load.aligned))
    scale = visited / tiles_m
    if nbytes is None:
        return flops * scale, None
    if kind == "gmm":
        weight_tile = _nbytes(arrays[6:7]) / groups
        return flops * scale, int((nbytes - weight_tile * most_tiles) * scale + weight_tile * visited)
    out = _nbytes(_arrays(shape))
    return flops * scale, int((nbytes - out) * scale + out)


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction as compiled: `nbytes` is its per-chip buffer (all-gather: the gathered
    result; the others: the operand), `groups` the partition ids that talk (collective-permute: the
    (source, target) pairs), `is_async` when the HLO issues it as a start/done pair."""
    kind: str
    nbytes: int
    groups: tuple
    is_async: bool
    category: str


def _collective(opcode: str, shape: str, operand_shapes: list[str], attrs: str, is_async: bool, category: str,
                num_partitions: int, reduce_scatter: bool = False):
    from glm5_jax.cost.collectives import collective_groups

    kind = opcode.removesuffix("-start")
    if kind not in _COLLECTIVES:
        return None
    if kind == "all-reduce" and reduce_scatter:
        kind = "reduce-scatter"
    operands = [a for t in operand_shapes for a in _arrays(t)]
    if kind == "all-gather":
        nbytes = _nbytes(_arrays(shape)[-1:]) if opcode.endswith("-start") else _nbytes(_arrays(shape))
    elif kind == "ragged-all-to-all":
        nbytes = _nbytes(operands[:1])              # the input buffer: an upper bound on what is sent
    else:
        nbytes = _nbytes(operands)
    return CollectiveOp(kind, nbytes, collective_groups(attrs, num_partitions), is_async, category)


# The TPU compiler's async collective fusion writes one asynchronous collective three times: in the fusion
# instruction that starts it (named async-collective-start*), in the compute fusion it runs beside (its
# computation named async_collective_fusion*) and in the fusion that waits for it (async-collective-done*).
# It is counted once, at its start, as asynchronous.
ASYNC_COLLECTIVE_START = "async-collective-start"
ASYNC_COLLECTIVE_DONE = "async-collective-done"
ASYNC_COLLECTIVE_FUSION = "async_collective_fusion"


class _Tally:
    """Per-category sums (FLOPs, kernel FLOPs, bytes) and collective counts of a computation."""

    def __init__(self):
        self.values: dict = {}
        self.collectives: dict = {}
        self.exposed_comm_seconds = 0.0
        self.comm_seconds = 0.0
        # seconds of the collectives issued at this computation's level (its own and its fusions'):
        # a fusion's collectives are exposed or hidden against the computation that runs the fusion
        self.sync_seconds = 0.0
        self.async_seconds = 0.0

    def add(self, key, value: float):
        if value:
            self.values[key] = self.values.get(key, 0.0) + value

    def merge(self, other: "_Tally", times: float = 1.0):
        for k, v in other.values.items():
            self.values[k] = self.values.get(k, 0.0) + v * times
        for k, v in other.collectives.items():
            self.collectives[k] = self.collectives.get(k, 0.0) + v * times
        self.exposed_comm_seconds += other.exposed_comm_seconds * times
        self.comm_seconds += other.comm_seconds * times

    def total(self, field: str) -> float:
        return sum(v for (f, _), v in self.values.items() if f == field)


@dataclasses.dataclass
class StepTiming:
    """What turns counts into seconds: per-chip peak FLOP/s and HBM bytes/s, and the time of one
    collective (`CollectiveOp` -> seconds; glm5_jax.cost.ici)."""
    peak_flops: float
    hbm_bandwidth: float
    collective_seconds: object


def _reduce_scatter_fusion(instrs: dict) -> bool:
    """An all-reduce whose result is only dynamic-sliced to this chip's shard (the TPU compiler's
    all-reduce-scatter fusion) moves what a reduce-scatter moves."""
    root = list(instrs.values())[-1] if instrs else None
    return bool(root and root[1] == "dynamic-slice" and root[2] and root[2][0] in instrs
                and instrs[root[2][0]][1] == "all-reduce")


def _collective_fusion_part(name: str, opcode: str, callees: dict) -> str | None:
    """Which fusion of an async collective fusion an instruction is ("start", "compute", "done"), or None."""
    if opcode != "fusion":
        return None
    if name.startswith(ASYNC_COLLECTIVE_START):
        return "start"
    if name.startswith(ASYNC_COLLECTIVE_DONE):
        return "done"
    return "compute" if callees.get("calls", "").startswith(ASYNC_COLLECTIVE_FUSION) else None


def _async_start_of(name: str, opcode: str, operands: list[str]) -> str | None:
    """The start instruction an async done waits for: an ``X-done``'s (``async-done``, ``all-gather-done``,
    ...) operand, or the async collective fusion's ``async-collective-start.N`` for its
    ``async-collective-done.N``."""
    if opcode.endswith("-done") and operands:
        return operands[0]
    if name.startswith(ASYNC_COLLECTIVE_DONE):
        return ASYNC_COLLECTIVE_START + name[len(ASYNC_COLLECTIVE_DONE):]
    return None


def _exposed_async(windows: list[tuple[int, int, float]], instr_seconds: list[float]) -> float:
    """Exposed seconds of async collectives, each a window (start index, done index, seconds) over a
    computation's scheduled instructions: it runs beside the instructions strictly between its start and
    its done. Windows that overlap share that compute (and are in flight together), so each group of
    overlapping windows exposes max(0, its collectives' seconds - the roofline seconds inside the union of
    its windows). A start without a done in the same computation runs to the computation's end; a done
    scheduled before its start (a loop body that waits at the top of the next trip for what it started at
    the bottom of this one) wraps round the body."""
    n = len(instr_seconds)
    instr_seconds = instr_seconds * 2               # index i + n: instruction i in the next trip
    windows = [(start, done + n if done < start else done, seconds) for start, done, seconds in windows]
    exposed, group = 0.0, None                      # group: [first start, last done, async seconds]
    for start, done, seconds in sorted(windows) + [(2 * n + 1, 0, 0.0)]:
        if group is not None and start < group[1]:
            group[1] = max(group[1], done)
            group[2] += seconds
            continue
        if group is not None:
            exposed += max(0.0, group[2] - sum(instr_seconds[group[0] + 1:group[1]]))
        group = [start, done, seconds]
    return exposed


@dataclasses.dataclass(frozen=True)
class TopInstruction:
    name: str              # the instruction's name in the compiled HLO
    computation: str       # the computation it is in
    category: str
    opcode: str
    op_name: str           # its metadata op_name (the JAX source of it)
    executions: float      # per step: the product of the trip counts of the loops around it
    seconds: float         # roofline seconds per step, all executions
    bytes: float           # HBM bytes per step, all executions
    flops: float           # per step, all executions


def _top(own_instrs: dict, runs: dict, entry: str, n: int) -> list[TopInstruction]:
    """The n instructions with the most roofline seconds per step: each computation's executions per step
    are the sum over its callers of the caller's executions x the callee's runs per caller run."""
    executions: dict[str, float] = {}

    def visit(comp: str, times: float, depth: int = 0):
        if depth > 64:
            raise ValueError(f"computation call graph deeper than 64 at {comp!r}")
        executions[comp] = executions.get(comp, 0.0) + times
        for callee, k in runs.get(comp, {}).items():
            visit(callee, times * k, depth + 1)

    visit(entry, 1.0)
    rows = [TopInstruction(iname, comp, cat, opcode, op_name, executions[comp], sec * executions[comp],
                           nbytes * executions[comp], flops * executions[comp])
            for comp, instrs in own_instrs.items() if comp in executions
            for iname, cat, sec, nbytes, flops, opcode, op_name in instrs]
    return sorted(rows, key=lambda r: -r.seconds)[:n]


def hlo_cost(hlo_text: str, categorize=None, timing: StepTiming | None = None,
             num_partitions: int | None = None, loop_trips: bool = True, top: int = 0,
             grouped_matmul_load: GroupedMatmulLoad | None = None) -> HloCost:
    """Cost of one execution of the module's ENTRY, per device. `categorize(op_name) -> str` files every
    instruction under a category from its metadata (instructions without one take their caller's);
    `timing` adds communication seconds with this overlap rule: an asynchronous collective (a start/done
    pair, or one inside the TPU compiler's async collective fusion) hides behind the roofline time of the
    instructions the compiled schedule places between its start and its done (`_exposed_async`); a
    synchronous one is exposed in full. With `timing`, every top-level instruction also takes
    its own roofline time, max(its FLOPs / timing.peak_flops, its HBM bytes / timing.hbm_bandwidth)
    (``roofline_seconds``, and per category under "seconds"). ``loop_trips=False`` counts every loop
    body once, as XLA's own ``cost_analysis()`` does (to compare the two). ``top = n`` (with `timing`) lists
    the n top-level instructions with the most roofline seconds per step (`TopInstruction`).
    ``grouped_matmul_load``: what the megablox grouped matmuls' groups hold (`GroupedMatmulLoad`); each
    such call is then charged the row tiles it visits (`_grouped_matmul_cost`), not its declared estimate
    over the whole buffer (None: as declared)."""
    comps, entry = parse_computations(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    if num_partitions is None:
        m = re.search(r"num_partitions=(\d+)", hlo_text[:2000])
        num_partitions = int(m.group(1)) if m else 1
    categorize = categorize or (lambda op_name: "all")
    memo, loops, uncounted = {}, {}, []
    # for `top`: each unfused computation's own instructions (name, category, seconds, bytes, flops, opcode,
    # op_name) and the computations it runs (callee, times per run of it)
    own_instrs: dict[str, list] = {}
    runs: dict[str, dict[str, float]] = {}
    own_instrs_done: set[str] = set()

    def add_run(caller: str, callee: str, times: float):
        if caller not in own_instrs_done:       # each computation's calls once, on its first visit
            runs.setdefault(caller, {})[callee] = runs.get(caller, {}).get(callee, 0.0) + times

    def category_of(attrs: str, inherited: str) -> str:
        m = _OP_NAME.search(attrs)
        return categorize(m.group(1)) if m else inherited

    def cost(name: str, fused: bool, inherited: str, mode: str = "sync") -> _Tally:
        """mode: how the collectives met here count: "sync", "async" (inside an async start) or "skip"
        (a second copy of a collective counted at its start)."""
        key = (name, fused, inherited, mode)
        if key in memo:
            return memo[key]
        instrs = comps.get(name, {})
        own, children = _Tally(), _Tally()
        sync_s = async_s = 0.0
        rs_fusion = fused and _reduce_scatter_fusion(instrs)
        # per instruction of this computation, in schedule order: its roofline seconds (a loop's or call's
        # whole body included); each async start's (index, seconds it starts); where each is done
        instr_seconds, started_at, done_at = [], {}, {}
        for index, (iname, (shape, opcode, operands, raw, attrs)) in enumerate(instrs.items()):
            seconds_before = own.total("seconds") + children.total("seconds")
            async_before = async_s
            cat = category_of(attrs, inherited)
            flops_before = own.total("flops") + own.total("kernel_flops")
            nbytes = None
            operand_shapes = [instrs[o][0] if o in instrs else "" for o in operands]
            callees = dict(_CALLEES.findall(attrs))
            kernel_bytes = None
            if opcode in ("dot", "convolution", "ragged-dot"):
                own.add(("flops", cat), _matmul_flops(shape, opcode, operand_shapes, attrs))
            elif opcode == "custom-call" and "tpu_custom_call" in attrs:
                kc = _kernel_cost(shape, operand_shapes, attrs)
                grouped = _GROUPED_MATMUL.search(attrs) if grouped_matmul_load is not None else None
                if kc is not None and grouped:
                    kc = _grouped_matmul_cost(grouped.group(1), shape, operand_shapes, *kc, grouped_matmul_load)
                if kc is None:
                    m = _OP_NAME.search(attrs)
                    uncounted.append(m.group(1) if m else name)
                else:
                    own.add(("kernel_flops", cat), kc[0])
                    kernel_bytes = kc[1]
            coll = None if mode == "skip" else _collective(
                opcode, shape, operand_shapes, attrs, mode == "async" or opcode.endswith("-start"), cat,
                num_partitions, reduce_scatter=rs_fusion)
            if coll is not None:
                own.collectives[coll] = own.collectives.get(coll, 0.0) + 1
                if timing is not None:
                    seconds = timing.collective_seconds(coll)
                    own.comm_seconds += seconds
                    if coll.is_async:
                        async_s += seconds
                    else:
                        sync_s += seconds
            if not fused and opcode not in _FREE and opcode not in _ASYNC_CALLS and not opcode.endswith("-done"):
                nbytes = kernel_bytes if kernel_bytes is not None else \
                    _instruction_bytes(comps, shape, opcode, operand_shapes, callees, attrs,
                                       _collective_fusion_part(iname, opcode, callees))
                own.add(("bytes", cat), nbytes)
            if opcode == "fusion" and "calls" in callees:
                if not _OP_NAME.search(attrs):          # no metadata: the computation's name may tell
                    hinted = categorize(HLO_COMPUTATION_PREFIX + callees["calls"])
                    cat = cat if hinted == categorize(HLO_COMPUTATION_PREFIX) else hinted
                sub_mode = mode
                if iname.startswith(ASYNC_COLLECTIVE_START) and mode == "sync":
                    sub_mode = "async"
                elif iname.startswith(ASYNC_COLLECTIVE_DONE) or callees["calls"].startswith(ASYNC_COLLECTIVE_FUSION):
                    sub_mode = "skip"       # the same collective as its start's (its compute still counts)
                sub = cost(callees["calls"], True, cat, sub_mode)
                own.merge(sub)
                own.exposed_comm_seconds -= sub.exposed_comm_seconds   # decided at this level, below
                sync_s += sub.sync_seconds
                async_s += sub.async_seconds
            elif opcode == "while" and "body" in callees:
                trip = trip_count(comps, name, operands, attrs, callees.get("condition", ""), callees["body"])
                loops[callees["body"]] = trip
                times = 1 if trip is None or not loop_trips else trip
                add_run(name, callees["body"], times)
                children.merge(cost(callees["body"], False, cat), times)
            elif opcode == "conditional":
                branches = [callees[k] for k in ("true_computation", "false_computation") if k in callees]
                m = _BRANCHES.search(attrs)
                if m:
                    branches += [b.strip().lstrip("%") for b in m.group(1).split(",") if b.strip()]
                if branches:
                    tallies = {c: cost(c, False, cat) for c in branches}
                    taken = max(tallies, key=lambda c: (tallies[c].total("flops") + tallies[c].total("kernel_flops"),
                                                         tallies[c].total("bytes")))
                    add_run(name, taken, 1)
                    children.merge(tallies[taken])
            elif opcode in ("call", "async-start", "call-start") and ("calls" in callees or "to_apply" in callees):
                sub_mode = "async" if mode == "sync" and opcode != "call" else mode
                sub = cost(callees.get("calls") or callees["to_apply"], fused, cat, sub_mode)
                if not fused:
                    add_run(name, callees.get("calls") or callees["to_apply"], 1)
                children.merge(sub)
                if sub_mode == "async" and mode == "sync":    # its collectives overlap this computation's compute
                    children.exposed_comm_seconds -= sub.exposed_comm_seconds
                    async_s += sub.comm_seconds
            if timing is not None and nbytes is not None:
                op_flops = own.total("flops") + own.total("kernel_flops") - flops_before
                op_seconds = max(op_flops / timing.peak_flops, nbytes / timing.hbm_bandwidth)
                own.add(("seconds", cat), op_seconds)
                if top and not fused and name not in own_instrs_done:
                    m = _OP_NAME.search(attrs)
                    own_instrs.setdefault(name, []).append(
                        (iname, cat, op_seconds, nbytes, op_flops, opcode, m.group(1) if m else ""))
            instr_seconds.append(own.total("seconds") + children.total("seconds") - seconds_before)
            if async_s > async_before:
                started_at[iname] = (index, async_s - async_before)
            start = _async_start_of(iname, opcode, operands)
            if start is not None:
                done_at[start] = index
        own.sync_seconds, own.async_seconds = sync_s, async_s
        if not fused:
            own_instrs_done.add(name)
        if timing is not None:
            windows = [(i, done_at.get(name, len(instrs)), s) for name, (i, s) in started_at.items()]
            own.exposed_comm_seconds = sync_s + _exposed_async(windows, instr_seconds)
        own.merge(children)
        memo[key] = own
        return own

    tally = cost(entry, False, "other")
    return HloCost(flops=tally.total("flops"), kernel_flops=tally.total("kernel_flops"),
                   bytes_accessed=tally.total("bytes"), loops=sorted(loops.items(), key=lambda kv: kv[0]),
                   by_category={f: {c: v for (g, c), v in sorted(tally.values.items()) if g == f}
                                for f in ("flops", "kernel_flops", "bytes", "seconds")},
                   roofline_seconds=tally.total("seconds"),
                   collectives=tally.collectives, comm_seconds=tally.comm_seconds,
                   exposed_comm_seconds=tally.exposed_comm_seconds, uncounted_custom_calls=sorted(set(uncounted)),
                   top_instructions=_top(own_instrs, runs, entry, top) if top and timing is not None else [])
