"""Matmul FLOPs and bytes of an optimized HLO module with every loop body multiplied by its trip count.

XLA's `compiled.cost_analysis()` visits a `while` body once, so for a model whose layers run in a
`scan` (and attention chunks in a `lax.map`) it reports the cost of roughly one layer. This walks the
optimized HLO text instead and counts, per computation:

* FLOPs of `dot`, `convolution` and `ragged-dot` (2 x output elements x contracted size; elementwise
  work is not counted: it is small next to the matmuls of this model);
* bytes accessed by each top-level instruction (operands + result; a fusion counts at its call site,
  never inside), roughly what XLA's own cost analysis counts;

and adds called computations: fusions and calls once, `while` bodies x their trip count (XLA's
`known_trip_count`, else read from the loop: `i < N` in the condition, `i`'s initial constant in the caller;
a loop whose count cannot be read is counted once and reported), conditionals by their dearest branch.

Checked against hand counts (tests/train/test_hlo_cost.py) and, on GLM-5 train steps compiled for v5p,
against the analytic model FLOPs of glm5_jax/flops.py (tests/train/test_compile_report.py). The TPU
compiler writes batched matmuls as convolutions with a dilated or padded "spatial" batch dim; those count
only the taps that meet real input elements.
"""
from __future__ import annotations

import dataclasses
import math
import re

DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1,
               "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLEES = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
# instructions that move no data of their own
_FREE = {"parameter", "tuple", "get-tuple-element", "constant", "bitcast", "after-all", "partition-id",
         "replica-id", "opt-barrier", "while", "conditional", "call", "iota"}


@dataclasses.dataclass
class HloCost:
    flops: float = 0.0
    bytes_accessed: float = 0.0
    loops: list = dataclasses.field(default_factory=list)   # (body, trip count or None), every loop once

    @property
    def unknown_trip_loops(self) -> int:
        return sum(t is None for _, t in self.loops)


def _arrays(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(text)
            if dt in DTYPE_BYTES]


