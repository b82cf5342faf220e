"""glm5_jax.cost.collectives (replica groups -> partition ids -> mesh axes) and glm5_jax.cost.ici (v5p torus
time of a collective), against hand-built groups and hand-computed link times."""
import numpy as np
import pytest

from glm5_jax.cost.collectives import collective_groups, moved_bytes, spanned_axes
from glm5_jax.cost.hlo_cost import CollectiveOp, StepTiming, exposed_async_seconds, hlo_cost
from glm5_jax.cost.hlo_cost.timing import exposed_async_groups
from glm5_jax.cost.ici import V5P_LINK_BYTES_PER_S, CollectiveModel


@pytest.mark.parametrize("attrs, groups", [
    ("replica_groups={{0,2},{1,3}}, dimensions={0}", ((0, 2), (1, 3))),
    ("replica_groups={}", ((0, 1, 2, 3),)),
    ("replica_groups=[2,2]<=[4]", ((0, 1), (2, 3))),
    ("replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}", ((0, 2), (1, 3))),
    # a group varies the named axes of a device mesh laid out as arange(4).reshape(2, 1, 2)
    ("replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=2] {'axis_0'}, dimensions={1}", ((0, 2), (1, 3))),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_1'}", ((0, 1), (2, 3))),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0','axis_1'}", ((0, 1, 2, 3),)),
    ("source_target_pairs={{0,1},{1,0},{2,2}}", ((0, 1), (1, 0), (2, 2))),
])
def test_collective_groups_forms(attrs, groups):
    assert collective_groups(attrs, 4) == groups


def test_spanned_axes_follow_the_device_assignment():
    # partition p sits at np.unravel_index(p, (data 1, fsdp 2, expert 2, tensor 1)): p = 2 * fsdp + expert
    names, sizes = ("data", "fsdp", "expert", "tensor"), (1, 2, 2, 1)
    assert spanned_axes(((0, 2), (1, 3)), names, sizes) == ("fsdp",)
    assert spanned_axes(((0, 1), (2, 3)), names, sizes) == ("expert",)
    assert spanned_axes(((0, 1, 2, 3),), names, sizes) == ("fsdp", "expert")
    assert spanned_axes(((0, 0), (1, 3), (3, 1)), names, sizes) == ("fsdp",)     # permute: first moving pair


def test_moved_bytes_per_algorithm():
    assert moved_bytes("all-gather", 1000, 4) == 750
    assert moved_bytes("reduce-scatter", 1000, 4) == 750
    assert moved_bytes("all-reduce", 1000, 4) == 1500
    assert moved_bytes("all-to-all", 1000, 4) == 750
    assert moved_bytes("collective-permute", 1000, 2) == 1000
    assert moved_bytes("all-gather", 1000, 1) == 0


def _cube(n):
    return [(x, y, z) for z in range(n) for y in range(n) for x in range(n)]


