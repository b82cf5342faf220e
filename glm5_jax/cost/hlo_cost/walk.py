"""The walk over an optimized HLO module (`hlo_cost`): every computation's instructions in schedule order,
each counted by the rules of the sibling modules (matmul FLOPs, kernel costs, HBM bytes, collectives) and
filed under a category; called computations added in: fusions and calls once, `while` bodies x their trip
count, conditionals by their dearest branch; with a `StepTiming`, each top-level instruction's roofline
seconds and the communication the overlap rule leaves exposed."""
from __future__ import annotations

import dataclasses
import re

from glm5_jax.cost.hlo_cost.collective_ops import (ASYNC_COLLECTIVE_DONE, ASYNC_COLLECTIVE_FUSION,
                                                   ASYNC_COLLECTIVE_START, COLLECTIVES, async_start_of,
                                                   collective_fusion_part, collective_op, collectives_in,
                                                   reduce_scatter_fusion, ring_hbm_extra_bytes)
from glm5_jax.cost.hlo_cost.hbm_traffic import instruction_bytes
from glm5_jax.cost.hlo_cost.kernels import GroupedMatmulLoad, custom_call_cost, dynamic_grid_bound, table_fraction
from glm5_jax.cost.hlo_cost.mosaic_grid import kernel_grid
from glm5_jax.cost.hlo_cost.matmul_flops import matmul_flops
from glm5_jax.cost.hlo_cost.parsing import branch_computations, callees_of, op_name_of, parse_computations
from glm5_jax.cost.hlo_cost.rules import RING_HBM_PASSES, CostRules
from glm5_jax.cost.hlo_cost.timing import (ExposedGroup, StepTiming, executions_per_step, exposed_async_groups,
                                            top_instructions)
from glm5_jax.cost.hlo_cost.trip_counts import trip_count

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
    # the groups of async collectives the overlap rule leaves partly exposed, most exposed per step first
    # (`ExposedGroup`; needs `timing`)
    exposed_groups: list = dataclasses.field(default_factory=list)
    # with `rules` (`CostRules`): top-level instructions per step, Pallas grid steps per step (all cores),
    # and the kernels whose grid could not be read from their module (charged as declared, both cores)
    top_level_ops: float = 0.0
    grid_steps: float = 0.0
    kernels_without_grid: list = dataclasses.field(default_factory=list)

    @property
    def total_flops(self) -> float:
        return self.flops + self.kernel_flops

    @property
    def unknown_trip_loops(self) -> int:
        return sum(t is None for _, t in self.loops)


# what `categorize` is given for a fusion without metadata: this prefix + the fused computation's name
HLO_COMPUTATION_PREFIX = "hlo-computation:"


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
class _Frame:
    """One computation as the walk goes through its instructions in schedule order: how it was reached
    (``fused``: inside a fusion; ``inherited``: its caller's category; ``mode``: how its collectives count,
    "sync", "async" (inside an async start) or "skip" (a second copy of a collective counted at its start)),
    its own counts and its callees' (merged in at the end), the seconds of the collectives issued at its
    level, and for the overlap rule each instruction's roofline seconds (a loop's or call's whole body
    included), each async start's (index, seconds it starts) and where each is done."""
    name: str
    instrs: dict
    fused: bool
    inherited: str
    mode: str
    reduce_scatter: bool            # a fusion whose all-reduce moves what a reduce-scatter moves
    own: _Tally = dataclasses.field(default_factory=_Tally)
    children: _Tally = dataclasses.field(default_factory=_Tally)
    sync_seconds: float = 0.0
    async_seconds: float = 0.0
    instr_seconds: list = dataclasses.field(default_factory=list)
    started_at: dict = dataclasses.field(default_factory=dict)
    done_at: dict = dataclasses.field(default_factory=dict)

    def seconds(self) -> float:
        return self.own.total("seconds") + self.children.total("seconds")

    def own_flops(self) -> float:
        return self.own.total("flops") + self.own.total("kernel_flops")

    def total(self, field: str) -> float:
        return self.own.total(field) + self.children.total(field)


_UNNAMED_HOPS = 4      # `_Walk.collective_category`: how far back through unnamed producers


