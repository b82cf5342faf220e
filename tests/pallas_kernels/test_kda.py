"""Kimi Delta Attention: the chunked reference against the per-token recurrence and transformers' torch
functions, the "xla" impl and the Pallas kernels (interpret mode on CPU) against the reference, forward and
gradients, and the decode step against one token of the recurrence."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_inputs import assert_close
from pallas_kernels.kda import ops, reference


def make_inputs(B, T, H, K, V, seed=0):
    """L2-normalised q, k; g <= 0 with some strong gates (exp(-G) over a chunk would overflow fp32);
    beta in (0, 1); a nonzero initial state."""
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q, k = (unit(rng.standard_normal((B, T, H, K))) for _ in range(2))
    v = rng.standard_normal((B, T, H, V))
    g = -np.exp(rng.standard_normal((B, T, H, K)) * 1.5)
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))
    init = rng.standard_normal((B, H, K, V))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, init))


def packed_segments(B, T, lengths, pad):
    """Documents of the given lengths, then ``pad`` tokens of id 0; row b's ids shifted by b."""
    ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(pad)])
    assert len(ids) == T
    return jnp.asarray(np.stack([np.where(ids > 0, ids + b, 0) for b in range(B)]), jnp.int32)


@pytest.mark.parametrize("chunk", [16, 32])
def test_chunked_reference_matches_recurrence(chunk):
    q, k, v, g, beta, init = make_inputs(2, 77, 2, 16, 8)
    seg = packed_segments(2, 77, [20, 13, 33], pad=11)   # boundaries inside and at the edge of chunks
    o_want, S_want = reference.recurrent_kda(q, k, v, g, beta, init, seg)
    o, S = reference.chunk_kda(q, k, v, g, beta, init, seg, chunk_size=chunk)
    assert_close(o, o_want, 2e-5)
    assert_close(S, S_want, 2e-5)


def test_documents_do_not_interact():
    """A packed row's second document gives what it gives alone from a zero state."""
    q, k, v, g, beta, init = make_inputs(1, 50, 2, 16, 8)
    seg = packed_segments(1, 50, [21, 29], pad=0)
    o, S = ops.chunk_kda(q, k, v, g, beta, initial_state_BHKV=init, segment_ids_BT=seg, chunk_size=16)
    alone = [x[:, 21:] for x in (q, k, v, g, beta)]
    o_alone, S_alone = reference.recurrent_kda(*alone)
    assert_close(o[:, 21:], o_alone, 2e-5)
    assert_close(S, S_alone, 2e-5)


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_padding_passes_the_state_through(impl):
    """A right-padded row (id 0) ends in the state of its last document, as without the padding."""
    q, k, v, g, beta, init = make_inputs(1, 40, 2, 16, 8)
    seg = packed_segments(1, 40, [13, 23], pad=4)
    _, S = ops.chunk_kda(q, k, v, g, beta, initial_state_BHKV=init, segment_ids_BT=seg, chunk_size=16, impl=impl)
    _, S_want = reference.recurrent_kda(*(x[:, :36] for x in (q, k, v, g, beta)), init, seg[:, :36])
    assert_close(S, S_want, 2e-5)


def test_references_match_transformers():
    torch = pytest.importorskip("torch")
    from transformers.models.glm5_next import modeling_glm5_next as hf

    q, k, v, g, beta, init = make_inputs(2, 100, 3, 32, 16)   # T not a multiple of the chunk
    t = lambda x: torch.from_numpy(np.array(x))  # noqa: E731
    o_chunk, S_chunk = hf.chunk_kimi_delta_attention(t(q), t(k), t(v), t(g), t(beta), chunk_size=64,
                                                     initial_state=t(init), output_final_state=True)
    o_rec, S_rec = hf.recurrent_kimi_delta_attention(t(q), t(k), t(v), t(g), t(beta), initial_state=t(init),
                                                     output_final_state=True)
    for hf_o, hf_S in ((o_chunk, S_chunk), (o_rec, S_rec)):
        for o, S in (reference.recurrent_kda(q, k, v, g, beta, init),
                     reference.chunk_kda(q, k, v, g, beta, init, chunk_size=64)):
            assert_close(o, hf_o.numpy(), 1e-5)
            assert_close(S, hf_S.numpy(), 1e-5)


