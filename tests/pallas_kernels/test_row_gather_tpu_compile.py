"""Real Mosaic compile of the stacked row gather for v5p (AOT from a CPU host via libtpu) at the 744B decode's
per-chip shapes: latent rows of C = 576 (kv_lora 512 + rope 64), S = 8192 slots, K = 2048 selected per row, a
few layers stacked, batch rows split over a v5p:2x2x1 slice (4 chips). Needs libtpu; skipped without it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("libtpu", reason="libtpu not installed (pip install -r requirements-tpu.txt)")

from jax.experimental import topologies  # noqa: E402
from jax.experimental.layout import Format, Layout  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from glm5_jax.cost.hlo_cost.kernels import kernel_cost  # noqa: E402
from pallas_kernels.row_gather import kernel, ops  # noqa: E402

L, B_PER_CHIP, S, C, K = 3, 2, 8192, 576, 2048


@pytest.mark.parametrize("stream", [False, True])
def test_layer_loop_gathers_from_the_stacked_cache_without_a_layer_copy(stream):
    """A loop over layers gathering each layer's selected rows from the stacked [L, B, S, C] cache by the
    layer index (as the decode layer scan does): the kernel reads the stacked buffer in place, so no temporary
    holds a layer's [B, S, C] slice. Declared bytes: tile-group DMAs, one 8-row tile group read per selected
    row plus the row written and its index read twice; streamed (the default at these shapes), each batch
    row's [S, C] slice read once plus the rows written and their indices read."""
    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1")
    mesh = Mesh(np.array(topology.devices).reshape(-1), ("batch",))
    B = 4 * B_PER_CHIP
    cache_spec, rows = P(None, "batch"), P("batch")
    args = (jax.ShapeDtypeStruct((L, B, S, C), jnp.bfloat16, sharding=NamedSharding(mesh, cache_spec)),
            jax.ShapeDtypeStruct((L, B, K), jnp.int32, sharding=NamedSharding(mesh, P(None, "batch"))))

    def layers(cache, idx):
        def layer(i, acc):
            rows_BKC = kernel.stacked_row_gather(cache, i, idx[i], stream=stream)
            return acc + rows_BKC.astype(jnp.float32)
        return jax.lax.fori_loop(0, L, layer, jnp.zeros((cache.shape[1], K, C), jnp.float32))

    sharded = jax.shard_map(layers, mesh=mesh, in_specs=(cache_spec, P(None, "batch")), out_specs=rows,
                            check_vma=False)
    # the cache in its row-major layout (the kernel's; left free, XLA may pick another for an entry parameter
    # and relayout the whole cache before the loop)
    in_formats = (Format(Layout(major_to_minor=(0, 1, 2, 3)), args[0].sharding), args[1].sharding)
    compiled = jax.jit(sharded, in_shardings=in_formats).lower(*args).compile()
    text = compiled.as_text()
    line = next(x for x in text.splitlines() if "tpu_custom_call" in x and "stacked_row_gather" in x)
    one_layer_slice = B_PER_CHIP * S * C * 2
    assert compiled.memory_analysis().temp_size_in_bytes < one_layer_slice
    # declared: per selected row its tile group (8 rows x 640 lanes, 576 padded to 5 lane tiles, bf16), the
    # row written (576 x 2 bytes) and its index read twice
    assert kernel.tile_group_bytes(C, 2) == 8 * 640 * 2
    assert kernel.streams(B_PER_CHIP, S, C, K, 2)
    want = B_PER_CHIP * (S * 640 * 2 + K * (C * 2 + 4)) if stream else B_PER_CHIP * K * (8 * 640 * 2 + C * 2 + 8)
    assert kernel_cost(line.split("custom-call(")[0], [], line) == (0.0, want)
