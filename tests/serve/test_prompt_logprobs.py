"""echo=true with logprobs on /v1/completions: the prompt's log-probs equal the model's own forward."""
import jax
import numpy as np
import openai
import pytest

from tests.generate.tiny_models import full_logits
from glm5_jax.serve.engine import Engine, Request
from tests.serve.conftest import MAX_SEQ_LEN, SERVE_CFG, eos_ids, greedy_reference, tokenizer, variables

TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(x, y):\n    return x"]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=60)


def _ids(text):
    return tokenizer().encode(text).tolist()


def _reference(ids):
    """(log-prob of each token given those before it [T-1], log-probs at every position [T, V])."""
    logp = np.asarray(jax.nn.log_softmax(full_logits(SERVE_CFG, variables(), np.asarray([ids]))[0], axis=-1))
    return logp[np.arange(len(ids) - 1), ids[1:]], logp


def _check_prompt(lp, ids, top_n):
    want, logp = _reference(ids)
    assert lp.tokens[:len(ids)] == [tokenizer().decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], want, atol=1e-4)
    for p in range(1, len(ids)):
        best = {}
        for i in np.argsort(-logp[p - 1])[:top_n]:     # ids that decode alike keep the best log-prob
            best.setdefault(tokenizer().decode([i]), logp[p - 1, i])
        assert lp.top_logprobs[p].keys() == best.keys()
        np.testing.assert_allclose([lp.top_logprobs[p][k] for k in best], list(best.values()), atol=1e-4)
    offsets = np.cumsum([0] + [len(t) for t in lp.tokens[:-1]])
    assert lp.text_offset == offsets.tolist()


def test_echo_max_tokens_0_scores_batched_string_and_id_prompts(client):
    ids = [_ids(TEXTS[0]), _ids(TEXTS[1])]
    assert len(ids[0]) > SERVE_CFG.index_topk    # the sparse attention selects among the keys
    out = client.completions.create(model="tiny", prompt=TEXTS, max_tokens=0, echo=True, logprobs=3)
    assert [c.text for c in out.choices] == TEXTS
    for choice, p in zip(out.choices, ids):
        assert len(choice.logprobs.tokens) == len(p) and choice.finish_reason == "length"
        _check_prompt(choice.logprobs, p, 3)
    assert out.usage.prompt_tokens == sum(map(len, ids)) and out.usage.completion_tokens == 0

    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1)
    for a, b in zip(out.choices, by_ids.choices):
        assert b.text == a.text
        np.testing.assert_allclose(b.logprobs.token_logprobs[1:], a.logprobs.token_logprobs[1:], atol=1e-6)


def test_echo_with_completion_appends_the_greedy_tokens(client):
    ids = _ids(TEXTS[1])
    (want, want_lp), = greedy_reference([ids], 4)
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=4, echo=True, logprobs=2, temperature=0)
    choice = out.choices[0]
    assert choice.text == TEXTS[1] + tokenizer().decode(want)
    _check_prompt(choice.logprobs, ids, 2)
    np.testing.assert_allclose(choice.logprobs.token_logprobs[len(ids):], want_lp, atol=1e-4)
    assert choice.logprobs.tokens[len(ids):] == [tokenizer().decode([t]) for t in want]


def test_max_tokens_0_needs_echo(client):
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="tiny", prompt="The quick", max_tokens=0)


def test_a_prompt_scored_in_chunks_equals_the_forward():
    """prefill_chunk=8: the token after each chunk is scored from the chunk's last position."""
    engine = Engine(SERVE_CFG, variables(), max_batch=2, max_seq_len=MAX_SEQ_LEN, eos_ids=eos_ids(),
                    prefill_buckets=(32,), prefill_chunk=8).start()
    try:
        prompt = list(range(30, 51))
        got = engine.generate(Request(prompt, 0, num_top=2, prompt_logprobs=True), timeout=120)
    finally:
        engine.stop()
    assert got.finish_reason == "length" and got.tokens == [] and got.prompt_scores[0] is None
    want, logp = _reference(prompt)
    assert [t.id for t in got.prompt_scores[1:]] == prompt[1:]
    np.testing.assert_allclose([t.logprob for t in got.prompt_scores[1:]], want, atol=1e-4)
    np.testing.assert_array_equal([[i for i, _ in t.top] for t in got.prompt_scores[1:]],
                                  np.argsort(-logp[:-1], axis=-1)[:, :2])
