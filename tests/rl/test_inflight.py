"""In-flight weight updates (docs/rl.md#in-flight-weight-updates): without a swap the step-wise sampler gives
`generate`'s tokens; a swap between decode steps keeps the cache rows the old version wrote (checked against
a plain decode loop over that cache, and shown to differ from the new version recomputing them) and labels
each token with its version; the learner's per-token staleness mask and DIS importance weights of such a
rollout equal a numpy hand computation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_helpers import tiny_model_config

from glm5_jax.generate.decoding import Sampler, generate
from glm5_jax.model.kv_cache import init_cache
from glm5_jax.model.transformer import Transformer
from glm5_jax.parallel.sampling import SAMPLING_RULES, sampling_mesh
from glm5_jax.rl import rollouts as ro
from glm5_jax.rl.config import RLConfig
from glm5_jax.rl.inflight import sample_inflight
from glm5_jax.rl.learner import fresh_tokens, mask_stale_tokens
from glm5_jax.rl.loss import policy_loss
from glm5_jax.rl.policy import Policy, completion_logprobs, rl_model_config

OLD, NEW = 3, 4          # version labels
B, P, N, SWAP_AT = 4, 6, 8, 3


@pytest.fixture(scope="module")
def setup():
    cfg = rl_model_config(tiny_model_config(initializer_range=0.1, vocab_size=48))   # varied logits
    mesh = sampling_mesh("")
    policy = Policy(cfg, mesh, SAMPLING_RULES)

    def init(seed):
        v = jax.jit(policy.model.init)(jax.random.PRNGKey(seed), jnp.zeros((1, 8), jnp.int32))
        return jax.tree.map(lambda x: getattr(x, "value", x), v, is_leaf=lambda x: hasattr(x, "value"))

    prompts = np.random.default_rng(0).integers(2, 14, (B, P)).astype(np.int32)
    return cfg, policy, init(3), init(4), prompts


def swap_before_step(step, new_variables):
    """A `newer` callback handing over version NEW before decode step `step` (its call number)."""
    calls = []

    def newer(current):
        calls.append(current)
        return (NEW, new_variables) if len(calls) == step else None
    return newer


def plain_decode(cfg, variables_per_step, prompts):
    """Greedy decoding written out with Transformer.decode: prefill the [B, P] prompts (equal lengths) with
    step 0's variables, then step s feeds token s-1 with variables_per_step[s] on the same cache.
    (tokens [B, N], log-probs [B, N] of the log-softmax)."""
    decode = jax.jit(lambda v, tokens, positions, cache, logits_at: Transformer(cfg).apply(
        v, tokens, positions, jnp.ones_like(positions), cache, logits_at=logits_at, method=Transformer.decode))
    cache = init_cache(cfg, B, P + N)["decoder"]
    positions = jnp.broadcast_to(jnp.arange(P), (B, P))
    logits, _, cache = decode(variables_per_step[0], jnp.asarray(prompts), positions, cache, jnp.full((B, 1), P - 1))
    tokens, logps = [], []
    for s in range(N):
        if s:
            logits, _, cache = decode(variables_per_step[s], tokens[-1][:, None], jnp.full((B, 1), P + s - 1), cache,
                                      jnp.zeros((B, 1), jnp.int32))
        logp = jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1)
        tokens.append(jnp.argmax(logp, axis=-1).astype(jnp.int32))
        logps.append(jnp.max(logp, axis=-1))
    return np.stack(tokens, 1), np.stack(logps, 1)


def learner_logprobs(policy, variables, *rows):
    """The learner's log-probs of the recorded tokens at temperature 1 (jitted once per policy)."""
    return jax.jit(lambda v, *a: completion_logprobs(policy.model, v, *a, Sampler(1.0)))(variables, *rows)


def test_without_a_swap_the_tokens_are_generates(setup):
    cfg, policy, old, _, prompts = setup
    lengths = np.array([6, 3, 5, 4], np.int32)                  # ragged prompts, EOS stops
    sampler, eos = Sampler(0.8), (1, 5)
    with policy.context():
        want = generate(cfg, old, prompts, lengths, max_new_tokens=N, temperature=0.8, rng=jax.random.PRNGKey(1),
                        eos_ids=eos)
    got = sample_inflight(cfg, policy.mesh, policy.rules, old, OLD, prompts, lengths, max_new_tokens=N,
                          sampler=sampler, rng=jax.random.PRNGKey(1), eos_ids=eos)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
    live = np.arange(N)[None] < got.lengths[:, None]
    np.testing.assert_array_equal(got.token_versions, np.where(live, OLD, -1))


