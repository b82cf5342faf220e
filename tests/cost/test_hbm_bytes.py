"""glm5_jax.cost.hlo_cost's HBM-byte rules on small programs compiled for v5p by libtpu (no TPU), each
against a hand count from the compiled HLO's layouts: arrays in VMEM move no HBM bytes; an async copy
counts its source and destination once; row gathers and scatters touch whole (8, 128) tiles; dynamic
slices and in-place updates move whole sub-tile rows; and each op is timed at its own roofline."""
import importlib.util

import jax
import jax.numpy as jnp
import pytest

from glm5_jax.cost.hlo_cost import StepTiming, hlo_cost, laid_out

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not importable (pip install -r requirements-tpu.txt)")
F32, BF16, S32 = 4, 2, 4
BIG = 1 << 20          # rows of a table too large for VMEM (512 MiB of f32 rows of 128)


def _compile(fn, shapes, donate=()):
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices[0]
    args = [jax.ShapeDtypeStruct(shape, dt, sharding=SingleDeviceSharding(device)) for shape, dt in shapes]
    compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    xla = compiled.cost_analysis()
    return compiled.as_text(), (xla[0] if isinstance(xla, (list, tuple)) else xla)


def test_layouts_are_read_from_the_hlo():
    (a,) = laid_out("bf16[4096,6144]{1,0:T(8,128)(2,1)S(1)}")
    assert (a.dtype, a.shape, a.tile, a.subtile, a.memory_space) == ("bf16", (4096, 6144), (8, 128), (2, 1), 1)
    assert not a.in_hbm and a.hbm_bytes() == 0
    (b,) = laid_out("f32[3,100]{1,0:T(8,128)}")
    assert b.hbm_bytes() == F32 * 8 * 128                  # one tile, padded on both dims
    assert b.hbm_bytes((1, 100), "dma") == F32 * 1 * 128    # no sub-tiles: one row of the tile
    # tiles follow the layout's dim order: here dim 0 is the most minor (padded to 128), dim 1 next (to 8)
    (c,) = laid_out("f32[3,100]{0,1:T(8,128)}")
    assert c.minor_to_major == (0, 1) and c.hbm_bytes() == F32 * 128 * 104
    (d,) = laid_out("f32[2048,32,2]{0,2,1:T(8,128)}")          # 2048 minor, then 2: no padding of 2 to 128
    assert d.hbm_bytes() == F32 * 2048 * 8 * 32


def test_vmem_operands_and_the_async_copy_are_counted_once():
    """A 32 MiB table is prefetched into VMEM by a cross-program copy-start; the gather then reads VMEM."""
    text, _ = _compile(lambda t, i: t[i], [((65536, 128), jnp.float32), ((1024,), jnp.int32)])
    assert "copy-start" in text and "S(1)" in text
    table, rows = 65536 * 128 * F32, 1024 * 128 * F32
    # the copy reads the table from HBM once (its destination is VMEM); the index clamp reads the
    # indices (its result stays in VMEM); the gather writes its rows to HBM
    assert hlo_cost(text).bytes_accessed == table + 1024 * S32 + rows


@pytest.mark.parametrize("dtype,width,rows", [(jnp.float32, 128, 1024), (jnp.bfloat16, 6144, 512)])
def test_row_gather_reads_whole_tiles(dtype, width, rows):
    """Each gathered row of a T(8,128) table in HBM reads the 8-row tile it lies in (the rows' bytes x 8),
    as libtpu's own cost model charges it."""
    item = jnp.dtype(dtype).itemsize
    table_rows = BIG * 128 // width
    text, xla = _compile(lambda t, i: t[i], [((table_rows, width), dtype), ((rows,), jnp.int32)])
    expected = rows * 8 * width * item + rows * S32 + rows * width * item   # tiles read + indices + output
    ours = hlo_cost(text).bytes_accessed
    assert ours == expected
    assert ours == pytest.approx(xla["bytes accessed"], rel=0.01)


def test_in_place_scatter_add_reads_and_writes_the_touched_tiles():
    text, xla = _compile(lambda t, i, u: t.at[i].add(u),
                         [((BIG, 128), jnp.float32), ((1024,), jnp.int32), ((1024, 128), jnp.float32)], donate=(0,))
    tiles = 1024 * 8 * 128 * F32
    ours = hlo_cost(text).bytes_accessed
    assert ours == 2 * tiles + 1024 * S32 + 1024 * 128 * F32          # read + write tiles, indices, updates
    assert ours == pytest.approx(xla["bytes accessed"], rel=0.01)


