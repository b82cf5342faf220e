"""Weights swapped while a request decodes (RL in-flight updates, docs/rl.md#in-flight-weight-updates): each
token names the version that sampled it, the request goes on with the cache rows the old weights wrote (its
next token is not what the new weights give over rows they recompute), and with ``keep_stale_prefix`` a
finished request's rows stay a reusable prefix after the swap."""
from glm5_jax.serve.engine import Engine, Request
from tests.generate.tiny_models import init_variables
from tests.serve.conftest import MAX_SEQ_LEN, SERVE_CFG, eos_ids, greedy_reference, variables

SWAP_AFTER = 2          # tokens sampled by version 0 before version 1 is handed over


def test_a_swap_mid_request_labels_tokens_and_keeps_the_rows():
    old, new = variables(), init_variables(SERVE_CFG, seed=1)
    engine = Engine(SERVE_CFG, old, max_batch=2, max_seq_len=MAX_SEQ_LEN, eos_ids=eos_ids(), prefill_buckets=(32,),
                    keep_stale_prefix=True).start()
    try:
        prompt = [60, 61, 62, 63]
        request = Request(prompt, 6, temperature=0.0, ignore_eos=True)
        request.on_token = lambda token: (engine.set_variables(new, 1) if len(request.tokens) == SWAP_AFTER
                                          else None)
        engine.generate(request, timeout=120)
        ids = [t.id for t in request.tokens]
        assert [t.weights_version for t in request.tokens] == [0] * SWAP_AFTER + [1] * (6 - SWAP_AFTER)
        assert request.weights_version == 0                       # the version it was admitted with
        (old_ids, _), = greedy_reference([prompt], 6, old)
        assert ids[:SWAP_AFTER] == old_ids[:SWAP_AFTER] and ids[SWAP_AFTER:] != old_ids[SWAP_AFTER:]
        # the first token after the swap, had the new weights recomputed the rows of prompt + 2 tokens
        (_, recomputed_lp), = greedy_reference([prompt + ids[:SWAP_AFTER]], 1, new)
        assert abs(request.tokens[SWAP_AFTER].logprob - recomputed_lp[0]) > 1e-3
        follow_up = engine.generate(Request(prompt + ids + [5], 2, temperature=0.0), timeout=120)
        assert follow_up.cached_tokens == len(prompt) + len(ids) - 1 and follow_up.weights_version == 1
        assert {t.weights_version for t in follow_up.tokens} == {1}
    finally:
        engine.stop()
