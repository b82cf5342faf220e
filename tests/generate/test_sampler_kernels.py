"""The samplers through the decode program's kernels (RuntimeConfig.sampler_kernels, glm5_jax/generate/settings.py):
generate and the serving engine on a data:2,expert:2,tensor:2 sampling mesh and the RL in-flight sampler
(a weights swap mid-decode) give the greedy tokens of XLA's single-device decode, their fp32 log-probs within the
kernels' summation order, with the kernels traced in; so does MTP speculation, whose verify windows run the step's
settings; settings the kernels do not run fail by name."""
import jax
import numpy as np
import pytest

from glm5_jax.checkpoint.placement import place_variables
from glm5_jax.generate.decoding import Sampler, cache_slots, generate, prepare_generate
from glm5_jax.generate.on_mesh import place_prompts, prepare_generate_on_mesh, real_rows
from glm5_jax.generate.settings import kernels_context, no_drop_capacity, sampler_configs, step_variables
from glm5_jax.model.moe.decode_a2a import destination_capacity
from glm5_jax.model.moe.decode_dispatch import local_capacity
from glm5_jax.model.moe.int4_weights import quantize_params
from glm5_jax.parallel.mesh import mesh_and_rules
from glm5_jax.parallel.sampling import SAMPLING_RULES, sampling_mesh
from glm5_jax.rl.inflight import _programs, sample_inflight
from glm5_jax.serve.engine import Engine, Request
from pallas_kernels.bf16_decode_moe.kernel import NAME as BF16_MOE
from pallas_kernels.int4_moe_rows.kernel import NAME as INT4_ROWS
from pallas_kernels.sparse_mla_decode.kernel import NAME as ATTENTION
from tests.generate.tiny_models import TINY, init_variables
from tests.serve.conftest import MAX_SEQ_LEN, SERVE_CFG, eos_ids, greedy_reference, variables as serve_variables

B, P, N = 4, 12, 10                    # prompt 12 + 10 new > index_topk = 8: the top-k drops slots
LENGTHS = np.array([12, 5, 9, 12], np.int32)
MESH = "data:2,expert:2,tensor:2"
# the kernels sum their fp32 products in another order than XLA's fusions: log-probs agree to a few ulps of
# their magnitude (~1e-5 measured), the tokens exactly
LOGP_ATOL = 3e-5


def _model(experts):
    """A tiny model with sharp logits (initializer 0.3), expert widths the kernels tile on tensor:2 (INT4: F / 2 a
    multiple of 8 x the group of 8, and rows of whole 128-lane tiles, which the received-rows kernel takes);
    INT4 experts packed as a quantised checkpoint holds them."""
    int4 = experts == "int4"
    cfg = TINY.replace(hidden_size=128 if int4 else 64, moe_intermediate_size=128 if int4 else 64,
                       quant_group_size=8, mtp_depth=0, num_nextn_predict_layers=0, initializer_range=0.3)
    variables = init_variables(cfg)
    if experts == "int4":
        cfg = cfg.replace(quant="int4")
        variables = {**variables, "params": quantize_params(variables["params"], cfg)}
    return cfg, variables


@pytest.mark.parametrize("experts,dispatch,moe_kernel", [("bf16", "gather", BF16_MOE),
                                                         ("int4", "a2a_decode", INT4_ROWS)])
def test_generate_on_a_mesh_through_the_kernels(experts, dispatch, moe_kernel):
    cfg, variables = _model(experts)
    prompts = np.random.default_rng(0).integers(2, cfg.vocab_size, (B, P)).astype(np.int32)
    want = generate(cfg, variables, prompts, LENGTHS, max_new_tokens=N, temperature=0.0)

    kernels = cfg.replace(sampler_kernels="pallas_interpret", sampler_dispatch=dispatch, moe_impl="ragged_dot")
    assert cache_slots(kernels, P, N, P) == 24 and cache_slots(cfg, P, N, P) == 22      # whole 8-row HBM tiles
    mesh = sampling_mesh(MESH)
    fn, args, rows = prepare_generate_on_mesh(kernels, place_variables(variables, kernels, mesh, SAMPLING_RULES),
                                              prompts, LENGTHS, mesh, max_new_tokens=N, temperature=0.0)
    with mesh_and_rules(mesh, SAMPLING_RULES):
        program = str(jax.make_jaxpr(fn)(*args))
        got = real_rows(fn(*args), rows)
    assert f"name={ATTENTION}" in program and f"name={moe_kernel}" in program
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=LOGP_ATOL, rtol=0)
    assert len(np.unique(np.asarray(want.tokens))) > 10                  # varied tokens, not one repeated