def test_ici_times_on_a_torus_and_a_line():
    W = V5P_LINK_BYTES_PER_S
    torus = CollectiveModel(_cube(4), (4, 4, 4))           # 4x4x4: wraparound on every dim
    ring_x = tuple(range(4))                               # partitions 0..3 differ in x only
    op = CollectiveOp("all-gather", 4 * 10**6, (ring_x,), False, "x")
    # a full ring, both directions: 3/4 of the result over 2 links
    assert torus.seconds(op) == pytest.approx(3e6 / (2 * W))
    # all-to-all on the same ring: 3e6 bytes leave each chip, mean hop count (1 + 2 + 1) / 3
    a2a = CollectiveOp("all-to-all", 4 * 10**6, (ring_x,), False, "x")
    assert torus.seconds(a2a) == pytest.approx(3e6 * (4 / 3) / (2 * W))
    # a pair of neighbours: its two rings' edges take the one link between them, each way: one link
    pair = CollectiveOp("all-reduce", 10**6, ((0, 1),), False, "x")
    assert torus.seconds(pair) == pytest.approx(2 * 0.5e6 / W)
    # x and y at once (16 chips, 2 rings): 15/16 of the result over 4 links
    plane = tuple(range(16))
    assert torus.seconds(CollectiveOp("all-gather", 16 * 10**6, (plane,), False, "x")) == \
        pytest.approx(15e6 / (4 * W))
    # a 2x2x1 slice has no wraparound
    small = CollectiveModel([(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)], (2, 2, 1))
    assert small.seconds(CollectiveOp("all-gather", 2 * 10**6, ((0, 1), (2, 3)), False, "x")) == \
        pytest.approx(1e6 / W)
    # pairs 4 hops apart on an 8-ring, interleaved ({0,4}, {1,5}, {2,6}, {3,7}): a pair's edges go 4 hops
    # forward (first ring) and 4 hops backward (second ring), so every directed link carries one edge of
    # each of the 4 pairs: 1e6 bytes at 2 W / 4
    ring8 = CollectiveModel([(x, 0, 0) for x in range(8)], (8, 4, 4))
    spaced = CollectiveOp("all-gather", 2 * 10**6, ((0, 4), (1, 5), (2, 6), (3, 7)), False, "x")
    assert ring8.seconds(spaced) == pytest.approx(1e6 / (2 * W / 4))
    # the same chips paired with their neighbours ({0,1}, {2,3}, ...): each pair has its own link
    near = CollectiveOp("all-gather", 2 * 10**6, ((0, 1), (2, 3), (4, 5), (6, 7)), False, "x")
    assert ring8.seconds(near) == pytest.approx(1e6 / W)
    # the step latency: a ring over 4 positions takes 3 steps (6 for an all-reduce)
    slow = CollectiveModel(_cube(4), (4, 4, 4), step_latency=1e-6)
    assert slow.seconds(op) == pytest.approx(3e6 / (2 * W) + 3e-6)
    assert slow.seconds(CollectiveOp("all-reduce", 4 * 10**6, (ring_x,), False, "x")) == \
        pytest.approx(2 * 3e6 / (2 * W) + 6e-6)
    # a permute to the chip two hops away
    assert torus.seconds(CollectiveOp("collective-permute", 10**6, ((0, 2), (2, 0)), True, "x")) == \
        pytest.approx(2e6 / W)


ASYNC_STEP = """HloModule m, num_partitions=4

ENTRY %main (x: f32[64,128], w: f32[128,128], g: f32[1000]) -> (f32[64,128], f32[4000]) {
  %x = f32[64,128]{1,0} parameter(0)
  %w = f32[128,128]{1,0} parameter(1)
  %g = f32[1000]{0} parameter(2)
  %ag = f32[4000]{0} all-gather(%g), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, metadata={op_name="a"}
  %ags = (f32[1000]{0}, f32[4000]{0}) all-gather-start(%g), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}, metadata={op_name="b"}
  %dot = f32[64,128]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="c"}
  %agd = f32[4000]{0} all-gather-done(%ags)
  ROOT %t = (f32[64,128]{1,0}, f32[4000]{0}) tuple(%dot, %agd)
}
"""


def test_overlap_rule_exposes_sync_collectives_and_hides_async_ones_behind_compute():
    seconds = {"a": 3.0, "b": 5.0}
    timing = StepTiming(peak_flops=2 * 64 * 128 * 128 / 2.0, hbm_bandwidth=1e30,     # the dot takes 2 s
                        collective_seconds=lambda op: seconds[op.category])
    cost = hlo_cost(ASYNC_STEP, categorize=lambda name: name, timing=timing)
    ops = {op.category: (op, n) for op, n in cost.collectives.items()}
    assert ops["a"][0] == CollectiveOp("all-gather", 16000, ((0, 1, 2, 3),), False, "a") and ops["a"][1] == 1
    assert ops["b"][0].is_async and ops["b"][0].nbytes == 16000
    assert cost.comm_seconds == 8.0
    # sync 3 s in full + async 5 s less the 2 s of compute scheduled between its start and done
    assert cost.exposed_comm_seconds == 3.0 + (5.0 - 2.0)
    assert np.isclose(cost.by_category["flops"]["c"], 2 * 64 * 128 * 128)
    # the same dot scheduled after the done overlaps nothing: both collectives exposed in full
    lines = ASYNC_STEP.split("\n")
    dot = next(k for k, line in enumerate(lines) if line.startswith("  %dot = "))
    lines[dot], lines[dot + 1] = lines[dot + 1], lines[dot]
    after = "\n".join(lines)
    assert after.index("%agd = ") < after.index("%dot = ")
    assert hlo_cost(after, categorize=lambda name: name, timing=timing).exposed_comm_seconds == 8.0


