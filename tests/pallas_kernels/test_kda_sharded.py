"""The KDA layer's core on a mesh: `sharded_chunk_kda` runs the Pallas kernels (interpret mode on CPU) per
(batch, head) shard under shard_map and equals the per-token recurrence, forward and gradients, with packed
documents and an initial state."""
import flax.linen as nn
import jax
import numpy as np

from glm5_jax.model.kda_layer import sharded_chunk_kda
from glm5_jax.parallel.mesh import DEFAULT_RULES, MeshConfig, build_mesh
from test_kda import assert_matches_recurrence, make_inputs, packed_segments


def test_per_shard_kernels_match_the_recurrence_on_a_batch_by_heads_mesh():
    """Heads of 128 channels (GLM-5.3-Flash's), flat [B, T, H * 128] as the layer passes them: the kernels read
    each shard's flat channels as they are."""
    B, T, H, K = 2, 40, 2, 128
    q, k, v, g, beta, init = make_inputs(B, T, H, K, K)
    seg = packed_segments(B, T, [13, 23], pad=4)
    mesh = build_mesh(MeshConfig(data=2, fsdp=1, expert=1, tensor=2), jax.devices()[:4])   # 1 row x 1 head each

    def f(q, k, v, g, beta, init):
        flat = (x.reshape(B, T, H * K) for x in (q, k, v, g))
        o, S = sharded_chunk_kda(*flat, beta, segment_ids_BT=seg, initial_state_BHKV=init,
                                 impl="pallas_interpret", chunk_size=16)   # 3 chunks, states carried across
        return o.reshape(B, T, H, K), S

    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        (o, S), vjp = jax.vjp(jax.jit(f), q, k, v, g, beta, init)
        text = jax.jit(f).lower(q, k, v, g, beta, init).as_text()
    assert "shard_map" in text or "sdy.manual_computation" in text
    rng = np.random.default_rng(1)   # the cotangents outputs_and_grads uses
    grads = vjp(tuple(np.asarray(rng.standard_normal(x.shape), np.float32) for x in (o, S)))
    assert_matches_recurrence((o, S), grads, q, k, v, g, beta, init, seg)