def test_engine_on_a_mesh_through_the_kernels():
    """The server (and so the RL policy server) on data:2,expert:2,tensor:2: prompts prefill one row at a time,
    every slot decodes through the kernels; its cache slots whole HBM tiles (65 -> 72)."""
    cfg = SERVE_CFG.replace(sampler_kernels="pallas_interpret", moe_impl="ragged_dot")
    engine = Engine(cfg, serve_variables(), max_batch=4, max_seq_len=MAX_SEQ_LEN, eos_ids=eos_ids(),
                    prefill_buckets=(32,), mesh=sampling_mesh(MESH))
    assert engine.row_len == 72
    B_ = engine.max_batch
    with engine._rules(SAMPLING_RULES):
        step = str(jax.make_jaxpr(engine._decode)(
            engine._step_variables, engine._cache, np.zeros(B_, np.int32), np.zeros(B_, np.int32),
            np.zeros(B_, np.float32), np.ones(B_, np.float32), np.zeros(B_, np.int32), np.zeros((B_, 2), np.uint32),
            np.zeros(B_, np.int32)))
    assert f"name={ATTENTION}" in step and f"name={BF16_MOE}" in step      # (the router: expert groups, XLA's)
    prompts = [list(range(30, 51)), [20, 21, 22]]
    engine.start()
    try:
        requests = [engine.submit(Request(p, 12, temperature=0.0)) for p in prompts]
        for r in requests:
            assert r.done.wait(300)
    finally:
        engine.stop()
    assert engine.error is None
    for request, (tokens, logprobs) in zip(requests, greedy_reference(prompts, 12)):
        assert [t.id for t in request.tokens] == tokens
        np.testing.assert_allclose([t.logprob for t in request.tokens], logprobs, atol=LOGP_ATOL, rtol=0)


def test_inflight_swap_through_the_kernels():
    """A weights swap before step 4 on a data:2,expert:4 mesh: the kernels' step reads the new version's
    restacked weights (the same tokens, versions and log-probs as XLA's decode steps)."""
    cfg, old = _model("bf16")
    new = init_variables(cfg, seed=1)
    prompts = np.random.default_rng(1).integers(2, cfg.vocab_size, (B, P)).astype(np.int32)
    mesh = sampling_mesh("data:2,expert:4")

    def run(c):
        calls, placed_new = [], place_variables(new, c, mesh, SAMPLING_RULES)

        def newer(version):
            calls.append(version)
            return (1, placed_new) if len(calls) == 3 else None
        return sample_inflight(c, mesh, SAMPLING_RULES, place_variables(old, c, mesh, SAMPLING_RULES), 0, prompts,
                               LENGTHS, max_new_tokens=N, sampler=Sampler(0.0), rng=None, newer=newer)

    kernels = cfg.replace(sampler_kernels="pallas_interpret", moe_impl="ragged_dot")
    want, got = run(cfg), run(kernels)
    prefill, step = _programs(kernels, N, Sampler(0.0), P)
    placed = place_variables(old, kernels, mesh, SAMPLING_RULES)
    tokens, lengths, _ = place_prompts(prompts, LENGTHS, mesh, SAMPLING_RULES, N, 8)
    with mesh_and_rules(mesh, SAMPLING_RULES):
        cache, token, _ = prefill(placed, tokens, lengths, jax.random.key(0))
        program = str(jax.make_jaxpr(step)(step_variables(sampler_configs(kernels)[1], placed), cache, token, lengths,
                                           np.int32(1), jax.random.key(0)))
    assert f"name={ATTENTION}" in program and f"name={BF16_MOE}" in program
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.token_versions, want.token_versions)
    assert set(np.unique(want.token_versions)) == {0, 1}
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=LOGP_ATOL, rtol=0)


@pytest.mark.parametrize("change,match", [
    ({"quant": "int4_qat", "quant_group_size": 8, "moe_intermediate_size": 64},
     "reads bf16 or packed INT4 experts, not quant='int4_qat'"),
    ({"attention_mode": "dense"}, "decodes DSA's sparse stage; this model runs attention_mode='dense'"),
    ({"capture_routing": True}, "has no routing capture"),
])
def test_settings_the_kernels_do_not_run_fail_by_name(change, match):
    cfg = TINY.replace(sampler_kernels="pallas", **change)
    with pytest.raises(ValueError, match=match):
        sampler_configs(cfg)


