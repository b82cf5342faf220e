"""The engine on a sampling mesh serves the tokens of the single-device run (generate's greedy reference,
which the single-device engine matches: test_engine.py)."""
import jax
import numpy as np
import pytest

from glm5_jax.parallel.mesh import MeshError
from glm5_jax.parallel.sampling import sampling_mesh
from glm5_jax.serve.engine import Engine, Request
from tests.generate.tiny_models import init_variables
from tests.serve.conftest import MAX_SEQ_LEN, SERVE_CFG, eos_ids, greedy_reference, variables


@pytest.mark.parametrize("spec", ["data:2,expert:2,tensor:2", "context:2,tensor:2"])
def test_engine_on_a_mesh_serves_the_single_device_tokens(spec):
    """Four requests at once on four slots: a 21-token prompt, two short ones, and one repeating the first
    prompt while it runs (its prefix is copied from that busy slot), then one on reloaded weights. Cache rows
    split over the batch axes, slots over context (65 positions padded to 66 there)."""
    engine = Engine(SERVE_CFG, variables(), max_batch=4, max_seq_len=MAX_SEQ_LEN, eos_ids=eos_ids(),
                    prefill_buckets=(32,), mesh=sampling_mesh(spec))
    latent = jax.tree.leaves(engine._cache)[0]
    assert tuple(latent.sharding.spec) == (None, ("data", "fsdp", "expert"), "context", None)
    assert latent.shape[2] == (66 if "context" in spec else 65)
    prompts = [[7, 8, 9, 10, 11], list(range(30, 51)), [20, 21, 22], [7, 8, 9, 10, 11]]
    engine.start()
    try:
        requests = [engine.submit(Request(p, 12, temperature=0.0)) for p in prompts]
        for r in requests:
            assert r.done.wait(300)
        # new weights handed over on one device (a checkpoint reload) are placed on the mesh
        new = init_variables(SERVE_CFG, seed=1)
        engine.set_variables(new, 1)
        reloaded = engine.generate(Request(prompts[2], 12, temperature=0.0), timeout=300)
    finally:
        engine.stop()
    want = greedy_reference(prompts, 12)
    for request, (tokens, logprobs) in zip(requests, want):
        assert [t.id for t in request.tokens] == tokens
        np.testing.assert_allclose([t.logprob for t in request.tokens], logprobs, atol=1e-4)
    assert requests[3].cached_tokens == 4
    want_new = greedy_reference(prompts, 12, new)[2][0]            # the [4, 32] program compiled above
    assert reloaded.weights_version == 1 and [t.id for t in reloaded.tokens] == want_new != want[2][0]


def test_max_batch_must_fill_the_batch_shards():
    with pytest.raises(MeshError, match=r"^max_batch=6: the sampling mesh splits the batch 4 ways; give a multiple"):
        Engine(SERVE_CFG, variables(), max_batch=6, max_seq_len=MAX_SEQ_LEN, mesh=sampling_mesh("data:2,expert:2"))