class _Walk:
    """The walk of one module: each computation's `_Tally` per (name, fused, inherited category, mode),
    memoised, and what the result reports besides (loops, kernels of unknown cost, the top instructions)."""

    def __init__(self, comps: dict, categorize, timing: StepTiming | None, num_partitions: int,
                 loop_trips: bool, top: int, grouped_matmul_load: GroupedMatmulLoad | None, rules: CostRules):
        self.comps, self.categorize, self.timing, self.rules = comps, categorize, timing, rules
        self.no_grid: list = []
        self.num_partitions, self.loop_trips, self.top = num_partitions, loop_trips, top
        self.grouped_matmul_load = grouped_matmul_load
        self.memo, self.loops, self.uncounted = {}, {}, []
        # for `top`: each unfused computation's own instructions (name, category, seconds, bytes, flops, opcode,
        # op_name) and the computations it runs (callee, times per run of it)
        self.own_instrs: dict[str, list] = {}
        self.runs: dict[str, dict[str, float]] = {}
        self.own_instrs_done: set[str] = set()
        self.exposed: list = []     # (computation, exposed s, collectives' s, compute s, [(start, s)]) per group

    def add_run(self, caller: str, callee: str, times: float):
        if caller not in self.own_instrs_done:       # each computation's calls once, on its first visit
            self.runs.setdefault(caller, {})[callee] = self.runs.get(caller, {}).get(callee, 0.0) + times

    def category_of(self, attrs: str, inherited: str) -> str:
        op_name = op_name_of(attrs)
        return self.categorize(op_name) if op_name is not None else inherited

    def collective_category(self, f: _Frame, opcode: str, operands: list[str], attrs: str, cat: str) -> str:
        """A collective the compiler made without metadata (a gradient's reduce-scatter, a SparseCore call
        running one) belongs with what it moves: the category of the first operand whose producer has
        metadata (through up to `_UNNAMED_HOPS` unnamed bitcasts, copies, ... by their first operand), else
        the one it inherits."""
        if op_name_of(attrs) is not None:
            return cat
        callees = callees_of(attrs)
        called = callees.get("calls") or callees.get("to_apply")
        if opcode.removesuffix("-start") not in COLLECTIVES and \
                not (called and opcode != "while" and collectives_in(self.comps.get(called, {}))):
            return cat
        for o in operands:
            for _ in range(_UNNAMED_HOPS + 1):
                if o not in f.instrs:
                    break
                op_name = op_name_of(f.instrs[o][4])
                if op_name is not None:
                    return self.categorize(op_name)
                if not f.instrs[o][2]:
                    break
                o = f.instrs[o][2][0]
        return cat

    def cost(self, name: str, fused: bool, inherited: str, mode: str = "sync") -> _Tally:
        """The tally of computation `name` reached this way (`_Frame`), its callees included."""
        key = (name, fused, inherited, mode)
        if key in self.memo:
            return self.memo[key]
        instrs = self.comps.get(name, {})
        frame = _Frame(name, instrs, fused, inherited, mode, fused and reduce_scatter_fusion(instrs))
        for index, (iname, (shape, opcode, operands, _, attrs)) in enumerate(instrs.items()):
            self._instruction(frame, index, iname, shape, opcode, operands, attrs)
        self.memo[key] = self._close(frame)
        return self.memo[key]

    def _instruction(self, f: _Frame, index: int, iname: str, shape: str, opcode: str, operands: list[str],
                     attrs: str):
        """One instruction: its FLOPs, its collective, its HBM bytes (top level only), the computations it
        runs, its roofline seconds; then its place in the schedule for the overlap rule."""
        seconds_before, async_before = f.seconds(), f.async_seconds
        cat = self.collective_category(f, opcode, operands, attrs, self.category_of(attrs, f.inherited))
        flops_before = f.own_flops()
        extra_before, penalty_before = f.total("extra_bytes"), f.total("kernel_penalty")
        operand_shapes = [f.instrs[o][0] if o in f.instrs else "" for o in operands]
        callees = callees_of(attrs)
        kernel_bytes = self._compute(f, shape, opcode, operand_shapes, attrs, cat)
        self._collective(f, shape, opcode, operand_shapes, attrs, cat)
        nbytes = None
        if not f.fused and opcode not in _FREE and opcode not in _ASYNC_CALLS and not opcode.endswith("-done"):
            nbytes = kernel_bytes if kernel_bytes is not None else \
                instruction_bytes(self.comps, shape, opcode, operand_shapes, callees, attrs,
                                  collective_fusion_part(iname, opcode, callees))
            f.own.add(("bytes", cat), nbytes)
        cat = self._callees(f, iname, opcode, operands, attrs, callees, cat)
        if nbytes is not None:
            # what the rules add to a top-level instruction: its kernels' grid bytes past their declared
            # ones, its collectives' ring HBM passes, its kernels' core split and grid steps, one launch
            extra = f.total("extra_bytes") - extra_before
            f.own.add(("bytes", cat), extra)
            f.own.add(("ops", cat), 1.0)
            nbytes += extra
        if self.timing is not None and nbytes is not None:
            self._roofline(f, iname, opcode, attrs, cat, nbytes, f.own_flops() - flops_before,
                           f.total("kernel_penalty") - penalty_before + self.rules.op_fixed_seconds)
        f.instr_seconds.append(f.seconds() - seconds_before)
        if f.async_seconds > async_before:
            f.started_at[iname] = (index, f.async_seconds - async_before)
        start = async_start_of(iname, opcode, operands)
        if start is not None:
            f.done_at[start] = index

    def _compute(self, f: _Frame, shape: str, opcode: str, operand_shapes: list[str], attrs: str,
                 cat: str) -> int | None:
        """Counts a matmul's FLOPs or a Mosaic kernel's; returns the bytes the kernel declares (None: not a
        kernel, or no bytes declared)."""
        if opcode in ("dot", "convolution", "ragged-dot"):
            f.own.add(("flops", cat), matmul_flops(shape, opcode, operand_shapes, attrs))
        elif opcode == "custom-call" and "tpu_custom_call" in attrs:
            kernel = custom_call_cost(shape, operand_shapes, attrs, self.grouped_matmul_load)
            if kernel is None:
                op_name = op_name_of(attrs)
                self.uncounted.append(op_name if op_name is not None else f.name)
            else:
                f.own.add(("kernel_flops", cat), kernel[0])
                return self._kernel_grid(f, shape, operand_shapes, attrs, cat, *kernel) if self.rules.reads_grids \
                    else kernel[1]
        return None

    def _kernel_grid(self, f: _Frame, shape: str, operand_shapes: list[str], attrs: str, cat: str, flops: float,
                     declared: int | None) -> float | None:
        """A kernel under the grid rules (`CostRules`): its bytes from its grid (returned at top level; in a
        fusion, the excess over its declared bytes is added to the fusion's), its grid steps, and the time
        its core split and its steps add to its roofline. A kernel whose grid cannot be read keeps its
        declared cost and is reported."""
        grid = kernel_grid(attrs)
        if grid is None:
            op_name = op_name_of(attrs)
            self.no_grid.append(op_name if op_name is not None else f.name)
            return declared
        dynamic = dynamic_grid_bound(operand_shapes, attrs, self.grouped_matmul_load, shape, grid.name, grid)
        nbytes = declared
        if self.rules.kernel_grid_bytes:
            by_grid = grid.window_bytes(dynamic, table_fraction(grid, attrs))
            nbytes = by_grid if declared is None or not grid.unwindowed else max(declared, by_grid)
            if f.fused and declared is not None:
                f.own.add(("extra_bytes", cat), nbytes - declared)
        share = grid.busiest_core_share(self.rules.cores_per_chip, dynamic)
        steps = grid.steps(dynamic)
        f.own.add(("grid_steps", cat), steps)
        if self.timing is not None:
            base = max(flops / self.timing.peak_flops, (nbytes or 0) / self.timing.hbm_bandwidth)
            core_excess = base * (share * self.rules.cores_per_chip - 1) if self.rules.kernel_core_split else 0.0
            f.own.add(("kernel_penalty", cat), core_excess + steps * share * self.rules.grid_step_seconds)
        return nbytes

    def _collective(self, f: _Frame, shape: str, opcode: str, operand_shapes: list[str], attrs: str, cat: str):
        """Counts the collective an instruction is, and its seconds as issued sync or async at this level."""
        if f.mode == "skip":
            return
        coll = collective_op(opcode, shape, operand_shapes, attrs,
                             f.mode in ("async", "sparsecore") or opcode.endswith("-start"), cat, self.num_partitions,
                             reduce_scatter=f.reduce_scatter, offloaded=f.mode == "sparsecore")
        if coll is None:
            return
        f.own.collectives[coll] = f.own.collectives.get(coll, 0.0) + 1
        if self.rules.collective_hbm_passes:
            f.own.add(("extra_bytes", cat), ring_hbm_extra_bytes(coll, RING_HBM_PASSES))
        if self.timing is not None:
            seconds = self.timing.collective_seconds(coll)
            f.own.comm_seconds += seconds
            if coll.is_async:
                f.async_seconds += seconds
            else:
                f.sync_seconds += seconds

    def _callees(self, f: _Frame, iname: str, opcode: str, operands: list[str], attrs: str, callees: dict,
                 cat: str) -> str:
        """Walks the computations an instruction runs; returns its category (a fusion without metadata may
        take one from its computation's name)."""
        if opcode == "fusion" and "calls" in callees:
            return self._fusion(f, iname, attrs, callees["calls"], cat)
        if opcode == "while" and "body" in callees:
            self._loop(f, operands, attrs, callees, cat)
        elif opcode == "conditional":
            self._conditional(f, attrs, callees, cat)
        elif opcode in ("call", "async-start", "call-start") and ("calls" in callees or "to_apply" in callees):
            self._call(f, opcode, attrs, callees.get("calls") or callees["to_apply"], cat)
        return cat

    def _fusion(self, f: _Frame, iname: str, attrs: str, called: str, cat: str) -> str:
        """A fusion's computation counts as this computation's own; its collectives are exposed or hidden
        at this level. An async collective fusion's collective counts once, at its start."""
        if op_name_of(attrs) is None:          # no metadata: the computation's name may tell
            hinted = self.categorize(HLO_COMPUTATION_PREFIX + called)
            cat = cat if hinted == self.categorize(HLO_COMPUTATION_PREFIX) else hinted
        sub_mode = f.mode
        if iname.startswith(ASYNC_COLLECTIVE_START) and f.mode == "sync":
            sub_mode = "async"
        elif iname.startswith(ASYNC_COLLECTIVE_DONE) or called.startswith(ASYNC_COLLECTIVE_FUSION):
            sub_mode = "skip"       # the same collective as its start's (its compute still counts)
        sub = self.cost(called, True, cat, sub_mode)
        f.own.merge(sub)
        f.own.exposed_comm_seconds -= sub.exposed_comm_seconds   # decided at this level, in `_close`
        f.sync_seconds += sub.sync_seconds
        f.async_seconds += sub.async_seconds
        return cat

    def _loop(self, f: _Frame, operands: list[str], attrs: str, callees: dict, cat: str):
        """A `while`: its body x its trip count (once when the count cannot be read, or without loop_trips)."""
        body = callees["body"]
        trip = trip_count(self.comps, f.name, operands, attrs, callees.get("condition", ""), body)
        self.loops[body] = trip
        times = 1 if trip is None or not self.loop_trips else trip
        self.add_run(f.name, body, times)
        f.children.merge(self.cost(body, False, cat), times)

    def _conditional(self, f: _Frame, attrs: str, callees: dict, cat: str):
        """A conditional: its dearest branch (most FLOPs, then most bytes)."""
        branches = branch_computations(attrs, callees)
        if branches:
            tallies = {c: self.cost(c, False, cat) for c in branches}
            taken = max(tallies, key=lambda c: (tallies[c].total("flops") + tallies[c].total("kernel_flops"),
                                                 tallies[c].total("bytes")))
            self.add_run(f.name, taken, 1)
            f.children.merge(tallies[taken])

    def _call(self, f: _Frame, opcode: str, attrs: str, called: str, cat: str):
        """A call once; an async call's (call-start, async-start) collectives overlap this computation (on
        the SparseCores' execution thread: offloaded)."""
        sub_mode = f.mode
        if f.mode == "sync" and opcode != "call":
            sub_mode = "sparsecore" if 'async_execution_thread="sparsecore"' in attrs else "async"
        sub = self.cost(called, f.fused, cat, sub_mode)
        if not f.fused:
            self.add_run(f.name, called, 1)
        f.children.merge(sub)
        if sub_mode in ("async", "sparsecore") and f.mode == "sync":    # they overlap this computation
            f.children.exposed_comm_seconds -= sub.exposed_comm_seconds
            f.async_seconds += sub.comm_seconds

    def _roofline(self, f: _Frame, iname: str, opcode: str, attrs: str, cat: str, nbytes: float, op_flops: float,
                  overhead: float = 0.0):
        """A top-level instruction's roofline seconds, max(its compute time, its HBM time), + the
        ``overhead`` the rules add (its kernels' core split and grid steps, its launch)."""
        op_seconds = max(op_flops / self.timing.peak_flops, nbytes / self.timing.hbm_bandwidth) + overhead
        f.own.add(("seconds", cat), op_seconds)
        if self.top and not f.fused and f.name not in self.own_instrs_done:
            self.own_instrs.setdefault(f.name, []).append(
                (iname, cat, op_seconds, nbytes, op_flops, opcode, op_name_of(attrs) or ""))

    def _close(self, f: _Frame) -> _Tally:
        """The computation's tally: the exposed seconds of the collectives issued at its level (the sync ones
        in full, the async ones past the compute scheduled beside them), its callees merged in."""
        own = f.own
        own.sync_seconds, own.async_seconds = f.sync_seconds, f.async_seconds
        if not f.fused:
            self.own_instrs_done.add(f.name)
        if self.timing is not None:
            windows = [(i, f.done_at.get(start, len(f.instrs)), s, (start, s))
                       for start, (i, s) in f.started_at.items()]
            groups = exposed_async_groups(windows, f.instr_seconds)
            own.exposed_comm_seconds = f.sync_seconds + sum(g[0] for g in groups)
            if f.mode == "sync" and not f.fused:   # an async call's own groups are its caller's to expose
                self.exposed += [(f.name, *g) for g in groups]
        own.merge(f.children)
        return own

    def result(self, tally: _Tally, entry: str) -> HloCost:
        executions = executions_per_step(self.runs, entry)
        return HloCost(flops=tally.total("flops"), kernel_flops=tally.total("kernel_flops"),
                       bytes_accessed=tally.total("bytes"), loops=sorted(self.loops.items(), key=lambda kv: kv[0]),
                       by_category={f: {c: v for (g, c), v in sorted(tally.values.items()) if g == f}
                                    for f in ("flops", "kernel_flops", "bytes", "seconds")},
                       roofline_seconds=tally.total("seconds"),
                       collectives=tally.collectives, comm_seconds=tally.comm_seconds,
                       exposed_comm_seconds=tally.exposed_comm_seconds,
                       uncounted_custom_calls=sorted(set(self.uncounted)),
                       top_level_ops=tally.total("ops"), grid_steps=tally.total("grid_steps"),
                       kernels_without_grid=sorted(set(self.no_grid)),
                       top_instructions=top_instructions(self.own_instrs, executions, self.top)
                       if self.top and self.timing is not None else [],
                       exposed_groups=self.exposed_groups(executions))

    def exposed_groups(self, executions: dict[str, float]) -> list[ExposedGroup]:
        groups = [ExposedGroup(comp, executions.get(comp, 0.0), exposed, comm, compute,
                               tuple(sorted(members, key=lambda m: -m[1])))
                  for comp, exposed, comm, compute, members in self.exposed]
        return sorted(groups, key=lambda g: -g.exposed_seconds * g.executions)


