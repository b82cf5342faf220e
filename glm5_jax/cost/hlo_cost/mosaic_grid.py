"""The grid a Mosaic kernel (a Pallas TPU kernel) runs, read from the serialized module the TPU lowering
writes into its custom call's backend config (``custom_call_config.body``: MLIR bytecode, base64): the
kernel function's name, its ``iteration_bounds`` (a dynamic bound, e.g. megablox's row-tile count, is written as
-2^63), its ``dimension_semantics`` (which grid axes are "parallel", i.e. may be split over a chip's
TensorCores) and its ``window_params`` (each windowed operand's block shape; its ``transform_i`` index map).

From those (`KernelGrid`): the grid steps, how the parallel iterations split over the cores, and the HBM
bytes the pipeline moves: Pallas fetches an operand's block again whenever its block index changes
between consecutive grid steps (the last grid axis varies fastest), so a block whose index map reads grid
axes up to axis j moves prod(bounds[:j + 1]) times (e.g. a flash-attention forward re-reads K / V for
every query block). An index read from a scalar-prefetch table (``data_dependent``) changes only where
the table's entries do: `window_bytes` takes the share of such steps that fetch (``table_fraction``, e.g.
the causal share of a block-sparse attention schedule whose skipped steps repeat the last needed block);
1 is an upper bound (megablox's weights block is looked up per row tile, the same for a group's tiles).
"""
from __future__ import annotations

import base64
import dataclasses
import functools
import math
import re

_BODY = re.compile(r'"body"\s*:\s*"([^"]*)"')
_DYNAMIC = -(2**63)
_ELEMENT_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "si32": 4, "ui32": 4, "i16": 2, "i8": 1, "si8": 1,
                  "ui8": 1, "f8E4M3FN": 1, "f8E5M2": 1, "i4": 0.5, "si4": 0.5, "i1": 1, "f64": 8, "i64": 8}
_SSA = re.compile(r"%[\w#]+")


@dataclasses.dataclass(frozen=True)
class KernelGrid:
    """``bounds`` per grid axis (None: dynamic), ``parallel`` per axis, ``windows``: per windowed operand and
    output (block bytes, the last grid axis its block index depends on, -1: none), ``unwindowed``: operands
    the kernel moves itself (memory space ANY, its own DMAs: not counted here), ``name``: the kernel
    function's name (the ``pallas_call``'s name)."""
    bounds: tuple
    parallel: tuple
    windows: tuple          # (block bytes, last grid axis its index reads (-1: none), read from a table)
    unwindowed: int = 0
    name: str = ""

    def _bounds(self, dynamic: float) -> list[float]:
        return [dynamic if b is None else b for b in self.bounds]

    def steps(self, dynamic: float = 1.0) -> float:
        """Grid steps; a dynamic axis runs ``dynamic`` iterations."""
        return float(math.prod(self._bounds(dynamic)))

    def window_bytes(self, dynamic: float = 1.0, table_fraction: float = 1.0) -> float:
        """HBM bytes the pipeline moves: each block x the times its index changes, a block looked up in a
        table x ``table_fraction`` of those (module docstring)."""
        b = self._bounds(dynamic)
        return float(sum(nbytes * math.prod(b[:last + 1]) * (table_fraction if table else 1.0)
                         for nbytes, last, table in self.windows))

    def busiest_core_share(self, cores: int, dynamic: float = 1.0) -> float:
        """The share of the grid the busiest of ``cores`` TensorCores runs: the parallel axes' iterations
        split as evenly as whole iterations allow (a dynamic parallel axis: evenly); no parallel axis: one
        core runs it all."""
        if any(p and b is None for p, b in zip(self.parallel, self.bounds)):
            return 1.0 / cores
        iterations = math.prod(b for p, b in zip(self.parallel, self.bounds) if p)
        if not any(self.parallel) or iterations < 1:
            return 1.0
        return math.ceil(iterations / cores) / iterations


def _element_bytes(memref: str) -> float | None:
    m = re.search(r"memref<(?:[0-9?]+x)*([A-Za-z0-9]+)", memref)
    return _ELEMENT_BYTES.get(m.group(1)) if m else None


