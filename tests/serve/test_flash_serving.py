"""The engine serves GLM-5.3-Flash (KDA layers with a recurrent state beside the MLA latent cache): its greedy
tokens equal `generate`'s, which test_flash_decode ties to transformers' and the full forward."""
import dataclasses

import jax
import numpy as np
import openai
import pytest

from glm5_jax.generate.decoding import generate
from glm5_jax.hf.config import config_from_hf
from glm5_jax.parallel.sampling import sampling_mesh
from glm5_jax.serve.api import create_app
from glm5_jax.serve.engine import Engine, Request
from glm5_jax.serve.threaded import ThreadedServer
from hf_reference_flash import TEXT
from tests.generate.tiny_models import full_logits, init_variables
from tests.serve.conftest import MAX_SEQ_LEN, eos_ids, tokenizer

# one KDA layer (dense FFN) and one MLA + pooled-indexer layer (MoE); the BPE of conftest has < 512 ids;
# KDA chunks of 16 tokens (a 24-token prompt chunk runs two): their body compiles ~4x smaller than at 64
_HF_CFG = config_from_hf({**TEXT, "model_type": "glm5_next", "vocab_size": 512})
FLASH_CFG = dataclasses.replace(_HF_CFG, num_hidden_layers=2, layer_types=("kda", "mla"), first_k_dense_replace=1,
                                runtime=dataclasses.replace(_HF_CFG.runtime, kda_chunk=16))
REF_ROWS, REF_WIDTH, REF_NEW = 6, 56, 6      # one compiled generate program for every reference


def greedy_reference(prompts, max_new_tokens):
    """generate()'s greedy (tokens, logprobs) per prompt, cut at max_new_tokens and each row's end."""
    batch = np.full((REF_ROWS, REF_WIDTH), 2, np.int32)
    lengths = np.ones(REF_ROWS, np.int32)
    for i, p in enumerate(prompts):
        batch[i, :len(p)], lengths[i] = p, len(p)
    out = generate(FLASH_CFG, init_variables(FLASH_CFG), batch, lengths, max_new_tokens=REF_NEW, temperature=0.0,
                   eos_ids=eos_ids())
    n = np.minimum(np.asarray(out.lengths), max_new_tokens)
    return [(np.asarray(out.tokens[i, :n[i]]).tolist(), np.asarray(out.logprobs[i, :n[i]]))
            for i in range(len(prompts))]


def flash_engine(**kw):
    """Prompt chunks of 24 tokens (and the smaller power-of-two buckets a recurrent model adds)."""
    return Engine(FLASH_CFG, init_variables(FLASH_CFG), max_seq_len=MAX_SEQ_LEN, eos_ids=eos_ids(),
                  prefill_buckets=(24,), prefill_chunk=24, **kw)


@pytest.fixture(scope="module")
def engine():
    engine = flash_engine(max_batch=3)
    calls, prefill = [], engine._prefill
    engine._prefill = lambda *a: (calls.append((a[3].shape[1], int(a[4]), int(a[5]))), prefill(*a))[1]
    engine.prefill_calls = calls
    yield engine.start()
    engine.stop()


def test_concurrent_requests_equal_generate(engine):
    """Six requests on three slots (so slots are reused): lengths 5 to 56, three sharing a prefix, one
    repeating another. No prefix is reused (a recurrent state cannot be rewound); a reused slot restarts its
    state. The 56-token prompt prefills 24 + 24 and then 8 tokens: a padded 24-token chunk at 48 would pass
    the row's end, and the shift back that MLA-only models use would feed the state tokens twice."""
    rng = np.random.default_rng(0)
    base = rng.integers(2, FLASH_CFG.vocab_size, 56).tolist()
    prompts = [base[:5], base[:21], rng.integers(2, FLASH_CFG.vocab_size, 3).tolist(), base[:5], base, base[:13]]
    requests = [engine.submit(Request(p, REF_NEW, temperature=0.0)) for p in prompts]
    for r in requests:
        assert r.done.wait(300)
    for request, (tokens, logprobs) in zip(requests, greedy_reference(prompts, REF_NEW)):
        assert [t.id for t in request.tokens] == tokens
        np.testing.assert_allclose([t.logprob for t in request.tokens], logprobs, atol=1e-5)
        assert request.cached_tokens == 0
    assert (8, 48, 8) in engine.prefill_calls and (24, 24, 24) in engine.prefill_calls
    assert engine.snapshot()["cache_held_fraction"] == 0      # finished slots hold no reusable prefix


def test_prompt_logprobs_equal_the_full_forward(engine):
    """A 40-token prompt scored in two chunks (24 + 16): the state carries across them and every position's
    log-probabilities equal the uncached forward's (`Transformer.apply`)."""
    prompt = np.random.default_rng(1).integers(2, FLASH_CFG.vocab_size, 40).tolist()
    scored = engine.generate(Request(prompt, 0, temperature=0.0, prompt_logprobs=True, num_top=3), timeout=300)
    logp = np.asarray(jax.nn.log_softmax(full_logits(FLASH_CFG, init_variables(FLASH_CFG), np.asarray([prompt]))[0]))
    assert scored.prompt_scores[0] is None and scored.finish_reason == "length"
    np.testing.assert_allclose([t.logprob for t in scored.prompt_scores[1:]], logp[np.arange(39), prompt[1:]],
                               atol=1e-5)
    assert [[i for i, _ in t.top] for t in scored.prompt_scores[1:]] == np.argsort(-logp[:39])[:, :3].tolist()
    assert (24, 24, 16) in engine.prefill_calls


def test_the_http_api_answers_a_completion(engine):
    server = ThreadedServer(create_app(engine, tokenizer(), "tiny-flash"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        prompt = "def add(x, y):"
        out = client.completions.create(model="tiny-flash", prompt=prompt, max_tokens=5, temperature=0, logprobs=1)
    finally:
        server.close()
    (want, want_lp), = greedy_reference([tokenizer().encode(prompt).tolist()], 5)
    choice = out.choices[0]
    assert choice.text == tokenizer().decode(want)
    np.testing.assert_allclose(choice.logprobs.token_logprobs, want_lp, atol=1e-5)
    assert out.usage.completion_tokens == len(want)


def test_the_engine_on_a_mesh_serves_the_single_device_tokens():
    """Rows over data, slots over context (65 positions padded to 66), heads over tensor; the KDA state
    splits by rows like the latent cache."""
    engine = flash_engine(max_batch=2, mesh=sampling_mesh("data:2,context:2,tensor:2"))
    leaves = {jax.tree_util.keystr(k): x for k, x in jax.tree_util.tree_leaves_with_path(engine._cache)}
    rows = ("data", "fsdp", "expert")
    assert [tuple(x.sharding.spec)[:3] for k, x in leaves.items() if "latent" in k] == [(None, rows, "context")]
    assert [tuple(x.sharding.spec)[:2] for k, x in leaves.items() if "kda_state" in k] == [(None, rows)]
    rng = np.random.default_rng(0)
    base = rng.integers(2, FLASH_CFG.vocab_size, 56).tolist()
    prompts = [base[:5], base[:21], base[:13]]
    engine.start()
    try:
        requests = [engine.submit(Request(p, REF_NEW, temperature=0.0)) for p in prompts]
        for r in requests:
            assert r.done.wait(300)
    finally:
        engine.stop()
    for request, (tokens, logprobs) in zip(requests, greedy_reference(prompts, REF_NEW)):
        assert [t.id for t in request.tokens] == tokens
        np.testing.assert_allclose([t.logprob for t in request.tokens], logprobs, atol=1e-5)
