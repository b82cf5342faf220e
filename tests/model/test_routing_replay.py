"""Routing replay (glm5_jax/model/routing_replay.py): what a sampler recorded while decoding, replayed by a
full forward, reproduces the sampler's experts and top-k exactly.

The sampler is given a different routing bias and different indexer weights from the learner. Both only
choose (the bias selects experts but does not weight them; the indexer only feeds the top-k), so a forward
that replays the sampler's choices must give the sampler's own numbers, and one that recomputes them must
not."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from flax.core import meta

from glm5_jax import Transformer
from glm5_jax.generate.decoding import decode_config, generate
from glm5_jax.model import routing_replay as rr
from glm5_jax.model.layer_plan import plan_segments
from tests.model.test_model_properties import TINY

CFG = decode_config(TINY.replace(num_nextn_predict_layers=0, mtp_depth=0))
P, N = 12, 10           # prompt width, new tokens: 22 positions, several times index_topk (8)


@pytest.fixture(scope="module")
def learner_and_sampler():
    learner = meta.unbox(jax.jit(Transformer(CFG).init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))
    rng = np.random.default_rng(1)
    flat = traverse_util.flatten_dict(learner["params"])
    params = {k: v + 0.5 * rng.standard_normal(v.shape).astype(np.float32) if "indexer" in k else v
              for k, v in flat.items()}
    bias = jax.tree.map(lambda b: b + 2.0 * rng.standard_normal(b.shape).astype(np.float32), learner["moe_bias"])
    return learner, {**learner, "params": traverse_util.unflatten_dict(params), "moe_bias": bias}


@pytest.fixture(scope="module")
def sampled(learner_and_sampler):
    _, sampler = learner_and_sampler
    prompts = np.random.default_rng(2).integers(1, CFG.vocab_size, (3, P)).astype(np.int32)
    lengths = np.array([P, 7, 4], np.int32)
    out = generate(CFG.replace(capture_routing=True), sampler, prompts, lengths, max_new_tokens=N,
                   temperature=1.0, rng=jax.random.key(3))
    return prompts, lengths, out


def rows(prompts, lengths, out):
    """Each row laid out as the learner sees it: prompt, completion, padding (positions 0 .. P + N - 1)."""
    tokens = np.zeros((len(lengths), P + N), np.int32)
    for b, (n, c) in enumerate(zip(lengths, np.asarray(out.lengths))):
        tokens[b, :n], tokens[b, n:n + c] = prompts[b, :n], np.asarray(out.tokens)[b, :c]
    segments = (np.arange(P + N)[None] < (lengths + np.asarray(out.lengths))[:, None]).astype(np.int32)
    return tokens, segments


def completion_logprobs(variables, tokens, segments, lengths, out, replay=None):
    logits = jax.jit(lambda v, t, s, r: Transformer(CFG).apply(v, t, segment_ids=s, replay=r).logits)(
        variables, tokens, segments, replay)
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    got = np.zeros((len(lengths), N), np.float32)
    for b, (n, c) in enumerate(zip(lengths, np.asarray(out.lengths))):
        got[b, :c] = logp[b, n - 1 + np.arange(c), np.asarray(out.tokens)[b, :c]]
    return got


def test_replayed_forward_reproduces_the_sampler(learner_and_sampler, sampled):
    learner, sampler = learner_and_sampler
    prompts, lengths, out = sampled
    tokens, segments = rows(prompts, lengths, out)
    arrays = rr.extract(CFG, out.routing, P + N)
    n_moe = sum(kind.mlp == "moe" for seg in plan_segments(CFG) for kind in seg.unit for _ in range(seg.repeats))
    assert arrays[rr.EXPERTS].shape == (3, P + N, n_moe, CFG.num_experts_per_tok)
    assert arrays[rr.SELECTED].shape == (3, P + N, 2, CFG.index_topk)          # two full-indexer layers

    mask = np.arange(N)[None] < np.asarray(out.lengths)[:, None]
    sampler_logp = np.where(mask, np.asarray(out.logprobs), 0)
    # the sampler's own forward over the whole rows gives its decode log-probs (the usual TITO check)
    np.testing.assert_allclose(completion_logprobs(sampler, tokens, segments, lengths, out), sampler_logp, atol=2e-5)
    own = completion_logprobs(learner, tokens, segments, lengths, out)
    assert np.abs(own - sampler_logp)[mask].max() > 1e-2       # the learner alone routes and selects otherwise
    replayed = completion_logprobs(learner, tokens, segments, lengths, out, rr.to_tree(CFG, arrays))
    np.testing.assert_allclose(replayed, sampler_logp, atol=2e-5)


def test_recorded_rows_are_exactly_what_was_fed(sampled):
    """Every position the sampler fed is recorded (the prompt and each completion token but the last); the
    last completion token and the padding after it were never run as inputs."""
    prompts, lengths, out = sampled
    experts = rr.extract(CFG, out.routing, P + N)[rr.EXPERTS]
    fed = np.asarray(out.lengths) + lengths - 1          # positions 0 .. prompt + completion - 2
    for b in range(3):
        chosen = np.sort(experts[b, :fed[b]], axis=-1)
        assert (chosen >= 0).all() and (chosen < CFG.n_routed_experts).all()
        assert (chosen[..., 1:] != chosen[..., :-1]).all()      # K distinct experts per token
    selected = rr.extract(CFG, out.routing, P + N)[rr.SELECTED]
    b = 0       # a query at position p selects min(p + 1, k) visible slots, each <= p
    for p in range(fed[b]):
        picked = selected[b, p, 0][selected[b, p, 0] >= 0]
        assert len(picked) == min(p + 1, CFG.index_topk) and picked.max() <= p and len(set(picked)) == len(picked)


def test_unrecorded_rows_compute_their_own(learner_and_sampler):
    """A replay tree of nothing but NOT_RECORDED is the plain forward, bit for bit."""
    learner, _ = learner_and_sampler
    tokens = np.random.default_rng(4).integers(0, CFG.vocab_size, (2, P + N)).astype(np.int32)
    empty = {name: np.full(a.shape, rr.NOT_RECORDED, np.int32)
             for name, a in {rr.EXPERTS: np.zeros((2, P + N, 3, CFG.num_experts_per_tok)),
                             rr.SELECTED: np.zeros((2, P + N, 2, CFG.index_topk))}.items()}
    fn = jax.jit(lambda v, t, r: Transformer(CFG).apply(v, t, replay=r).logits)
    np.testing.assert_array_equal(np.asarray(fn(learner, tokens, rr.to_tree(CFG, empty))),
                                  np.asarray(fn(learner, tokens, None)))


def test_fit_width_keeps_every_recorded_entry():
    idx = jnp.array([[[5, -1, 2, -1, 7]]], jnp.int32)
    np.testing.assert_array_equal(rr.fit_width(idx, 3), [[[5, 2, 7]]])
    np.testing.assert_array_equal(rr.fit_width(idx, 7), [[[5, -1, 2, -1, 7, -1, -1]]])


def test_to_tree_refuses_a_layer_count_mismatch():
    with pytest.raises(ValueError, match="3 layers recorded, the model has 2"):
        rr.to_tree(CFG, {rr.SELECTED: np.zeros((1, 4, 3, 8), np.int32)})
