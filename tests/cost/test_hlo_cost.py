"""glm5_jax.cost.hlo_cost: matmul FLOPs of compiled programs with loop bodies multiplied by their trip counts."""
import jax
import jax.numpy as jnp
import pytest

from glm5_jax.cost.hlo_cost import StepTiming, hlo_cost, parse_computations

D, M = 128, 64

HAND_WRITTEN = """HloModule m, entry_computation_layout={(f32[64,128]{1,0}, f32[128,128]{1,0})->f32[64,128]{1,0}}

%fused_dot (param_0: f32[64,128], param_1: f32[128,128]) -> f32[64,128] {
  %param_0 = f32[64,128]{1,0} parameter(0)
  %param_1 = f32[128,128]{1,0} parameter(1)
  ROOT %convolution.1 = f32[64,128]{1,0} convolution(%param_0, %param_1), dim_labels=bf_io->bf
}

%body (p: (s32[], f32[64,128], f32[128,128])) -> (s32[], f32[64,128], f32[128,128]) {
  %p = (s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %h = f32[64,128]{1,0} get-tuple-element(%p), index=1
  %w = f32[128,128]{1,0} get-tuple-element(%p), index=2
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %fusion.1 = f32[64,128]{1,0} fusion(%h, %w), kind=kOutput, calls=%fused_dot
  ROOT %t = (s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) tuple(%next, %fusion.1, %w)
}

%cond (p.1: (s32[], f32[64,128], f32[128,128])) -> pred[] {
  %p.1 = (s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %limit = s32[] constant(7)
  ROOT %lt = pred[] compare(%i.1, %limit), direction=LT
}

ENTRY %main (x: f32[64,128], w.1: f32[128,128]) -> f32[64,128] {
  %x = f32[64,128]{1,0} parameter(0)
  %w.1 = f32[128,128]{1,0} parameter(1)
  %dot.0 = f32[64,128]{1,0} dot(%x, %w.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %zero = s32[] constant(2)
  %init = (s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) tuple(%zero, %dot.0, %w.1)
  %loop = (s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[64,128]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_hand_written_loop_counts_body_times_trip_count():
    cost = hlo_cost(HAND_WRITTEN)
    # the entry dot once + the loop body's convolution for i = 2..6 (5 trips)
    assert cost.loops == [("body", 5)]
    assert cost.flops == (1 + 5) * 2 * M * D * D
    # per trip the fusion reads h and w and writes h, the counter add reads 2 and writes 1 s32; the entry
    # dot reads x, w and writes its result
    f32 = s32 = 4
    assert cost.bytes_accessed == 5 * (f32 * (2 * M * D + D * D) + 3 * s32) + f32 * (2 * M * D + D * D)


def test_unknown_trip_count_is_counted_once_and_reported():
    cost = hlo_cost(HAND_WRITTEN.replace("%zero = s32[] constant(2)", "%zero = s32[] parameter(2)"))
    assert cost.loops == [("body", None)] and cost.unknown_trip_loops == 1
    assert cost.flops == 2 * 2 * M * D * D


@pytest.mark.parametrize("layers", [3, 8])
def test_scanned_matmuls_on_cpu(layers):
    """A grad of a scanned stack of matmuls compiled by XLA:CPU: the loop-aware count is the true one,
    while XLA's own cost analysis counts one loop trip."""
    def loss(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return h.sum()

    ws = jax.ShapeDtypeStruct((layers, D, D), jnp.float32)
    x = jax.ShapeDtypeStruct((M, D), jnp.float32)
    compiled = jax.jit(jax.grad(loss)).lower(ws, x).compile()
    cost = hlo_cost(compiled.as_text())
    # forward h @ w, backward dh @ w.T and h.T @ dh: 3 matmuls of 2 M D D per layer
    assert cost.flops == 3 * 2 * M * D * D * layers
    assert cost.unknown_trip_loops == 0 and all(t == layers for _, t in cost.loops)
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, (list, tuple)) else xla
    assert xla["flops"] < 0.6 * cost.flops        # the undercount this module exists for