def test_async_windows_share_the_compute_between_start_and_done():
    seconds = [1.0, 2.0, 4.0, 8.0, 16.0]         # roofline seconds of five scheduled instructions
    # one collective of 5 s from 0 to 3 runs beside instructions 1 and 2 (6 s): hidden
    assert exposed_async_seconds([(0, 3, 5.0)], seconds) == 0.0
    # two overlapping windows (0..3, 2..4: union 1..3, 14 s) in flight together with 20 s: 6 s exposed
    assert exposed_async_seconds([(0, 3, 10.0), (2, 4, 10.0)], seconds) == 20.0 - (2 + 4 + 8)
    # disjoint windows each hide behind their own compute only: 0..2 (2 s) and 2..4 (8 s)
    assert exposed_async_seconds([(0, 2, 3.0), (2, 4, 3.0)], seconds) == 1.0
    # a done scheduled before its start wraps round a loop body: 3..(next trip)1 runs beside 4 and 0
    assert exposed_async_seconds([(3, 1, 20.0)], seconds) == 20.0 - (16 + 1)
    # no done: to the end of the computation
    assert exposed_async_seconds([(2, 5, 30.0)], seconds) == 30.0 - (8 + 16)
    # the groups behind those sums: (exposed, collectives, compute beside them, what each window is)
    assert exposed_async_groups([(0, 3, 10.0, "x"), (2, 4, 10.0, "y"), (4, 5, 1.0, "z")], seconds) == \
        [(6.0, 20.0, 14.0, ["x", "y"]), (1.0, 1.0, 0.0, ["z"])]   # nothing is scheduled strictly inside 4..5
    assert exposed_async_groups([(0, 3, 5.0, "x")], seconds) == []     # hidden: no group


LOOPED_ASYNC = """HloModule m, num_partitions=4

%body (p: (s32[], f32[64,128], f32[128,128], f32[1000])) -> (s32[], f32[64,128], f32[128,128], f32[1000]) {
  %p = (s32[], f32[64,128]{1,0}, f32[128,128]{1,0}, f32[1000]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %h = f32[64,128]{1,0} get-tuple-element(%p), index=1
  %w = f32[128,128]{1,0} get-tuple-element(%p), index=2
  %g = f32[1000]{0} get-tuple-element(%p), index=3
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %ags = (f32[1000]{0}, f32[4000]{0}) all-gather-start(%g), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}, metadata={op_name="b"}
  %dot = f32[64,128]{1,0} dot(%h, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="c"}
  %agd = f32[4000]{0} all-gather-done(%ags)
  %s = f32[1000]{0} slice(%agd), slice={[0:1000]}
  ROOT %t = (s32[], f32[64,128]{1,0}, f32[128,128]{1,0}, f32[1000]{0}) tuple(%next, %dot, %w, %s)
}

%cond (p.1: (s32[], f32[64,128], f32[128,128], f32[1000])) -> pred[] {
  %p.1 = (s32[], f32[64,128]{1,0}, f32[128,128]{1,0}, f32[1000]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %limit = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %limit), direction=LT
}

ENTRY %main (x: f32[64,128], w: f32[128,128], g: f32[1000]) -> f32[64,128] {
  %x = f32[64,128]{1,0} parameter(0)
  %w = f32[128,128]{1,0} parameter(1)
  %g = f32[1000]{0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[64,128]{1,0}, f32[128,128]{1,0}, f32[1000]{0}) tuple(%zero, %x, %w, %g)
  %loop = (s32[], f32[64,128]{1,0}, f32[128,128]{1,0}, f32[1000]{0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[64,128]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_exposed_groups_name_their_collectives_and_count_loop_trips():
    timing = StepTiming(peak_flops=2 * 64 * 128 * 128 / 2.0, hbm_bandwidth=1e30,     # the dot takes 2 s
                        collective_seconds=lambda op: 5.0)
    cost = hlo_cost(ASYNC_STEP, categorize=lambda name: name, timing=timing)
    # the sync all-gather is exposed in full but is no async group; the async one shows 5 - 2 s
    assert [(g.computation, g.executions, g.exposed_seconds, g.collective_seconds, g.compute_seconds,
             g.collectives) for g in cost.exposed_groups] == [("main", 1.0, 3.0, 5.0, 2.0, (("ags", 5.0),))]
    looped = hlo_cost(LOOPED_ASYNC, categorize=lambda name: name, timing=timing)
    assert looped.loops == [("body", 3)]
    (group,) = looped.exposed_groups
    assert (group.computation, group.executions, group.exposed_seconds) == ("body", 3.0, 3.0)
    assert looped.exposed_comm_seconds == 3 * 3.0


# The TPU compiler's async collective fusion (libtpu flag --xla_tpu_enable_async_collective_fusion): one
# all-gather written three times, in the fusion that starts it (async-collective-start), in the compute
# fusion it runs beside (computation async_collective_fusion.N) and in the fusion that waits for it
# (async-collective-done); a plain fusion may also carry a (synchronous) collective.
FUSED_STEP = """HloModule m, num_partitions=4

