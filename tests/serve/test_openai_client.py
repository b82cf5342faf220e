"""The official `openai` client against the in-process server: outputs equal `generate`'s."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest

from glm5_jax.serve.text import ChatTemplate
from tests.serve.conftest import greedy_reference, tokenizer

PROMPT = "def add(x, y):"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick fox"}]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=60)


def _ids(text):
    return tokenizer().encode(text).tolist()


def test_completion_text_and_logprobs_equal_generate(client):
    (want, want_lp), = greedy_reference([_ids(PROMPT)], 8)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    choice = out.choices[0]
    assert choice.text == tokenizer().decode(want)
    np.testing.assert_allclose(choice.logprobs.token_logprobs, want_lp, atol=1e-4)
    assert choice.logprobs.tokens == [tokenizer().decode([t]) for t in want]
    # the sampled (greedy) token is the best of the top alternatives
    assert all(max(top.values()) == pytest.approx(lp, abs=1e-6)
               for top, lp in zip(choice.logprobs.top_logprobs, choice.logprobs.token_logprobs))
    assert out.usage.prompt_tokens == len(_ids(PROMPT)) and out.usage.completion_tokens == len(want)
    assert choice.finish_reason == ("length" if len(want) == 8 else "stop")

    streamed = client.completions.create(model="tiny", prompt=_ids(PROMPT), max_tokens=8, temperature=0, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_chat_uses_the_template_and_equals_generate(client):
    prompt = ChatTemplate().render(MESSAGES)
    assert prompt == "[gMASK]<sop><|system|>\nBe brief.<|user|>\nThe quick fox<|assistant|>\n"
    (want, want_lp), = greedy_reference([_ids(prompt)], 6)
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=2)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == tokenizer().decode(want)
    np.testing.assert_allclose([c.logprob for c in choice.logprobs.content], want_lp, atol=1e-4)
    assert all(len(c.top_logprobs) == 2 for c in choice.logprobs.content)

    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].usage.completion_tokens == len(want)


def test_stop_string_cuts_the_text(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = full[3:5]
    assert stop and full.find(stop) >= 0
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert out.choices[0].text == full[:full.find(stop)] and out.choices[0].finish_reason == "stop"
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == full[:full.find(stop)]


def test_seeded_sampling_repeats_and_n_choices(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=1.0, top_p=0.9, seed=7, logprobs=0)
    a = client.completions.create(**kw, n=2)
    b = client.completions.create(**kw)
    assert len(a.choices) == 2 and [c.index for c in a.choices] == [0, 1]
    assert a.choices[0].text == b.choices[0].text                 # choice 0 uses seed 7, choice 1 seed 8
    assert a.choices[0].logprobs.token_logprobs == b.choices[0].logprobs.token_logprobs
    # a sampling log-prob under top_p < 1 is renormalised, so it is >= the plain model log-prob (< 0 here)
    assert all(lp <= 0 for lp in a.choices[1].logprobs.token_logprobs)


def test_32_concurrent_clients_with_mixed_lengths(client):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 500, int(rng.integers(1, 21))).tolist() for _ in range(32)]
    budgets = [int(b) for b in rng.integers(1, 13, 32)]
    reference = greedy_reference(prompts, 12)    # cut to each budget below

    def ask(i):
        return client.completions.create(model="tiny", prompt=prompts[i], max_tokens=budgets[i], temperature=0,
                                         logprobs=0)

    with ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(ask, range(32)))
    for i, out in enumerate(outs):
        want, want_lp = reference[i]
        want, want_lp = want[:budgets[i]], want_lp[:budgets[i]]
        assert out.choices[0].text == tokenizer().decode(want), i
        np.testing.assert_allclose(out.choices[0].logprobs.token_logprobs, want_lp, atol=1e-4)


def test_an_unknown_model_raises_the_clients_not_found_error(client):
    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert err.value.status_code == 404
    assert err.value.body == {"message": "The model `gpt-4o` does not exist.", "type": "NotFoundError",
                              "param": "model", "code": 404}