def test_batched_matmul_written_as_dilated_convolution():
    """The TPU compiler's form of a batched matmul [b, m, k] x [b, k, n]: batch as a spatial dim with
    window size = lhs_dilate = b, so each window meets one real input element (from a v5p compile)."""
    text = HAND_WRITTEN.replace(
        "%dot.0 = f32[64,128]{1,0} dot(%x, %w.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        "%a = bf16[128,4,80]{2,1,0} parameter(2)\n  %b = bf16[128,64,80]{2,1,0} parameter(3)\n"
        "  %conv = f32[128,4,64]{2,1,0} convolution(%a, %b), window={size=128 stride=127 lhs_dilate=128}, "
        "dim_labels=0bf_0oi->0bf\n  %dot.0 = f32[64,128]{1,0} parameter(4)")
    cost = hlo_cost(text)
    # 128 independent [4, 80] x [80, 64] products, plus the loop's 5 trips of the [64,128]x[128,128] matmul
    assert cost.flops == 128 * 2 * 4 * 80 * 64 + 5 * 2 * M * D * D


def test_computation_closed_with_attributes():
    """'}, execution_thread="sparsecore"' closes a computation like '}' (the next one must still parse)."""
    root = "  ROOT %t = (s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) tuple(%next, %fusion.1, %w)\n"
    text = HAND_WRITTEN.replace(root + "}", root + '}, execution_thread="sparsecore"')
    assert text != HAND_WRITTEN
    assert hlo_cost(text).flops == hlo_cost(HAND_WRITTEN).flops == 6 * 2 * M * D * D


def test_batched_matmul_written_as_padded_convolution():
    """The other TPU form, seen for per-head einsums of MLA ('bthv,hvd->btd'): heads as a spatial dim of
    the kernel, the input's spatial dim of size 1 padded by size - 1 on both sides: one real tap each."""
    text = HAND_WRITTEN.replace(
        "%dot.0 = f32[64,128]{1,0} dot(%x, %w.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        "%a = bf16[128,6144,1]{1,0,2} parameter(2)\n  %b = bf16[64,256,6144]{2,1,0} parameter(3)\n"
        "  %conv = f32[128,64,256]{2,0,1} convolution(%a, %b), window={size=64 pad=63_63 rhs_reversal=1}, "
        "dim_labels=bf0_0oi->b0f\n  %dot.0 = f32[64,128]{1,0} parameter(4)")
    # 64 heads x [128, 6144] x [6144, 256]
    assert hlo_cost(text).flops == 64 * 2 * 128 * 6144 * 256 + 5 * 2 * M * D * D


def test_padded_convolution_with_spatial_dims_named_out_of_order():
    """Two spatial dims whose labels come in the order 1, 0 (from a v5p compile of 'btd,dhk->bthk' at batch
    2 x 2048): the window lists dims by number (size=1x64: dim 0 has a window of 1, dim 1 the 64 heads),
    not in label order; one real tap per output position either way."""
    text = HAND_WRITTEN.replace(
        "%dot.0 = f32[64,128]{1,0} dot(%x, %w.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        "%a = bf16[2,2048,6144,1]{2,1,3,0} parameter(2)\n  %b = bf16[64,256,6144,1]{1,2,0,3} parameter(3)\n"
        "  %conv = f32[2,2048,64,256]{1,3,2,0} convolution(%a, %b), window={size=1x64 pad=0_0x63_63 "
        "rhs_reversal=0x1}, dim_labels=0bf1_1oi0->0b1f\n  %dot.0 = f32[64,128]{1,0} parameter(4)")
    # 2 x 2048 tokens x 64 heads x [6144] . [6144, 256]
    assert hlo_cost(text).flops == 2 * (2 * 2048 * 64 * 256) * 6144 + 5 * 2 * M * D * D


def test_fallback_trip_count_reads_the_counter_step():
    """`i = 2; while i < 30: i += 3` runs for i = 2, 5, ..., 29: 10 trips (not 28)."""
    text = HAND_WRITTEN.replace("%one = s32[] constant(1)", "%one = s32[] constant(3)").replace(
        "%limit = s32[] constant(7)", "%limit = s32[] constant(30)")
    cost = hlo_cost(text)
    assert cost.loops == [("body", 10)]
    assert cost.flops == (1 + 10) * 2 * M * D * D


def test_fallback_trip_count_unknown_when_the_step_is_not_a_constant():
    text = HAND_WRITTEN.replace("%next = s32[] add(%i, %one)", "%next = s32[] multiply(%i, %one)")
    assert hlo_cost(text).loops == [("body", None)]