def test_a_swap_keeps_the_old_cache_and_samples_with_the_new_weights(setup):
    cfg, policy, old, new, prompts = setup
    lengths = np.full(B, P, np.int32)
    got = sample_inflight(cfg, policy.mesh, policy.rules, old, OLD, prompts, lengths, max_new_tokens=N,
                          sampler=Sampler(0.0), rng=None, newer=swap_before_step(SWAP_AT, new))
    np.testing.assert_array_equal(got.token_versions, [[OLD] * SWAP_AT + [NEW] * (N - SWAP_AT)] * B)
    with policy.context():
        want, want_logp = plain_decode(cfg, [old] * SWAP_AT + [new] * (N - SWAP_AT), prompts)
        old_only, _ = plain_decode(cfg, [old] * N, prompts)
        # the new version recomputing every row (what dropping the old cache would give)
        recomputed = learner_logprobs(policy, new, prompts, lengths, got.tokens, got.lengths)
    np.testing.assert_array_equal(got.tokens, want)
    np.testing.assert_allclose(got.logprobs, want_logp, atol=1e-5)
    assert (got.tokens[:, SWAP_AT:] != old_only[:, SWAP_AT:]).any()         # the new weights did sample
    np.testing.assert_array_equal(got.tokens[:, :SWAP_AT], old_only[:, :SWAP_AT])
    # behaviour log-probs after the swap are not the new version's own: the prefix rows are the old one's
    assert np.abs(got.logprobs[:, SWAP_AT:] - np.asarray(recomputed)[:, SWAP_AT:]).max() > 1e-3


def test_importance_weights_and_token_staleness_of_a_swapped_rollout(setup):
    """Trained at version NEW + 1 with tau = 1: the OLD tokens (2 behind) leave the loss, the NEW ones stay;
    the DIS loss equals the numpy one from the recorded per-token log-probs and the learner's."""
    cfg, policy, old, new, prompts = setup
    lengths = np.full(B, P, np.int32)
    got = sample_inflight(cfg, policy.mesh, policy.rules, old, OLD, prompts, lengths, max_new_tokens=N,
                          sampler=Sampler(1.0), rng=jax.random.PRNGKey(7), newer=swap_before_step(SWAP_AT, new))
    assert set(np.unique(got.token_versions[got.token_versions >= 0])) == {OLD, NEW}
    live = (np.arange(N)[None] < got.lengths[:, None]).astype(np.float32)
    batch = ro.RolloutBatch(
        prompt_tokens=prompts, prompt_lengths=lengths, completion_tokens=got.tokens, completion_lengths=got.lengths,
        logprobs=got.logprobs, loss_mask=live, rewards=np.arange(B, dtype=np.float32), group_ids=np.zeros(B, np.int32),
        versions=np.full((B, 1), OLD, np.int32), token_versions=got.token_versions, meta={}).validate()
    trained_at, tau = NEW + 1, 1
    masked, counts = mask_stale_tokens(batch, trained_at, tau)
    hand_mask = live * ((got.token_versions >= 0) & (trained_at - got.token_versions <= tau))
    np.testing.assert_array_equal(masked.loss_mask, hand_mask)
    assert hand_mask[:, :SWAP_AT].sum() == 0 and hand_mask[:, SWAP_AT:].sum() > 0
    assert counts["oldest_kept"] == NEW and counts["stale_tokens"] == int(live.sum() - hand_mask.sum())

    learner_variables = jax.tree.map(lambda a, b: 0.5 * (a + b), old, new)       # the version being trained
    with policy.context():
        learner_logp = np.asarray(learner_logprobs(policy, learner_variables, prompts, lengths, got.tokens,
                                                   got.lengths))
    adv = np.array([1.0, -0.5, 0.25, -1.0], np.float32)
    loss, stats = policy_loss(jnp.asarray(learner_logp), jnp.asarray(masked.logprobs), jnp.asarray(adv),
                              jnp.asarray(masked.loss_mask), "dis", 0.2, 0.2)
    r = np.exp(learner_logp.astype(np.float64) - got.logprobs)                  # per-token importance weight
    keep = (r > 0.8) & (r < 1.2)
    want = -(np.where(keep, r, 0) * adv[:, None] * learner_logp * hand_mask).sum() / hand_mask.sum()
    assert 0 < (keep * hand_mask).sum() < hand_mask.sum()          # both sides of the interval occur
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(stats["keep_fraction"]), (keep * hand_mask).sum() / hand_mask.sum(), rtol=1e-6)


def test_records_without_token_versions_fall_back_to_the_rows_oldest_version():
    v = ro.RolloutBatch(
        prompt_tokens=np.ones((2, 3), np.int32), prompt_lengths=np.full(2, 3, np.int32),
        completion_tokens=np.ones((2, 4), np.int32), completion_lengths=np.full(2, 4, np.int32),
        logprobs=np.zeros((2, 4), np.float32), loss_mask=np.ones((2, 4), np.float32), rewards=np.zeros(2, np.float32),
        group_ids=np.zeros(2, np.int32), versions=np.array([[5, 6, -1], [7, -1, -1]], np.int32), meta={})
    np.testing.assert_array_equal(v.per_token_versions(), [[5] * 4, [7] * 4])
    np.testing.assert_array_equal(fresh_tokens(8, v.per_token_versions(), 2), [[0] * 4, [1] * 4])


def test_lockstep_refuses_inflight_updates():
    RLConfig(inflight_updates=True, lockstep=False).validate()
    with pytest.raises(ValueError, match="inflight_updates"):
        RLConfig(inflight_updates=True, lockstep=True).validate()