%fused_computation.1 (s0: f32[1000]) -> f32[4000] {
  %s0 = f32[1000]{0} parameter(0)
  %ag.1 = f32[4000]{0} all-gather(%s0), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, metadata={op_name="b"}
  ROOT %cc.1 = f32[4000]{0} custom-call(%ag.1), custom_call_target="AsyncCollectiveStart"
}

%fused_computation.2 (r0: f32[1000]) -> f32[4000] {
  %r0 = f32[1000]{0} parameter(0)
  %ag.2 = f32[4000]{0} all-gather(%r0), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, metadata={op_name="b"}
  ROOT %cc.2 = f32[4000]{0} custom-call(%ag.2), custom_call_target="AsyncCollectiveDone"
}

%async_collective_fusion.7 (p0: f32[1000], p1: f32[64,128], p2: f32[128,128]) -> (f32[4000], f32[64,128]) {
  %p0 = f32[1000]{0} parameter(0)
  %p1 = f32[64,128]{1,0} parameter(1)
  %p2 = f32[128,128]{1,0} parameter(2)
  %ag = f32[4000]{0} all-gather(%p0), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, metadata={op_name="b"}
  %d = f32[64,128]{1,0} dot(%p1, %p2), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="c"}
  ROOT %t = (f32[4000]{0}, f32[64,128]{1,0}) tuple(%ag, %d)
}

%fused_computation.3 (q0: f32[1000]) -> f32[1000] {
  %q0 = f32[1000]{0} parameter(0)
  ROOT %ar = f32[1000]{0} all-reduce(%q0), channel_id=2, replica_groups={{0,1,2,3}}, to_apply=%add, metadata={op_name="a"}
}

ENTRY %main (x: f32[64,128], w: f32[128,128], g: f32[1000]) -> f32[64,128] {
  %x = f32[64,128]{1,0} parameter(0)
  %w = f32[128,128]{1,0} parameter(1)
  %g = f32[1000]{0} parameter(2)
  %s = f32[1000]{0} fusion(%g), kind=kCustom, calls=%fused_computation.3, metadata={op_name="a"}
  %async-collective-start = f32[4000]{0} fusion(%s), kind=kCustom, calls=%fused_computation.1, metadata={op_name="b"}
  %f = (f32[4000]{0}, f32[64,128]{1,0}) fusion(%s, %x, %w), kind=kOutput, calls=%async_collective_fusion.7, metadata={op_name="c"}
  %async-collective-done = f32[4000]{0} fusion(%s), kind=kCustom, calls=%fused_computation.2, metadata={op_name="b"}
  ROOT %o = f32[64,128]{1,0} get-tuple-element(%f), index=1
}
"""


def test_async_collective_fusion_hides_behind_compute_and_fused_sync_collectives_stay_exposed():
    seconds = {"a": 3.0, "b": 5.0}
    timing = StepTiming(peak_flops=2 * 64 * 128 * 128 / 2.0, hbm_bandwidth=1e30,     # the dot takes 2 s
                        collective_seconds=lambda op: seconds[op.category])
    cost = hlo_cost(FUSED_STEP, categorize=lambda name: name, timing=timing)
    ops = {op.category: op for op in cost.collectives}
    assert sorted(cost.collectives.values()) == [1.0, 1.0]            # the all-gather counted once
    assert ops["b"].kind == "all-gather" and ops["b"].is_async
    assert ops["a"].kind == "all-reduce" and not ops["a"].is_async
    assert cost.comm_seconds == 8.0
    # the fused all-reduce (sync) in full + the fused all-gather (async) less the 2 s of the dot beside it
    assert cost.exposed_comm_seconds == 3.0 + (5.0 - 2.0)
    # HBM: the all-reduce fusion reads g and writes s; the all-gather's data once, at its start (reads s,
    # writes the gathered 4000); the compute fusion reads x and w and writes the dot (s, the collective's
    # operand, and its result in the tuple are the collective's buffers); the done fusion only waits
    f32 = 4
    assert cost.bytes_accessed == f32 * (2 * 1000 + (1000 + 4000) + (2 * 64 * 128 + 128 * 128))


# A reduce-scatter the TPU compiler offloads to the SparseCores (libtpu flag
# --xla_tpu_enable_sparse_core_collective_offload_reduce_scatter), as it compiles one: an async call on the
# "sparsecore" thread whose computation is the collective, its groups in the mesh form; the call's
# result tuple aliases the operand.
SPARSECORE_STEP = """HloModule m, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%called_computation.1 (param_0: f32[4096,128], param_1: token[]) -> f32[1024,128] {
  %param_1 = token[] parameter(1)
  %param_0 = f32[4096,128]{1,0:T(8,128)} parameter(0)
  ROOT %reduce-scatter.1 = f32[1024,128]{1,0:T(8,128)} reduce-scatter(%param_0), channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}, use_global_device_ids=true, dimensions={0}, to_apply=%add
}, execution_thread="sparsecore"

