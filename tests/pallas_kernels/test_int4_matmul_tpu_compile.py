"""Real Mosaic compile of the INT4 expert GEMM for v5p (AOT from a CPU host via libtpu), at GLM-5's expert
widths: gate/up [D=6144 -> F=2048] and down [F=2048 -> D=6144], 32-wide groups, bf16 activations in
128-row expert blocks, 8 experts per chip, inside shard_map over a v5p:2x2x1 slice (4 chips).
Needs libtpu (requirements-tpu.txt); skipped without it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("libtpu", reason="libtpu not installed (pip install -r requirements-tpu.txt)")

from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from pallas_kernels.int4_matmul import ops  # noqa: E402

D, F, G, E_PER_CHIP, BLOCKS, M = 6144, 2048, 32, 8, 16, 128
V5P_HBM_BYTES = 95 * 2**30


@pytest.mark.parametrize("K,N", [(D, F), (F, D)], ids=["gate_up", "down"])
def test_int4_expert_matmul_compiles_for_v5p(K, N):
    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1")
    mesh = Mesh(np.array(topology.devices).reshape(-1), ("exp",))
    rows, experts = P("exp"), P("exp")

    def abstract(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    args = (abstract((4 * BLOCKS, M, K), jnp.bfloat16, rows), abstract((4 * BLOCKS,), jnp.int32, rows),
            abstract((4,), jnp.int32, rows),
            abstract((4 * E_PER_CHIP, K // 8, N), jnp.int32, experts),
            abstract((4 * E_PER_CHIP, K // G, N), jnp.bfloat16, experts))

    def expert_gemm(x, block_expert, n_used, packed, scale):
        return ops.int4_block_matmul(x, block_expert, n_used[0], packed, scale, group_size=G, impl="pallas")

    sharded = jax.shard_map(expert_gemm, mesh=mesh, in_specs=(rows, rows, rows, experts, experts),
                            out_specs=rows, check_vma=False)
    compiled = jax.jit(sharded).lower(*args).compile()
    assert "tpu_custom_call" in compiled.as_text()       # the Mosaic kernel is in the program
    mem = compiled.memory_analysis()
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
    # per chip: packed weights are K*N/2 bytes per expert, a quarter of bf16
    assert mem.argument_size_in_bytes < BLOCKS * M * K * 2 + E_PER_CHIP * (K * N // 2 + K // G * N * 2) + 4096
    assert 0 < total < V5P_HBM_BYTES


def test_stacked_layers_compile_without_a_per_layer_weight_copy():
    """A loop over layers reading stacked [L, E, K/8, N] weights by the layer index (as the decode's layer scan
    does): the kernel's BlockSpecs read the stacked array in place, so no temporary holds a layer's weights
    (the sliced form copies each layer's E_PER_CHIP experts, K*N/2 bytes each, before the custom call)."""
    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1")
    mesh = Mesh(np.array(topology.devices).reshape(-1), ("exp",))
    L, K, N = 4, D, F
    rows, experts = P("exp"), P(None, "exp")

    def abstract(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    args = (abstract((4 * BLOCKS, M, K), jnp.bfloat16, rows), abstract((4 * BLOCKS,), jnp.int32, rows),
            abstract((4,), jnp.int32, rows),
            abstract((L, 4 * E_PER_CHIP, K // 8, N), jnp.int32, experts),
            abstract((L, 4 * E_PER_CHIP, K // G, N), jnp.bfloat16, experts))

    def layers(x, block_expert, n_used, packed, scale):
        def layer(i, acc):
            return acc + ops.int4_block_matmul(x, block_expert, n_used[0], packed, scale, group_size=G,
                                               impl="pallas", layer=i)
        return jax.lax.fori_loop(0, L, layer, jnp.zeros(x.shape[:2] + (N,), jnp.float32))

    sharded = jax.shard_map(layers, mesh=mesh, in_specs=(rows, rows, rows, experts, experts), out_specs=rows,
                            check_vma=False)
    compiled = jax.jit(sharded).lower(*args).compile()
    assert "tpu_custom_call" in compiled.as_text()
    one_layer_packed = E_PER_CHIP * K * N // 2
    assert compiled.memory_analysis().temp_size_in_bytes < one_layer_packed


@pytest.mark.parametrize("K,N,tiles", [(D, F // 8, (2, None, 1)), (F // 8, D, (2, None, 1))], ids=["gate_up", "down"])
def test_batch1_blocks_compile_in_one_step_per_core(K, N, tiles):
    """Decode at batch 1 over expert:8,tensor:8: 16-row blocks, F split 8 ways. The tile rule gives each
    TensorCore one output tile of an expert's whole weights (gate / up: [6144, 128], down: [256, 3072]); the
    compiled kernel's grid (read from its Mosaic module) is (2 output tiles, the used row blocks: dynamic, 1),
    and Mosaic's scoped VMEM stays within the 16 MiB default."""
    import json
    import re

    from glm5_jax.cost.hlo_cost import kernel_grid

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices[0]
    s = jax.sharding.SingleDeviceSharding(device)
    spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=s)  # noqa: E731

    def gemm(x, block_expert, n_used, packed, scale):
        return ops.int4_block_matmul(x, block_expert, n_used, packed, scale, group_size=G, impl="pallas")

    text = jax.jit(gemm).lower(spec((8, 16, K)), spec((8,), jnp.int32), spec((), jnp.int32),
                               spec((E_PER_CHIP * 4, K // 8, N), jnp.int32),
                               spec((E_PER_CHIP * 4, K // G, N))).compile().as_text()
    line = next(x for x in text.splitlines() if "tpu_custom_call" in x)
    grid = kernel_grid(line)
    assert grid.bounds == tiles and grid.parallel == (True, False, False)
    scoped = json.loads(re.search(r'"used_scoped_memory_configs":(\[[^\]]*\])', line).group(1))
    assert 0 < sum(int(c["size"]) for c in scoped) <= 16 * 2**20