def _nbytes(arrays) -> int:
    return sum(DTYPE_BYTES[dt] * math.prod(shape) for dt, shape in arrays)


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
    # convolution: per output element, (kernel elements / output features) multiply-adds over the window,
    # but along each spatial dim a window only meets min(ceil(size / lhs_dilate), input size) real input
    # elements: the TPU compiler writes batched matmuls as convolutions whose "spatial" dim is the batch,
    # either dilated (size = lhs_dilate = batch) or padded (input size 1, pad = size - 1): one real tap
    m = re.search(r"dim_labels=([^_]*)_([^-]*)->", attrs)
    if not m or "o" not in m.group(2) or len(m.group(2)) != len(rhs) or len(m.group(1)) != len(lhs):
        return 0.0
    lhs_labels, rhs_labels = m.group(1), m.group(2)
    macs = math.prod(rhs) / rhs[rhs_labels.index("o")]
    size = re.search(r"window=\{[^}]*size=([0-9x]+)", attrs)
    if size:
        dilate = re.search(r"window=\{[^}]*lhs_dilate=([0-9x]+)", attrs)
        sizes = [int(v) for v in size.group(1).split("x")]
        dilations = [int(v) for v in dilate.group(1).split("x")] if dilate else [1] * len(sizes)
        spatial = [c for c in rhs_labels if c.isdigit()]
        for c, w, d in zip(spatial, sizes, dilations):
            n = lhs[lhs_labels.index(c)] if c in lhs_labels else w
            macs = macs / w * min(-(-w // d), n)
    return 2.0 * out_elems * macs


def parse_computations(hlo_text: str):
    """{computation name: {instruction name: (shape, opcode, operand names, raw operands, attrs)}}, entry name.
    Dicts keep the instruction order."""
    comps, entry, current = {}, None, None
    for raw in hlo_text.splitlines():
        line = raw.strip()
        if current is None:
            m = _HEADER.match(line)
            if m and not line.startswith("HloModule"):
                current = m.group(2)
                comps[current] = {}
                if m.group(1):
                    entry = current
        elif line.startswith("}"):                # "}" or "}, execution_thread=..."
            current = None
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


def trip_count(comps: dict, caller: str, while_operands: list[str], attrs: str, cond: str):
    """Iterations of a while loop: XLA's known_trip_count, else `i < N` (or <=) in the condition with the
    counter's initial value a constant in the caller; None when neither can be read."""
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
    if start is None:
        return None
    return max(0, limit - start + (direction == "LE"))


def _params(instrs: dict) -> dict[int, str]:
    return {int(raw.strip()): n for n, (_, op, _, raw, _) in instrs.items() if op == "parameter"}


def _slice_users(comps: dict, instrs: dict, name: str, depth: int = 0):
    """Bytes touched through `name` when every use is a dynamic-slice of it (sum of the slices) or a
    dynamic-update-slice into it (in place: 0); None when some use reads it whole."""
    total = 0
    users = [(n, i) for n, i in instrs.items() if name in i[2]]
    if not users or depth > 4:
        return None
    for uname, (shape, opcode, operands, _, attrs) in users:
        if opcode == "dynamic-slice" and operands[0] == name:
            total += _nbytes(_arrays(shape))
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
    """Bytes a fused computation's value `name` writes: only the update of an in-place dynamic-update-slice."""
    shape, opcode, operands, _, _ = instrs[name]
    if opcode == "dynamic-update-slice" and len(operands) > 1 and operands[1] in instrs:
        return _nbytes(_arrays(instrs[operands[1]][0]))
    if opcode in ("tuple", "bitcast") and depth < 4 and all(o in instrs for o in operands):
        return sum(_written_bytes(instrs, o, depth + 1) for o in operands)
    return _nbytes(_arrays(shape))


def _instruction_bytes(comps, shape, opcode, operand_shapes, callees) -> float:
    """Operand + result bytes of one top-level instruction; slices and in-place updates count what they touch."""
    full_in = [_nbytes(_arrays(t)) for t in operand_shapes]
    if opcode == "dynamic-slice":
        return 2 * _nbytes(_arrays(shape))
    if opcode == "dynamic-update-slice" and len(full_in) > 1:
        return 2 * full_in[1]
    if opcode != "fusion" or callees.get("calls") not in comps:
        return _nbytes(_arrays(shape)) + sum(full_in)
    instrs = comps[callees["calls"]]
    params = _params(instrs)
    nbytes = _written_bytes(instrs, list(instrs)[-1]) if instrs else _nbytes(_arrays(shape))
    for i, full in enumerate(full_in):
        touched = _slice_users(comps, instrs, params[i]) if i in params else None
        nbytes += full if touched is None else touched
    return nbytes


def hlo_cost(hlo_text: str) -> HloCost:
    comps, entry = parse_computations(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    memo, loops = {}, {}

    def cost(name: str, fused: bool) -> tuple[float, float]:
        key = (name, fused)
        if key in memo:
            return memo[key]
        instrs = comps.get(name, {})
        flops = nbytes = 0.0
        for shape, opcode, operands, raw, attrs in instrs.values():
            operand_shapes = [instrs[o][0] if o in instrs else "" for o in operands]
            if opcode in ("dot", "convolution", "ragged-dot"):
                flops += _matmul_flops(shape, opcode, operand_shapes, attrs)
            callees = dict(_CALLEES.findall(attrs))
            if not fused and opcode not in _FREE:
                nbytes += _instruction_bytes(comps, shape, opcode, operand_shapes, callees)
            if opcode == "fusion" and "calls" in callees:
                flops += cost(callees["calls"], True)[0]
            elif opcode == "while" and "body" in callees:
                trip = trip_count(comps, name, operands, attrs, callees.get("condition", ""))
                loops[callees["body"]] = trip
                f, b = cost(callees["body"], False)
                flops, nbytes = flops + f * (1 if trip is None else trip), nbytes + b * (1 if trip is None else trip)
            elif opcode == "conditional":
                branches = [callees[k] for k in ("true_computation", "false_computation") if k in callees]
                m = _BRANCHES.search(attrs)
                if m:
                    branches += [b.strip().lstrip("%") for b in m.group(1).split(",") if b.strip()]
                if branches:
                    f, b = max(cost(c, False) for c in branches)
                    flops, nbytes = flops + f, nbytes + b
            elif opcode in ("call", "async-start") and ("calls" in callees or "to_apply" in callees):
                f, b = cost(callees.get("calls") or callees["to_apply"], fused)
                flops, nbytes = flops + f, nbytes + b
        memo[key] = (flops, nbytes)
        return memo[key]

    flops, nbytes = cost(entry, False)
    return HloCost(flops=flops, bytes_accessed=nbytes, loops=sorted(loops.items(), key=lambda kv: kv[0]))