@pytest.mark.parametrize("n, size, stride, lo, hi, lhs_dilate", [
    (32, 32, 32, 31, 31, 31),      # the window that min(ceil(size / dilate), n) counted as 2 taps each
    (128, 128, 127, 0, 0, 128),    # a batched matmul as a dilated convolution: one tap per window
    (1, 64, 1, 63, 63, 1),         # ... as a padded convolution: one tap per window
    (10, 3, 2, 1, 2, 3),           # an ordinary strided, padded, dilated window
])
def test_convolution_counts_real_input_taps(n, size, stride, lo, hi, lhs_dilate):
    """FLOPs of a convolution = 2 x (taps meeting a real input element) x features. The reference
    count is XLA:CPU's own convolution of all-ones operands: each output element sums its real taps."""
    f_in, f_out = 3, 5
    ones = jax.lax.conv_general_dilated(
        jnp.ones((1, 1, n)), jnp.ones((1, 1, size)), window_strides=(stride,), padding=[(lo, hi)],
        lhs_dilation=(lhs_dilate,), dimension_numbers=("NCH", "OIH", "NCH"))
    taps, out_n = int(ones.sum()), ones.shape[-1]
    text = HAND_WRITTEN.replace(
        "%dot.0 = f32[64,128]{1,0} dot(%x, %w.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        f"%a = f32[1,{f_in},{n}]{{2,1,0}} parameter(2)\n  %b = f32[{f_out},{f_in},{size}]{{2,1,0}} parameter(3)\n"
        f"  %conv = f32[1,{f_out},{out_n}]{{2,1,0}} convolution(%a, %b), window={{size={size} stride={stride} "
        f"pad={lo}_{hi} lhs_dilate={lhs_dilate}}}, dim_labels=bf0_oi0->bf0\n"
        "  %dot.0 = f32[64,128]{1,0} parameter(4)")
    assert hlo_cost(text).flops == 2 * taps * f_in * f_out + 5 * 2 * M * D * D


RAGGED_CUSTOM_CALL = """HloModule m

ENTRY %main (lhs: bf16[512,256], rhs: bf16[4,256,384], sizes: s32[4]) -> bf16[512,384] {
  %lhs = bf16[512,256]{1,0} parameter(0)
  %rhs = bf16[4,256,384]{2,1,0} parameter(1)
  %sizes = s32[4]{0} parameter(2)
  %meta = (s32[5]{0}, s32[7]{0}) custom-call(%sizes), custom_call_target="tpu_custom_call", metadata={op_name="ragged-dot-metadata"}
  ROOT %out = bf16[512,384]{1,0} custom-call(%sizes, %lhs, %rhs), custom_call_target="tpu_custom_call", frontend_attributes={ragged_dot_tiling="128,256,384"}, metadata={op_name="jit(f)/ragged_dot_general/ragged-dot-none"}
}
"""


def test_ragged_dot_kernel_without_cost_estimate_counted_from_shapes():
    cost = hlo_cost(RAGGED_CUSTOM_CALL)
    # [512, 256] rows, each against one group's [256, 384]; the metadata kernel (integer results) is free
    assert cost.kernel_flops == 2 * 512 * 256 * 384 and cost.flops == 0
    assert cost.uncounted_custom_calls == []
    unknown = RAGGED_CUSTOM_CALL.replace('frontend_attributes={ragged_dot_tiling="128,256,384"}, ', "").replace(
        "ragged_dot_general/ragged-dot-none", "some_kernel")
    assert hlo_cost(unknown).uncounted_custom_calls == ["jit(f)/some_kernel"]


def test_kernel_cost_estimate_printed_over_several_lines_is_counted():
    """XLA prints some Mosaic calls' backend config as multi-line JSON (seen for a Pallas kernel in a while
    loop, wrapped in a kCustom fusion), its continuation lines starting with "}": the instruction is read
    whole, the kernel's declared FLOPs and bytes counted, and the computation goes on past it."""
    text = """HloModule m

%kernel_fusion (p.0: f32[8,128]) -> f32[8,128] {
  %p.0 = f32[8,128]{1,0} parameter(0)
  ROOT %k = f32[8,128]{1,0} custom-call(%p.0), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/my_kernel/pallas_call"}, backend_config={"custom_call_config": {"body": "TUzv", "cost_estimate": {
"bytes_accessed":4096,
"flops":1000000,
"transcendentals":0
}, "serialization_format": 1}}
  %unused = f32[8,128]{1,0} add(%p.0, %p.0)
}

ENTRY %main (x: f32[8,128]) -> f32[8,8] {
  %x = f32[8,128]{1,0} parameter(0)
  %f = f32[8,128]{1,0} fusion(%x), kind=kCustom, calls=%kernel_fusion
  ROOT %y = f32[8,8]{1,0} dot(%f, %x), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}
"""
    comps, entry = parse_computations(text)
    assert entry == "main" and list(comps["kernel_fusion"]) == ["p.0", "k", "unused"]
    cost = hlo_cost(text)
    assert cost.uncounted_custom_calls == [] and cost.kernel_flops == 1_000_000
    assert cost.flops == 2 * 8 * 8 * 128


