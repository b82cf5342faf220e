"""The serving engine records routing (RuntimeConfig.capture_routing) for multi-turn RL's routing replay: a
conversation served turn by turn, its prefix reused from the cache, yields per position the experts and the
DSA top-k the model ran it with. A full forward with other routing bias and indexer weights, replaying
them, reproduces every sampled token's log-prob; /v1/tokens' wire form round-trips them."""
import jax
import numpy as np
from flax import traverse_util

from glm5_jax import Transformer
from glm5_jax.generate.decoding import decode_config
from glm5_jax.model import routing_replay as rr
from glm5_jax.rl.env import _first_runs
from glm5_jax.serve.engine import Engine, Request
from glm5_jax.serve.protocol import decode_routing, encode_routing
from tests.serve.conftest import MAX_SEQ_LEN, SERVE_CFG, variables

CFG = decode_config(SERVE_CFG)


def _other_choices(v):
    """The same model but for what only chooses: the routing bias and the indexer's weights."""
    rng = np.random.default_rng(7)
    flat = traverse_util.flatten_dict(v["params"])
    params = {k: x + rng.standard_normal(x.shape).astype(np.float32) if "indexer" in k else x for k, x in flat.items()}
    bias = jax.tree.map(lambda b: b + 2.0 * rng.standard_normal(b.shape).astype(np.float32), v["moe_bias"])
    return {**v, "params": traverse_util.unflatten_dict(params), "moe_bias": bias}


def test_two_turns_replayed_reproduce_the_served_logprobs():
    learner = variables()
    engine = Engine(CFG.replace(capture_routing=True), _other_choices(learner), max_batch=2,
                    max_seq_len=MAX_SEQ_LEN, prefill_buckets=(32,)).start()
    try:
        prompt = list(range(40, 52))
        first = engine.generate(Request(prompt, 6, temperature=1.0, seed=1, ignore_eos=True), timeout=120)
        context = prompt + [t.id for t in first.tokens] + [7, 8, 9]          # the environment's answer
        second = engine.generate(Request(context, 6, temperature=1.0, seed=2, ignore_eos=True), timeout=120)
    finally:
        engine.stop()
    assert second.cached_tokens == len(prompt) + 5          # the first turn's rows, reused
    routing = _first_runs(decode_routing(encode_routing(first.routing)), decode_routing(encode_routing(second.routing)))
    row = context + [t.id for t in second.tokens]
    assert routing[rr.EXPERTS].shape == (len(row) - 1, 1, CFG.num_experts_per_tok)
    assert routing[rr.SELECTED].shape == (len(row) - 1, 1, CFG.index_topk)
    replay = {name: np.concatenate([a, np.full((1,) + a.shape[1:], rr.NOT_RECORDED)])[None]
              for name, a in routing.items()}                   # the last token was never fed

    sampled_at = [len(prompt) + i for i in range(6)] + [len(context) + i for i in range(6)]
    served = np.array([t.logprob for t in first.tokens + second.tokens])

    def logprobs(tree):
        logits = jax.jit(lambda v, t, r: Transformer(CFG).apply(v, t, replay=r).logits)(learner, np.array([row]), tree)
        logp = np.asarray(jax.nn.log_softmax(logits[0], axis=-1))
        return logp[np.array(sampled_at) - 1, np.array(row)[sampled_at]]

    np.testing.assert_allclose(logprobs(rr.to_tree(CFG, replay)), served, atol=2e-5)
    assert np.abs(logprobs(None) - served).max() > 1e-2
