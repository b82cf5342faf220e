"""The KDA core (glm5_jax/model/kda_core.py) against transformers' chunked KDA, its decode step against
itself, and its document resets."""
import jax.numpy as jnp
import numpy as np
import torch
from transformers.models.glm5_next.modeling_glm5_next import chunk_kimi_delta_attention, l2norm

from glm5_jax.model import kda_core

B, T, H, K, V = 2, 19, 3, 8, 6


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, B, T, H, K), np.float32)
    v = rng.standard_normal((B, T, H, V), np.float32)
    g = -5.0 / (1 + np.exp(-rng.standard_normal((B, T, H, K)))).astype(np.float32)   # the lower-bounded gate
    beta = (1 / (1 + np.exp(-rng.standard_normal((B, T, H))))).astype(np.float32)
    t = lambda x: torch.as_tensor(x)                                                # noqa: E731
    q, k = l2norm(t(q)).numpy(), l2norm(t(k)).numpy()
    return q, k, v, g, beta


def test_chunk_kda_matches_transformers_with_an_initial_state():
    q, k, v, g, beta = _inputs()
    state0 = np.random.default_rng(1).standard_normal((B, H, K, V), np.float32)
    ref_o, ref_s = chunk_kimi_delta_attention(*map(torch.as_tensor, (q, k, v, g, beta)), chunk_size=8,
                                              initial_state=torch.as_tensor(state0), output_final_state=True)
    o, s = kda_core.chunk_kda(q, k, v, g, beta, initial_state_BHKV=jnp.asarray(state0))
    np.testing.assert_allclose(np.asarray(o), ref_o.numpy(), atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(s), ref_s.numpy(), atol=2e-5, rtol=0)


def test_decode_steps_equal_the_sequence():
    q, k, v, g, beta = _inputs(2)
    o, s = kda_core.chunk_kda(q, k, v, g, beta)
    state = jnp.zeros((B, H, K, V))
    for t in range(T):
        o_t, state = kda_core.kda_decode_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        np.testing.assert_allclose(np.asarray(o_t), np.asarray(o[:, t]), atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(state), np.asarray(s), atol=1e-6, rtol=0)


def test_segments_restart_the_state_and_padding_leaves_it():
    q, k, v, g, beta = _inputs(3)
    seg = np.array([[1] * 7 + [2] * 10 + [0] * 2] * B, np.int32)
    o, s = kda_core.chunk_kda(q, k, v, g, beta, segment_ids_BT=jnp.asarray(seg))
    o2, s2 = kda_core.chunk_kda(*(x[:, 7:17] for x in (q, k, v, g, beta)))
    np.testing.assert_allclose(np.asarray(o[:, 7:17]), np.asarray(o2), atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(s), np.asarray(s2), atol=1e-6, rtol=0)