def _index_dependencies(transform: str, grid_axes: int) -> tuple[int, bool]:
    """(the last grid axis a ``transform_i`` index map's results depend on (-1: none), whether one is read
    from a table): the union of its returned values' dependencies, each op's result depending on its
    operands, a load from a table marking its result."""
    deps: dict[str, set] = {f"%arg{i}": {i} for i in range(grid_axes)}
    returned: set = set()
    for line in transform.splitlines():
        line = line.strip()
        if '"stable_mosaic.func.return"' in line or '"func.return"' in line:
            for v in _SSA.findall(line.split(":")[0]):
                returned |= deps.get(v, set())
            continue
        if "=" not in line or not line.startswith("%"):
            continue
        lhs, rhs = line.split("=", 1)
        used = set().union(*[deps.get(v, set()) for v in _SSA.findall(rhs.split(") :")[0])])
        if "memref.load" in rhs:
            used = used | {"table"}
        for r in _SSA.findall(lhs):
            deps[r.split("#")[0]] = used
    return max((a for a in returned if a != "table"), default=-1), "table" in returned


@functools.lru_cache(maxsize=512)
def _grid_of_body(body: str) -> KernelGrid | None:
    from jax._src.lib import tpu
    from jax._src.lib.mlir import ir

    try:
        raw = base64.b64decode(body)
        ctx = ir.Context()
        tpu.register_dialect(ctx)
        ctx.allow_unregistered_dialects = True
        with ctx:
            module = ir.Module.parse(raw)
            funcs = list(module.body.operations)
            main = next(f for f in funcs if "iteration_bounds" in f.attributes)
            name = str(main.attributes["sym_name"]).strip('"') if "sym_name" in main.attributes else ""
            attrs = {a: str(main.attributes[a]) for a in ("iteration_bounds", "dimension_semantics",
                                                          "window_params", "function_type")}
            attrs["scalar_prefetch"] = str(main.attributes["scalar_prefetch"]) \
                if "scalar_prefetch" in main.attributes else "0"
            transforms = {}
            for f in funcs:
                fname = str(f.attributes["sym_name"]).strip('"') if "sym_name" in f.attributes else ""
                if fname.startswith("transform_"):
                    transforms[fname] = str(f)
    except Exception:       # noqa: BLE001 -- an unreadable module: the kernel keeps its declared cost
        return None
    bounds = tuple(None if int(v) == _DYNAMIC else int(v)
                   for v in re.findall(r"-?\d+", attrs["iteration_bounds"].split(":", 1)[1]))
    parallel = tuple(s == "parallel" for s in re.findall(r"dimension_semantics<(\w+)>", attrs["dimension_semantics"]))
    if len(parallel) != len(bounds):
        parallel = (False,) * len(bounds)
    prefetch = int(re.match(r"\s*(\d+)", attrs["scalar_prefetch"]).group(1))
    args = re.findall(r"memref<[^>]*(?:<[^>]*>[^>]*)*>|\bi32\b|\bindex\b",
                      attrs["function_type"].split("->")[0])
    operands = args[len(bounds) + prefetch:]
    windows, unwindowed = [], 0
    for i, param in enumerate(re.findall(r"\{[^{}]*\}", attrs["window_params"])):
        shape = re.search(r"window_bounds = array<i64: ([0-9, ]+)>", param)
        transform = re.search(r"transform_indices = @(\w+)", param)
        element = _element_bytes(operands[i]) if i < len(operands) else None
        if shape is None or element is None:
            unwindowed += 1
            continue
        last, table = _index_dependencies(transforms.get(transform.group(1), ""), len(bounds)) if transform \
            else (-1, False)
        windows.append((math.prod(int(v) for v in shape.group(1).split(",")) * element, last, table))
    return KernelGrid(bounds, parallel, tuple(windows), unwindowed, name)


def kernel_grid(attrs: str) -> KernelGrid | None:
    """The grid of a ``tpu_custom_call`` from its attributes; None when its module cannot be read."""
    m = _BODY.search(attrs)
    return _grid_of_body(m.group(1)) if m else None
