"""Real Mosaic compile of the fused sparse MLA decode kernel for v5p (AOT from a CPU host via libtpu) at the 744B
decode's per-chip shapes: latent rows of C = 576 (kv_lora 512 + rope 64), S = 8192 slots, K = 2048 selected, a
few layers stacked, batch rows split over a v5p:2x2x1 slice (4 chips); 64 heads a chip (batch 2048 on
`expert:64`) and 8 (batch 1 on `expert:8,tensor:8`). Needs libtpu; skipped without it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("libtpu", reason="libtpu not installed (pip install -r requirements-tpu.txt)")

from jax.experimental import topologies  # noqa: E402
from jax.experimental.layout import Format, Layout  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from glm5_jax.cost.hlo_cost.kernels import kernel_cost  # noqa: E402
from pallas_kernels.sparse_mla_decode import kernel  # noqa: E402

L, S, C, K, V = 3, 8192, 576, 2048, 512


@pytest.mark.parametrize("rows_per_chip, heads", [(2, 64), (1, 8)])
def test_layer_loop_attends_from_the_stacked_cache_without_a_layer_copy(rows_per_chip, heads):
    """A loop over layers attending from the stacked [L, B, S, C] cache by the layer index (as the decode layer
    scan does): the kernel reads the stacked buffer in place, so no temporary holds a layer's slice or the
    gathered rows. Declared cost by hand: both products' FLOPs, one exp per logit, each batch row's [S, C]
    slice read (576 padded to 640 lanes), its indices and valid flags, the query, new row and output."""
    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1")
    mesh = Mesh(np.array(topology.devices).reshape(-1), ("batch",))
    B = 4 * rows_per_chip
    sharded = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    stacked, rows = P(None, "batch"), P("batch")
    args = (jax.ShapeDtypeStruct((L, B, S, C), jnp.bfloat16, sharding=sharded(stacked)),
            jax.ShapeDtypeStruct((L, B, K), jnp.int32, sharding=sharded(stacked)),
            jax.ShapeDtypeStruct((L, B, K), jnp.bool_, sharding=sharded(stacked)),
            jax.ShapeDtypeStruct((B, heads, C), jnp.bfloat16, sharding=sharded(rows)),
            jax.ShapeDtypeStruct((B, C), jnp.bfloat16, sharding=sharded(rows)),
            jax.ShapeDtypeStruct((B,), jnp.int32, sharding=sharded(rows)))

    def layers(cache, idx, valid, q, new, pos):
        def layer(i, acc):
            out = kernel.sparse_mla_decode(cache, i, idx[i], valid[i], q, new, pos, scale=0.07, v_dim=V)
            return acc + out.astype(jnp.float32)
        return jax.lax.fori_loop(0, L, layer, jnp.zeros((cache.shape[1], heads, V), jnp.float32))

    f = jax.shard_map(layers, mesh=mesh, in_specs=(stacked, stacked, stacked, rows, rows, rows), out_specs=rows,
                      check_vma=False)
    # the cache in its row-major layout (the kernel's; left free, XLA may relayout the whole cache first)
    formats = (Format(Layout(major_to_minor=(0, 1, 2, 3)), args[0].sharding),) + tuple(a.sharding for a in args[1:])
    compiled = jax.jit(f, in_shardings=formats).lower(*args).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < rows_per_chip * K * C * 2     # not even the rows
    line = next(x for x in compiled.as_text().splitlines() if "tpu_custom_call" in x and kernel.NAME in x)
    flops = rows_per_chip * (2 * heads * K * (C + V))
    nbytes = rows_per_chip * (S * 640 * 2 + K * (4 + 4) + heads * (C + V) * 2 + C * 2)
    assert kernel_cost(line.split("custom-call(")[0], [], line) == (float(flops), nbytes)
