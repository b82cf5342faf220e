"""The optimized HLO text as data: computations and their instructions (`parse_computations`), the arrays of
a shape string with or without their TPU layouts (`arrays_of`, `laid_out`, `Array`) and the attributes the
cost rules read."""
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
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def arrays_of(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every array of an HLO shape string."""
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(text)
            if dt in DTYPE_BYTES]


def dense_bytes(arrays) -> int:
    """Bytes of (dtype, shape) arrays, untiled."""
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


def first_array(text: str) -> Array | None:
    arrays = laid_out(text)
    return arrays[0] if arrays else None


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


def parameter_names(instrs: dict) -> dict[int, str]:
    """{parameter number: instruction name} of a computation."""
    return {int(raw.strip()): n for n, (_, op, _, raw, _) in instrs.items() if op == "parameter"}


def ints_attr(attrs: str, key: str) -> list[int]:
    m = re.search(r"\b" + key + r"=\{([0-9,]*)\}", attrs)
    return [int(v) for v in m.group(1).split(",") if v] if m else []


def int_attr(attrs: str, key: str, default: int) -> int:
    m = re.search(r"\b" + key + r"=(\d+)", attrs)
    return int(m.group(1)) if m else default


def callees_of(attrs: str) -> dict[str, str]:
    """{role: computation} an instruction calls: calls, to_apply, body, condition, true/false_computation."""
    return dict(_CALLEES.findall(attrs))


def branch_computations(attrs: str, callees: dict[str, str]) -> list[str]:
    """The branches of a conditional: its true and false computations, then its branch_computations."""
    branches = [callees[k] for k in ("true_computation", "false_computation") if k in callees]
    m = _BRANCHES.search(attrs)
    if m:
        branches += [b.strip().lstrip("%") for b in m.group(1).split(",") if b.strip()]
    return branches


def op_name_of(attrs: str) -> str | None:
    """An instruction's metadata op_name (the JAX source of it; may be ""), None when it has none."""
    m = _OP_NAME.search(attrs)
    return m.group(1) if m else None
