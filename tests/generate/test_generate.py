"""generate(): greedy/sampled tokens and their logprobs against full forwards, EOS, MTP speculation."""
import jax
import numpy as np
import pytest

from glm5_jax.generate.decoding import Sampler, generate
from tests.generate.tiny_models import TINY, full_logits, init_variables

LENGTHS = np.array([5, 11])
N = 20   # prompt 11 + 20 new > index_topk = 8: decode-time selection drops keys


def prompts(cfg, seed=0):
    seq = np.random.default_rng(seed).integers(2, cfg.vocab_size, (2, LENGTHS.max())).astype(np.int32)
    return np.where(np.arange(seq.shape[1])[None] < LENGTHS[:, None], seq, 0)


def rescored(cfg, variables, prompt, result):
    """Full-forward logits predicting each generated token of each row: [(n_b, V)]."""
    out = []
    for b in range(prompt.shape[0]):
        n = int(result.lengths[b])
        seq = np.concatenate([prompt[b, :LENGTHS[b]], np.asarray(result.tokens[b, :n])])
        out.append(np.asarray(full_logits(cfg, variables, seq[None]))[0, LENGTHS[b] - 1:-1])
    return out


@pytest.fixture(scope="module")
def greedy():
    variables = init_variables(TINY)
    prompt = prompts(TINY)
    return variables, prompt, generate(TINY, variables, prompt, LENGTHS, max_new_tokens=N, temperature=0.0)


def test_greedy_is_argmax_of_full_forward_and_logprobs_are_its_log_softmax(greedy):
    variables, prompt, result = greedy
    assert np.asarray(result.lengths).tolist() == [N, N]
    for b, logits in enumerate(rescored(TINY, variables, prompt, result)):
        np.testing.assert_array_equal(logits.argmax(-1), np.asarray(result.tokens[b]))
        want = np.asarray(jax.nn.log_softmax(logits, -1))[np.arange(N), np.asarray(result.tokens[b])]
        np.testing.assert_allclose(np.asarray(result.logprobs[b]), want, atol=1e-5, rtol=0)


def test_speculative_greedy_equals_plain_greedy(greedy):
    variables, prompt, result = greedy
    spec = generate(TINY, variables, prompt, LENGTHS, max_new_tokens=N, temperature=0.0, speculative=True)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(result.tokens))
    np.testing.assert_array_equal(np.asarray(spec.lengths), np.asarray(result.lengths))
    np.testing.assert_allclose(np.asarray(spec.logprobs), np.asarray(result.logprobs), atol=1e-5, rtol=0)
    assert int(spec.drafted) > 0 and 0 <= int(spec.accepted) <= int(spec.drafted)


def copy_drafting_mtp(variables):
    """MTP surgery: block = identity (attention and FFN outputs zeroed), eh_proj keeps only the hidden half,
    norms at 1. Depth 1 then sees the normed main hidden state, so its logits are a positive multiple of the
    main model's at the same position: every draft repeats the token just predicted ("copy" drafts)."""
    params = jax.tree.map(lambda x: x, variables["params"])
    mtp = params["mtp"]
    d = TINY.hidden_size
    mtp["eh_proj"] = np.concatenate([np.zeros((d, d), np.float32), np.eye(d, dtype=np.float32)])
    for path in (("attention", "o_proj"), ("moe", "down_proj"), ("moe", "shared_expert", "down_proj")):
        node = mtp["block"]
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = np.zeros_like(node[path[-1]])
    for norm in ("hnorm", "shared_head_norm"):
        mtp[norm]["scale"] = np.ones_like(mtp[norm]["scale"])
    return {**variables, "params": params}


def simulated_acceptance(greedy_row, n_new, K):
    """(drafted, accepted) of copy drafts against a known greedy continuation (hand simulation)."""
    count, drafted, accepted = 1, 0, 0
    while count < n_new:
        pending = greedy_row[count - 1]
        a = 0
        while a < K and greedy_row[count + a] == pending:
            a += 1
        drafted, accepted, count = drafted + K, accepted + a, count + a + 1
    return drafted, accepted


