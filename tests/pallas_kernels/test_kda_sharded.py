"""The KDA layer's core on a mesh: `sharded_chunk_kda` runs the Pallas kernels (interpret mode on CPU) per
(batch, head) shard under shard_map and equals the per-token recurrence, forward and gradients, with packed
documents and an initial state."""
import flax.linen as nn
import jax
import numpy as np

from dsa_inputs import assert_close
from glm5_jax.model.kda_layer import sharded_chunk_kda
from glm5_jax.parallel.mesh import DEFAULT_RULES, MeshConfig, build_mesh
from test_kda import make_inputs, outputs_and_grads, packed_segments


def test_per_shard_kernels_match_the_recurrence_on_a_batch_by_heads_mesh():
    q, k, v, g, beta, init = make_inputs(2, 40, 2, 16, 8)
    seg = packed_segments(2, 40, [13, 23], pad=4)
    mesh = build_mesh(MeshConfig(data=2, fsdp=1, expert=1, tensor=2), jax.devices()[:4])   # 1 row x 1 head each

    def f(q, k, v, g, beta, init):
        return sharded_chunk_kda(q, k, v, g, beta, segment_ids_BT=seg, initial_state_BHKV=init,
                                 impl="pallas_interpret")

    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        (o, S), vjp = jax.vjp(jax.jit(f), q, k, v, g, beta, init)
        text = jax.jit(f).lower(q, k, v, g, beta, init).as_text()
    assert "shard_map" in text or "sdy.manual_computation" in text
    rng = np.random.default_rng(1)
    grads = vjp(tuple(np.asarray(rng.standard_normal(x.shape), np.float32) for x in (o, S)))
    (o_want, S_want), grads_want = outputs_and_grads(None, q, k, v, g, beta, init, seg, chunk=64)
    assert_close(o, o_want, 2e-5)
    assert_close(S, S_want, 2e-5)
    for name, got, want in zip(("q", "k", "v", "g", "beta", "initial_state"), grads, grads_want):
        assert np.abs(np.asarray(want)).max() > 1e-3, name
        assert_close(got, want, 1e-4)