@pytest.mark.parametrize("update", [False, True])
def test_dynamic_slice_and_update_move_sub_tile_rows(update):
    """One bf16 row of a T(8,128)(2,1) array: the DMA moves the row pair sharing its 32-bit words."""
    shapes = [((BIG // 16, 6144), jnp.bfloat16), ((), jnp.int32)]
    if update:
        fn, donate = (lambda t, i, u: jax.lax.dynamic_update_slice_in_dim(t, u, i, 0)), (0,)
        shapes.append(((1, 6144), jnp.bfloat16))
    else:
        fn, donate = (lambda t, i: jax.lax.dynamic_slice_in_dim(t, i, 1, 0)), ()
    text, xla = _compile(fn, shapes, donate)
    pair = 2 * 6144 * BF16
    # slice: read a row pair, write the [1, 6144] result (laid out T(2,128): a row pair); update: read
    # the update, write a row pair; both: three 4-byte scalar ops clamp the start index
    ours = hlo_cost(text).bytes_accessed
    assert ours == 2 * pair + 3 * S32
    assert ours == pytest.approx(xla["bytes accessed"], rel=0.15)


def test_each_op_takes_its_own_roofline():
    """A compute-bound matmul and a memory-bound elementwise op: their times add, where one roofline for
    the whole program (max of summed FLOPs time and summed bytes time) would hide one behind the other."""
    n = 4096
    text, _ = _compile(lambda a, b, c: (a @ b, c * 2),
                       [((n, n), jnp.bfloat16), ((n, n), jnp.bfloat16), ((BIG, 128), jnp.float32)])
    flops_rate, bytes_rate = 1e14, 1e12
    cost = hlo_cost(text, timing=StepTiming(flops_rate, bytes_rate, lambda op: 0.0))
    matmul_s = 2 * n**3 / flops_rate                            # compute-bound: 1.37 ms
    scale_s = 2 * BIG * 128 * F32 / bytes_rate                  # read + write 512 MiB: 1.07 ms
    # libtpu prefetches `a` into VMEM across programs: one copy for this run, one for the next, each
    # reading `a` from HBM (memory-bound)
    assert text.count("copy-start(%a") == 2
    prefetch_s = 2 * n * n * BF16 / bytes_rate
    assert cost.roofline_seconds == pytest.approx(matmul_s + scale_s + prefetch_s, rel=0.01)
    assert cost.roofline_seconds > 1.5 * max(cost.total_flops / flops_rate, cost.bytes_accessed / bytes_rate)


def test_loop_once_counts_match_xla_cost_analysis():
    """Counting each loop body once, as XLA's cost_analysis() does, the two agree on a scanned program:
    the matmul FLOPs within 2%, the HBM bytes within 15% (docs/cost_model.md: where they differ)."""
    def loss(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return h.sum()

    with jax.default_matmul_precision("default"):
        text, xla = _compile(jax.grad(loss), [((6, 512, 512), jnp.bfloat16), ((256, 512), jnp.bfloat16)])
    once = hlo_cost(text, loop_trips=False)
    full = hlo_cost(text)
    assert once.flops == pytest.approx(xla["flops"], rel=0.02)
    assert once.bytes_accessed == pytest.approx(xla["bytes accessed"], rel=0.15)
    assert full.flops == pytest.approx(6 * 3 * 2 * 256 * 512 * 512, rel=0.01)   # fwd + 2 grads per layer


def test_async_slice_into_vmem_reads_its_window():
    """v6e's async slice (slice-start / slice-done, as libtpu compiles an FSDP step's weight windows into
    VMEM): the 4 MiB window is read from HBM once; its VMEM destination and the operand aliased in the
    start's tuple move nothing."""
    text = """HloModule m, entry_computation_layout={(s8[33554432]{0})->s8[4194304]{0}}

ENTRY %main (p: s8[33554432]) -> s8[4194304] {
  %p = s8[33554432]{0:T(1024)(128)(4,1)} parameter(0)
  %slice-start = ((s8[33554432]{0:T(1024)(128)(4,1)}), s8[4194304]{0:T(1024)(128)(4,1)S(1)}, s32[]{:S(2)}) slice-start(%p), slice={[29360128:33554432]}
  %slice-done = s8[4194304]{0:T(1024)(128)(4,1)S(1)} slice-done(%slice-start)
  ROOT %copy = s8[4194304]{0:T(1024)(128)(4,1)} copy(%slice-done)
}
"""
    # the window read + the copy writing it back to HBM (its VMEM source moves nothing)
    assert hlo_cost(text).bytes_accessed == 4194304 + 4194304


def test_async_collective_start_reads_its_operand_and_writes_its_result_once():
    """An async all-to-all's / all-gather's start returns ((its operand), its result, sync flags): the operand
    in the tuple is the buffer it reads, not a copy. 10240 bf16 rows of (48, 128) are 120 MiB each way; the
    all-gather reads a 1 MiB shard and writes the 64 MiB gathered array; the done moves nothing."""
    text = """HloModule m, entry_computation_layout={(bf16[10240,48,128]{2,1,0}, f32[64,4096]{1,0})->(bf16[10240,48,128]{2,1,0}, f32[4096,4096]{1,0})}

ENTRY %main (p: bf16[10240,48,128], w: f32[64,4096]) -> (bf16[10240,48,128], f32[4096,4096]) {
  %p = bf16[10240,48,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %w = f32[64,4096]{1,0:T(8,128)} parameter(1)
  %a2a-start = ((bf16[10240,48,128]{2,1,0:T(8,128)(2,1)}), bf16[10240,48,128]{2,1,0:T(8,128)(2,1)}, u32[]{:S(2)}, u32[]{:S(2)}) all-to-all-start(%p), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %a2a-done = bf16[10240,48,128]{2,1,0:T(8,128)(2,1)} all-to-all-done(%a2a-start)
  %ag-start = (f32[64,4096]{1,0:T(8,128)}, f32[4096,4096]{1,0:T(8,128)}) all-gather-start(%w), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true
  %ag-done = f32[4096,4096]{1,0:T(8,128)} all-gather-done(%ag-start)
  ROOT %t = (bf16[10240,48,128]{2,1,0:T(8,128)(2,1)}, f32[4096,4096]{1,0:T(8,128)}) tuple(%a2a-done, %ag-done)
}
"""
    rows = 10240 * 48 * 128 * BF16
    assert hlo_cost(text).bytes_accessed == 2 * rows + 64 * 4096 * F32 + 4096 * 4096 * F32