def test_kernel_fused_into_an_update_slice_is_charged_its_declared_bytes():
    """The TPU compiler fuses a Mosaic kernel with the dynamic-update-slice that stores its output into a
    loop's stacked buffer (a kCustom fusion). Hand count: the kernel declares 4096 bytes (its reads of x and
    its write, wherever it lands); the stacked buffer [4, 8, 128] is updated in place (not read, its other
    slices not written); y is read by a negate (4096 bytes) whose output is written (4096 bytes); the s32
    slice index is read (4 bytes): 12292 bytes. Charging the fusion's operands and results in full would count the 16 KiB buffer too."""
    text = """HloModule m

%kernel_fusion (p.0: f32[4,8,128], p.1: s32[], p.2: f32[8,128], p.3: f32[8,128]) -> (f32[4,8,128], f32[8,128]) {
  %p.0 = f32[4,8,128]{2,1,0} parameter(0)
  %p.1 = s32[] parameter(1)
  %p.2 = f32[8,128]{1,0} parameter(2)
  %p.3 = f32[8,128]{1,0} parameter(3)
  %k = f32[8,128]{1,0} custom-call(%p.2), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/my_kernel/pallas_call"}, backend_config={"custom_call_config": {"cost_estimate": {"bytes_accessed":4096, "flops":0, "transcendentals":0}}}
  %b = f32[1,8,128]{2,1,0} bitcast(%k)
  %zero = s32[] constant(0)
  %dus = f32[4,8,128]{2,1,0} dynamic-update-slice(%p.0, %b, %p.1, %zero, %zero)
  %neg = f32[8,128]{1,0} negate(%p.3)
  ROOT %t = (f32[4,8,128]{2,1,0}, f32[8,128]{1,0}) tuple(%dus, %neg)
}

ENTRY %main (buf: f32[4,8,128], i: s32[], x: f32[8,128], y: f32[8,128]) -> (f32[4,8,128], f32[8,128]) {
  %buf = f32[4,8,128]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = f32[8,128]{1,0} parameter(2)
  %y = f32[8,128]{1,0} parameter(3)
  ROOT %f = (f32[4,8,128]{2,1,0}, f32[8,128]{1,0}) fusion(%buf, %i, %x, %y), kind=kCustom, calls=%kernel_fusion
}
"""
    cost = hlo_cost(text)
    assert cost.uncounted_custom_calls == [] and cost.bytes_accessed == 4096 + 2 * 8 * 128 * 4 + 4


def test_top_instructions_multiply_loop_trips_and_sum_to_the_roofline():
    """Per instruction, hand-timed at 1 FLOP/s and 1 byte/s (so seconds = max(FLOPs, bytes)): the body's
    fusion runs 5 times a step, the entry dot once; together with the counter add they are the whole
    roofline."""
    cost = hlo_cost(HAND_WRITTEN, timing=StepTiming(1.0, 1.0, lambda op: 0.0), top=10)
    top = {t.name: t for t in cost.top_instructions}
    assert set(top) == {"fusion.1", "dot.0", "next"}
    matmul, f32 = 2 * M * D * D, 4
    fusion = top["fusion.1"]
    assert (fusion.computation, fusion.opcode, fusion.executions) == ("body", "fusion", 5)
    assert fusion.flops == 5 * matmul and fusion.bytes == 5 * f32 * (2 * M * D + D * D)
    assert fusion.seconds == 5 * max(matmul, f32 * (2 * M * D + D * D))
    assert (top["dot.0"].executions, top["dot.0"].flops) == (1, matmul)
    assert (top["next"].executions, top["next"].bytes) == (5, 5 * 3 * 4)
    assert [t.name for t in cost.top_instructions] == ["fusion.1", "dot.0", "next"]      # dearest first
    assert sum(t.seconds for t in cost.top_instructions) == pytest.approx(cost.roofline_seconds, rel=1e-12)
    assert hlo_cost(HAND_WRITTEN, timing=StepTiming(1.0, 1.0, lambda op: 0.0), top=1).top_instructions[0].name \
        == "fusion.1"
