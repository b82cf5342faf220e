"""EleutherAI's lm-evaluation-harness (`lm_eval.simple_evaluate`, model "local-completions") against the
server: a multiple-choice task scored by loglikelihood (echo=true, logprobs) and a generation task with a
stop string, both defined from tests/serve/lm_eval_items.jsonl. Every loglikelihood lm-eval computes equals
the continuation's log-probs summed from `Transformer.apply`; every generation equals greedy `generate`."""
import os

import jax
import numpy as np
import pytest

from glm5_jax.serve.api import create_app
from glm5_jax.serve.threaded import ThreadedServer
from tests.generate.tiny_models import full_logits
from tests.serve.conftest import MAX_SEQ_LEN, SERVE_CFG, greedy_reference, tokenizer, variables

ITEMS = os.path.join(os.path.dirname(__file__), "lm_eval_items.jsonl")
KEY = "eval-key"
MAX_GEN = 6
REFERENCE_LEN = 32


def _task(name, kind, **fields):
    return {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": ITEMS}},
            "test_split": "test", "process_docs": lambda ds: ds.filter(lambda d: d["kind"] == kind), **fields}


TASKS = [
    _task("tiny_choice", "choice", output_type="multiple_choice", doc_to_text="{{question}}",
          doc_to_choice="{{choices}}", doc_to_target="{{label}}", metric_list=[{"metric": "acc"}]),
    _task("tiny_generate", "generate", output_type="generate_until", doc_to_text="{{prompt}}",
          doc_to_target="{{answer}}", metric_list=[{"metric": "exact_match"}],
          generation_kwargs={"until": ["\n"], "max_gen_toks": MAX_GEN, "do_sample": False, "temperature": 0.0}),
]


def _encode_pair(context, continuation):
    """lm-eval's split of context + continuation into token ids: the whole string is tokenized and the
    context's tokens are cut off the front (a context's trailing spaces move to the continuation)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer().encode(context + continuation).tolist()
    context_ids = tokenizer().encode(context).tolist()
    return context_ids, whole[len(context_ids):]


def _loglikelihood(context_ids, continuation_ids):
    ids = context_ids + continuation_ids
    # padded at the end to one length (one compile): a causal model's logits before the padding do not see it
    assert len(ids) <= REFERENCE_LEN
    padded = np.zeros((1, REFERENCE_LEN), np.int32)
    padded[0, :len(ids)] = ids
    logp = np.asarray(jax.nn.log_softmax(full_logits(SERVE_CFG, variables(), padded)[0], axis=-1))
    positions = np.arange(len(context_ids) - 1, len(ids) - 1)
    return float(logp[positions, np.asarray(ids)[positions + 1]].sum())


@pytest.fixture(scope="module")
def results(served, tmp_path_factory, monkeypatch_module):
    import lm_eval
    tokenizer_dir = tmp_path_factory.mktemp("tokenizer")
    tokenizer().save(str(tokenizer_dir / "tokenizer.json"))    # what lm-eval's HF tokenizer loads
    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch_module.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets_cache")))
    monkeypatch_module.setenv("OPENAI_API_KEY", KEY)           # local-completions sends it as a bearer token
    server = ThreadedServer(create_app(served[0], tokenizer(), "tiny", api_key=KEY))
    try:
        out = lm_eval.simple_evaluate(
            model="local-completions", tasks=TASKS, batch_size=4, log_samples=True, bootstrap_iters=0,
            model_args={"model": "tiny", "base_url": server.url + "/v1/completions", "tokenizer": str(tokenizer_dir),
                         "tokenizer_backend": "huggingface", "tokenized_requests": True, "max_length": MAX_SEQ_LEN,
                         "max_retries": 1})
    finally:
        server.close()
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_loglikelihoods_equal_the_forward(results):
    samples = results["samples"]["tiny_choice"]
    assert len(samples) == 3
    for sample in samples:
        doc = sample["doc"]
        got = [float(r[0][0]) for r in sample["resps"]]
        assert len(got) == len(doc["choices"])
        assert [tuple(a) for a in sample["arguments"]] == [(doc["question"], " " + c) for c in doc["choices"]]
        want = [_loglikelihood(*_encode_pair(*args)) for args in sample["arguments"]]
        np.testing.assert_allclose(got, want, atol=1e-4)
        assert sample["acc"] == float(int(np.argmax(want)) == doc["label"])
    assert results["results"]["tiny_choice"]["acc,none"] == pytest.approx(np.mean([s["acc"] for s in samples]))


def test_generations_equal_greedy_generate(results):
    samples = results["samples"]["tiny_generate"]
    assert len(samples) == 3
    for sample in samples:
        prompt_ids = tokenizer().encode(sample["doc"]["prompt"]).tolist()
        (want, _), = greedy_reference([prompt_ids], MAX_GEN)
        text = tokenizer().decode(want).split("\n")[0]
        assert sample["resps"][0][0] == text
        assert sample["exact_match"] == float(text == sample["doc"]["answer"])