def hlo_cost(hlo_text: str, categorize=None, timing: StepTiming | None = None,
             num_partitions: int | None = None, loop_trips: bool = True, top: int = 0,
             grouped_matmul_load: GroupedMatmulLoad | None = None, rules: CostRules | None = None) -> HloCost:
    """Cost of one execution of the module's ENTRY, per device. `categorize(op_name) -> str` files every
    instruction under a category from its metadata (instructions without one take their caller's);
    `timing` adds communication seconds with this overlap rule: an asynchronous collective (a start/done
    pair, or one inside the TPU compiler's async collective fusion) hides behind the roofline time of the
    instructions the compiled schedule places between its start and its done (`exposed_async_seconds`); a
    synchronous one is exposed in full. With `timing`, every top-level instruction also takes
    its own roofline time, max(its FLOPs / timing.peak_flops, its HBM bytes / timing.hbm_bandwidth)
    (``roofline_seconds``, and per category under "seconds"). ``loop_trips=False`` counts every loop
    body once, as XLA's own ``cost_analysis()`` does (to compare the two). ``top = n`` (with `timing`) lists
    the n top-level instructions with the most roofline seconds per step (`TopInstruction`).
    ``grouped_matmul_load``: what the megablox grouped matmuls' groups hold (`GroupedMatmulLoad`); each
    such call is then charged the row tiles it visits (`custom_call_cost`), not its declared estimate
    over the whole buffer (None: as declared). ``rules``: the conservative rules to apply (`CostRules`;
    None: none of them, the model as it was; glm5_jax.cost.hlo_cost.CONSERVATIVE: all)."""
    comps, entry = parse_computations(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    if num_partitions is None:
        m = re.search(r"num_partitions=(\d+)", hlo_text[:2000])
        num_partitions = int(m.group(1)) if m else 1
    walk = _Walk(comps, categorize or (lambda op_name: "all"), timing, num_partitions, loop_trips, top,
                 grouped_matmul_load, rules or CostRules())
    return walk.result(walk.cost(entry, False, "other"), entry)