@pytest.mark.parametrize("chunk", [64, 128])
def test_strong_gates_in_one_chunk(chunk):
    """One chunk of 64 or 128 tokens (four or eight 16-row sub-chunks; 128 is configs/glm53_flash.py's) whose
    gates sum to about -5 per token and channel: exp(-G) would overflow fp32; the split decays keep the xla
    impl finite and equal to the recurrence."""
    q, k, v, g, beta, init = make_inputs(1, chunk, 1, 16, 8, seed=5)
    g = g * 10.0
    assert float(jnp.min(jnp.sum(g, axis=1))) < -300 * chunk / 64
    o, S = ops.chunk_kda(q, k, v, g, beta, initial_state_BHKV=init, chunk_size=chunk, impl="xla")
    o_want, S_want = reference.recurrent_kda(q, k, v, g, beta, init)
    assert_close(o, o_want, 2e-5)
    assert_close(S, S_want, 2e-5)


def outputs_and_grads(impl, q, k, v, g, beta, init, seg, chunk):
    """chunk_kda's outputs (the per-token recurrence's for ``impl=None``) and, through jax.vjp, the gradients
    of all inputs for fixed random cotangents of o and of the final state."""
    def f(q, k, v, g, beta, init):
        if impl is None:
            return reference.recurrent_kda(q, k, v, g, beta, init, seg)
        return ops.chunk_kda(q, k, v, g, beta, initial_state_BHKV=init, segment_ids_BT=seg, chunk_size=chunk,
                             impl=impl)

    (o, S), vjp = jax.vjp(f, q, k, v, g, beta, init)
    rng = np.random.default_rng(1)
    do, dS = (jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (o, S))
    return (o, S), vjp((do, dS))


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_forward_and_gradients_match_recurrence(impl):
    """Three 16-token chunks (two 8-row sub-chunks each), two documents and right padding, T = 40 padded."""
    q, k, v, g, beta, init = make_inputs(1, 40, 2, 16, 8)
    seg = packed_segments(1, 40, [13, 23], pad=4)
    assert_matches_recurrence(*outputs_and_grads(impl, q, k, v, g, beta, init, seg, chunk=16),
                              q, k, v, g, beta, init, seg)


def assert_matches_recurrence(outputs, grads, q, k, v, g, beta, init, seg):
    """(o, final state) and the input gradients of `outputs_and_grads` equal the per-token recurrence's."""
    (o_want, S_want), grads_want = outputs_and_grads(None, q, k, v, g, beta, init, seg, chunk=None)
    assert_close(outputs[0], o_want, 2e-5)
    assert_close(outputs[1], S_want, 2e-5)
    for name, got, want in zip(("q", "k", "v", "g", "beta", "initial_state"), grads, grads_want):
        assert np.abs(np.asarray(want)).max() > 1e-3, name
        assert_close(got, want, 1e-4)


def test_pallas_single_document_bf16():
    """bf16 inputs, no segment ids, T a multiple of the chunk: o in bf16, the state in fp32, as the reference
    computes from the same bf16 values."""
    q, k, v, g, beta, init = make_inputs(1, 32, 2, 16, 8, seed=3)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    o, S = ops.chunk_kda(q, k, v, g, beta, initial_state_BHKV=init, chunk_size=16, impl="pallas_interpret")
    o_want, S_want = reference.recurrent_kda(q, k, v, g, beta, init)
    assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
    assert_close(o.astype(jnp.float32), o_want.astype(jnp.float32), 1e-2)
    assert_close(S, S_want, 2e-5)


def test_decode_step_matches_one_token_of_the_recurrence():
    q, k, v, g, beta, init = make_inputs(2, 5, 3, 16, 8)
    _, S_before = reference.recurrent_kda(*(x[:, :4] for x in (q, k, v, g, beta)), init)
    o_want, S_want = reference.recurrent_kda(q, k, v, g, beta, init)
    o, S = ops.kda_decode_step(q[:, 4], k[:, 4], v[:, 4], g[:, 4], beta[:, 4], S_before)
    assert_close(o, o_want[:, 4], 1e-6)
    assert_close(S, S_want, 1e-6)