ENTRY %main (x: f32[64,128], w: f32[128,128], g: f32[4096,128]) -> (f32[64,128], f32[1024,128]) {
  %x = f32[64,128]{1,0:T(8,128)} parameter(0)
  %w = f32[128,128]{1,0:T(8,128)} parameter(1)
  %g = f32[4096,128]{1,0:T(8,128)} parameter(2)
  %token = token[] after-all()
  %rs-start = ((f32[4096,128]{1,0:T(8,128)}, token[]), f32[1024,128]{1,0:T(8,128)}) call-start(%g, %token), async_execution_thread="sparsecore", to_apply=%called_computation.1
  %dot = f32[64,128]{1,0:T(8,128)} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="c"}
  %rs-done = f32[1024,128]{1,0:T(8,128)} call-done(%rs-start)
  ROOT %t = (f32[64,128]{1,0:T(8,128)}, f32[1024,128]{1,0:T(8,128)}) tuple(%dot, %rs-done)
}
"""


def test_sparsecore_offloaded_reduce_scatter_is_async_and_charged_once():
    timing = StepTiming(peak_flops=2 * 64 * 128 * 128 / 2.0, hbm_bandwidth=1e30,     # the dot takes 2 s
                        collective_seconds=lambda op: 5.0)
    cost = hlo_cost(SPARSECORE_STEP, categorize=lambda name: name, timing=timing)
    (op, n), = cost.collectives.items()
    assert n == 1 and op.kind == "reduce-scatter" and op.is_async
    assert op.groups == ((0, 1, 2, 3),) and op.nbytes == 4 * 4096 * 128
    # 5 s in flight beside the 2 s dot scheduled between the call's start and done
    assert cost.comm_seconds == 5.0 and cost.exposed_comm_seconds == 5.0 - 2.0
    # HBM: the dot reads x, w and writes its result; the SparseCores read the operand and write the
    # scattered result once (the call's aliasing result tuple moves nothing)
    f32 = 4
    assert cost.bytes_accessed == f32 * (2 * 64 * 128 + 128 * 128) + f32 * (4096 + 1024) * 128


def test_collective_without_metadata_is_filed_with_what_it_moves():
    """A reduce-scatter the compiler made (no op_name) takes the category of the gradient it scatters: its
    first operand with metadata; with none, the category it inherits ("other" at the entry)."""
    named = SPARSECORE_STEP.replace(
        "  %token = token[] after-all()\n",
        '  %token = token[] after-all()\n  %grad = f32[4096,128]{1,0:T(8,128)} multiply(%g, %g), '
        'metadata={op_name="wgrad"}\n').replace("call-start(%g, %token)", "call-start(%grad, %token)")
    assert named != SPARSECORE_STEP
    (op, _), = hlo_cost(named, categorize=lambda name: name).collectives.items()
    assert op.category == "wgrad"
    # through an unnamed bitcast of the gradient
    hop = named.replace("call-start(%grad, %token)", "call-start(%flat, %token)").replace(
        'metadata={op_name="wgrad"}\n',
        'metadata={op_name="wgrad"}\n  %flat = f32[4096,128]{1,0:T(8,128)} bitcast(%grad)\n')
    assert hop.index("%grad = ") < hop.index("%flat = ") < hop.index("call-start(%flat")
    (op, _), = hlo_cost(hop, categorize=lambda name: name).collectives.items()
    assert op.category == "wgrad"
    (op, _), = hlo_cost(SPARSECORE_STEP, categorize=lambda name: name).collectives.items()
    assert op.category == "other"