def test_speculation_verifies_through_the_kernels():
    """MTP speculation (copy drafts, accepted where greedy text repeats a token): the verify windows through the
    step's kernels accept the same drafts and emit XLA's tokens."""
    from tests.generate.test_generate import LENGTHS as SPEC_LENGTHS, copy_drafting_mtp, prompts as spec_prompts

    variables = copy_drafting_mtp(init_variables(TINY))
    prompt = spec_prompts(TINY, seed=5)
    run = lambda c: generate(c, variables, prompt, SPEC_LENGTHS, max_new_tokens=N, temperature=0.0,  # noqa: E731
                             speculative=True)
    kernels = TINY.replace(sampler_kernels="pallas_interpret", moe_impl="ragged_dot")
    want, got = run(TINY), run(kernels)
    fn, args = prepare_generate(kernels, variables, prompt, SPEC_LENGTHS, max_new_tokens=N, temperature=0.0,
                                speculative=True)
    with kernels_context(kernels):
        program = str(jax.make_jaxpr(fn)(*args))
    # a window of K + 1 tokens gathers its rows in place (the fused attention kernel takes one token a row)
    assert "name=stacked_row_gather" in program and f"name={BF16_MOE}" in program
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=LOGP_ATOL, rtol=0)
    assert (int(got.drafted), int(got.accepted)) == (int(want.drafted), int(want.accepted))
    assert 0 < want.acceptance_rate < 1


def test_xla_samplers_keep_one_config():
    """sampler_kernels="xla": the prefill's config decodes too (the samplers' default)."""
    prefill, step = sampler_configs(TINY)
    assert prefill is step and prefill.runtime.moe_ep == "none" and prefill.runtime.decode_cache_write == "layer"


@pytest.mark.parametrize("config", ["glm5_744b_pretrain", "glm53_flash"])
def test_a_pod_trained_checkpoint_samples(config):
    """A train.py checkpoint stores its run's runtime settings (the a2a transport's chunks and aligned expert
    groups): the samplers' configs drop that transport with them instead of failing validation."""
    import runpy

    cfg = runpy.run_path(f"configs/{config}.py")["get_config"]().model
    assert cfg.runtime.moe_ep == "a2a" and cfg.runtime.moe_group_align > 1
    prefill, step = sampler_configs(cfg)
    assert (prefill.runtime.moe_ep, prefill.runtime.moe_group_align, prefill.runtime.moe_a2a_chunks) == ("none", 1, 1)
    if config == "glm5_744b_pretrain":
        step = sampler_configs(cfg.replace(sampler_kernels="pallas", sampler_dispatch="a2a_decode"))[1]
        assert step.runtime.moe_ep == "a2a_decode" and step.runtime.decode_a2a_exchange == "ragged"


def test_the_samplers_dispatch_drops_nothing():
    """sampler_capacity=0 (the default): each chip's capacity covers the most assignments its experts can get, by
    hand at GLM-5's E = 256, K = 8: the gather keeps every gathered assignment (its one-call kernel takes them
    whole); a2a_decode on expert:64 (4 experts a chip, 48 tokens a chip) sends each chip up to 48 x 4 rows and a
    chip receives up to 64 x 48 x 4, against 16 (2 x 6 expected, in 16-row tiles) and 768 at the compile report's
    2.0."""
    cfg = TINY.replace(n_routed_experts=256, num_experts_per_tok=8, sampler_kernels="pallas")
    gather = sampler_configs(cfg)[1].runtime.moe_capacity_factor
    assert gather == no_drop_capacity(cfg) == 256.0
    assert local_capacity(64 * 8, 4, 256, gather) == 64 * 8                 # every gathered assignment
    a2a = sampler_configs(cfg.replace(sampler_dispatch="a2a_decode"))[1].runtime.moe_capacity_factor
    assert a2a == 32.0
    assert destination_capacity(48, 8, 256, 4, a2a) == 48 * 4               # each destination: every row it can get
    assert local_capacity(48 * 64 * 8, 4, 256, a2a) == 64 * 48 * 4         # each receiver: every row it can get
    assert destination_capacity(48, 8, 256, 4, 2.0) == 16 and local_capacity(48 * 64 * 8, 4, 256, 2.0) == 768
    assert sampler_configs(cfg.replace(sampler_capacity=2.0))[1].runtime.moe_capacity_factor == 2.0