def test_speculative_accepts_drafts_and_still_equals_greedy():
    """Copy drafts are right whenever greedy text repeats a token: accepted windows emit several tokens at
    once (counted exactly as a hand simulation says), cut at an EOS id, and the output is still greedy's."""
    K = TINY.mtp_depth
    variables = copy_drafting_mtp(init_variables(TINY))
    prompt = prompts(TINY, seed=5)
    longer = generate(TINY, variables, prompt, LENGTHS, max_new_tokens=N + K, temperature=0.0)
    spec = generate(TINY, variables, prompt, LENGTHS, max_new_tokens=N, temperature=0.0, speculative=True)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(longer.tokens[:, :N]))
    sims = [simulated_acceptance(np.asarray(longer.tokens[b]), N, K) for b in range(2)]
    assert (int(spec.drafted), int(spec.accepted)) == tuple(map(sum, zip(*sims)))
    assert 0 < spec.acceptance_rate < 1, spec.acceptance_rate
    row = np.asarray(longer.tokens[1, :N])
    eos = int(row[np.argmax(row[1:] == row[:-1]) + 1])     # an EOS inside an accepted run of repeats
    plain_eos = generate(TINY, variables, prompt, LENGTHS, max_new_tokens=N, temperature=0.0, eos_ids=(eos,))
    spec_eos = generate(TINY, variables, prompt, LENGTHS, max_new_tokens=N, temperature=0.0, eos_ids=(eos,),
                        speculative=True)
    for r in (plain_eos, spec_eos):
        for b in range(2):
            row = np.asarray(longer.tokens[b, :N])
            n = int(np.argmax(row == eos)) + 1 if (row == eos).any() else N
            assert int(r.lengths[b]) == n
            np.testing.assert_array_equal(np.asarray(r.tokens[b, :n]), row[:n])
            assert not np.asarray(r.tokens[b, n:]).any() and not np.asarray(r.logprobs[b, n:]).any()


def reference_log_probs(logits, temperature, top_k, top_p):
    """NumPy sampling distribution: tempered, top-k, then the smallest prefix reaching top_p, renormalised."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros_like(z, bool)
    p = np.exp(z[order] - z.max())
    p[top_k or len(z):] = 0
    p /= p.sum()
    mass = 0.0
    for rank, tok in enumerate(order):
        if mass >= top_p or (top_k and rank >= top_k):
            break
        keep[tok] = True
        mass += p[rank]
    out = np.full_like(z, -np.inf)
    out[keep] = z[keep] - np.log(np.exp(z[keep] - z[keep].max()).sum()) - z[keep].max()
    return out


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.6), (0.9, 12, 0.8)])
def test_sampled_logprobs_are_those_of_the_distribution_used(temperature, top_k, top_p):
    logits = np.random.default_rng(7).normal(size=(3, TINY.vocab_size)).astype(np.float32) * 3
    got = np.asarray(Sampler(temperature, top_p, top_k).log_probs(logits))
    want = np.stack([reference_log_probs(row, temperature, top_k, top_p) for row in logits])
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], atol=1e-5, rtol=0)


def test_sampling_with_temperature_and_filters_end_to_end():
    variables = init_variables(TINY)
    prompt = prompts(TINY)
    kw = dict(max_new_tokens=N, temperature=0.8, top_k=10, top_p=0.9, rng=jax.random.key(3))
    result = generate(TINY, variables, prompt, LENGTHS, **kw)
    again = generate(TINY, variables, prompt, LENGTHS, **kw)
    np.testing.assert_array_equal(np.asarray(result.tokens), np.asarray(again.tokens))   # fixed rng
    other = generate(TINY, variables, prompt, LENGTHS, **{**kw, "rng": jax.random.key(4)})
    assert not np.array_equal(np.asarray(result.tokens), np.asarray(other.tokens))
    for b, logits in enumerate(rescored(TINY, variables, prompt, result)):
        want = np.stack([reference_log_probs(row, 0.8, 10, 0.9) for row in logits])
        chosen = want[np.arange(N), np.asarray(result.tokens[b])]
        assert np.isfinite(chosen).all()                  # every sampled token is inside the kept set
        np.testing.assert_allclose(np.asarray(result.logprobs[b]), chosen, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=0.5), "rng"),
    (dict(temperature=0.5, rng=jax.random.key(0), speculative=True), "greedy"),
    (dict(max_new_tokens=1000), "max_position_embeddings")])
def test_bad_arguments_are_clear_errors(kwargs, message):
    args = dict(max_new_tokens=4, temperature=0.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        generate(TINY, init_variables(TINY), prompts(TINY), LENGTHS, **args)
    with pytest.raises(ValueError, match="prompt_lengths"):
        generate(TINY, init_variables(TINY), prompts(TINY), [0, 3], max_new_tokens=4, temperature=0.0)
