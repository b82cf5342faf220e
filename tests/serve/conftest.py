"""A tiny model + BPE served in-process on a loopback port, and greedy references from `generate`."""
import dataclasses
import functools

import numpy as np
import pytest

from glm5_jax.data.tokenizer import train_bpe
from glm5_jax.generate.decoding import generate
from glm5_jax.serve.api import create_app
from glm5_jax.serve.engine import Engine
from glm5_jax.serve.threaded import ThreadedServer
from tests.generate.tiny_models import TINY, init_variables

# two layers (dense + MoE, full + shared indexer) keep compiles short; the BPE below has < 512 ids
SERVE_CFG = dataclasses.replace(TINY, vocab_size=512, num_hidden_layers=2, indexer_types=("full", "shared"))
MAX_SEQ_LEN = 64
CORPUS = ["def add(x, y):\n    return x + y\n", "The quick brown fox jumps over the lazy dog.\n",
          "Guess a number between 1 and 100: higher, lower, correct!\n",
          "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHello<|assistant|>\nHi"] * 20


@functools.lru_cache(maxsize=1)
def tokenizer():
    return train_bpe(CORPUS, vocab_size=500, show_progress=False)


def variables():
    return init_variables(SERVE_CFG)


def eos_ids():
    return (tokenizer().eos_id,)


def make_engine(max_batch=8):
    """Prompt chunks of <= 32 tokens share one compiled prefill (and longer ones one more)."""
    engine = Engine(SERVE_CFG, variables(), max_batch=max_batch, max_seq_len=MAX_SEQ_LEN, eos_ids=eos_ids(),
                    prefill_buckets=(32,))
    engine.warmup((1,))
    return engine


def greedy_reference(prompts, max_new_tokens, variables_=None):
    """generate()'s greedy (tokens, logprobs) per prompt (<= 32 tokens), cut at max_new_tokens (<= 12) and
    each row's end. Always 12 new tokens from a [B, 32] batch: one compiled program per batch size."""
    batch = np.zeros((len(prompts), 32), np.int32)
    for i, p in enumerate(prompts):
        batch[i, :len(p)] = p
    out = generate(SERVE_CFG, variables_ or variables(), batch, [len(p) for p in prompts],
                   max_new_tokens=12, temperature=0.0, eos_ids=eos_ids())
    lengths = np.minimum(np.asarray(out.lengths), max_new_tokens)
    return [(np.asarray(out.tokens[i, :n]).tolist(), np.asarray(out.logprobs[i, :n])) for i, n in enumerate(lengths)]


@pytest.fixture(scope="session")
def served():
    engine = make_engine().start()
    live = ThreadedServer(create_app(engine, tokenizer(), "tiny"))
    yield engine, live.url
    live.close()
    engine.stop()
