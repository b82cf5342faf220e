"""The engine directly: per-row sampling, prefix reuse, seeds, cancellation and hot reload."""
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from glm5_jax.checkpoint.handoff import PolicyWriter
from glm5_jax.checkpoint.stored_config import config_to_json
from glm5_jax.serve.engine import Engine, Request
from glm5_jax.serve.reload import CheckpointSource, PolicySource, WeightsWatcher
from glm5_jax.generate.slot_sampling import sample_rows
from tests.generate.test_generate import reference_log_probs
from tests.generate.tiny_models import init_variables
from tests.serve.conftest import MAX_SEQ_LEN, SERVE_CFG, eos_ids, greedy_reference, make_engine, variables


def test_each_row_samples_under_its_own_settings():
    """One batch, one temperature / top-p / top-k per row: each row's log-probs (all of them, read back as
    its top-V) are those of the sampling distribution computed by hand for that row."""
    settings = [(0.0, 1.0, 0), (1.0, 1.0, 0), (0.7, 1.0, 5), (1.3, 0.8, 0), (0.9, 0.6, 7)]
    B, V = len(settings), 50
    logits = jax.random.normal(jax.random.key(1), (B, V)) * 3
    temperature, top_p, top_k = (jnp.asarray(column, dtype) for column, dtype in
                                 zip(zip(*settings), (jnp.float32, jnp.float32, jnp.int32)))
    key_data = jax.random.key_data(jax.random.split(jax.random.key(0), B))
    _, _, top_ids, top_logp = sample_rows(logits, temperature, top_p, top_k, key_data, jnp.zeros(B, jnp.int32), V)
    got = np.full((B, V), -np.inf, np.float32)
    np.put_along_axis(got, np.asarray(top_ids), np.asarray(top_logp), axis=-1)
    rows = np.asarray(logits)
    for b, (t, p, k) in enumerate(settings):
        z = rows[b].astype(np.float64)
        want = z - z.max() - np.log(np.exp(z - z.max()).sum()) if t == 0 else reference_log_probs(rows[b], t, k, p)
        np.testing.assert_array_equal(np.isinf(got[b]), np.isinf(want))
        np.testing.assert_allclose(np.where(np.isinf(want), 0, got[b]), np.where(np.isinf(want), 0, want), atol=1e-5)


@pytest.fixture(scope="module")
def engine():
    engine = make_engine().start()
    yield engine
    engine.stop()


def _ids(request):
    return [t.id for t in request.tokens]


def test_next_turn_reuses_the_cached_prefix(engine):
    first = engine.generate(Request([7, 8, 9, 10, 11], 6, temperature=0.0), timeout=60)
    second_prompt = first.prompt + _ids(first) + [12, 13]
    second = engine.generate(Request(second_prompt, 6, temperature=0.0), timeout=60)
    # rows of the prompt and of every fed completion token (all but the last sampled one) are reused
    assert second.cached_tokens == len(first.prompt) + len(first.tokens) - 1
    (want1, lp1), (want2, lp2) = greedy_reference([first.prompt, second_prompt], 6)
    assert _ids(first) == want1 and _ids(second) == want2
    np.testing.assert_allclose([t.logprob for t in second.tokens], lp2, atol=1e-4)


def test_a_long_prompt_prefills_in_chunks():
    """prefill_chunk=8: a 21-token prompt runs as three prefill calls of 8 tokens (the last padded) at
    positions 0, 8, 16; greedy tokens and log-probs equal generate()'s whole-prompt prefill."""
    engine = Engine(SERVE_CFG, variables(), max_batch=2, max_seq_len=MAX_SEQ_LEN, eos_ids=eos_ids(),
                    prefill_buckets=(32,), prefill_chunk=8)
    calls, prefill = [], engine._prefill
    engine._prefill = lambda *a: (calls.append((a[3].shape, int(a[4]), int(a[5]))), prefill(*a))[1]
    engine.start()
    try:
        prompt = list(range(30, 51))
        got = engine.generate(Request(prompt, 6, temperature=0.0), timeout=120)
    finally:
        engine.stop()
    assert calls == [((1, 8), 0, 8), ((1, 8), 8, 8), ((1, 8), 16, 5)]
    (want, logprobs), _ = greedy_reference([prompt, prompt], 6)
    assert _ids(got) == want
    np.testing.assert_allclose([t.logprob for t in got.tokens], logprobs, atol=1e-4)


def test_parallel_samples_copy_a_busy_slots_prefix(engine):
    prompt = [20, 21, 22, 23, 24, 25, 26]
    requests = [engine.submit(Request(prompt, 5, temperature=0.0)) for _ in range(3)]
    for r in requests:
        assert r.done.wait(60)
    (want, _), _ = greedy_reference([prompt, prompt], 5)           # batch 2: the program compiled above
    assert all(_ids(r) == want for r in requests)
    assert sorted(r.cached_tokens for r in requests) == [0, len(prompt) - 1, len(prompt) - 1]


def test_a_seed_gives_the_same_tokens_whatever_runs_beside_it(engine):
    kw = dict(temperature=1.0, top_k=40, seed=123)
    alone = engine.generate(Request([30, 31, 32], 10, **kw), timeout=60)
    crowd = [engine.submit(Request([40 + i] * (i + 1), 10, temperature=1.0)) for i in range(5)]
    again = engine.submit(Request([30, 31, 32], 10, **kw))
    for r in crowd + [again]:
        assert r.done.wait(60)
    assert _ids(again) == _ids(alone) and [t.logprob for t in again.tokens] == [t.logprob for t in alone.tokens]


def test_cancel_ends_a_request_and_frees_its_slot(engine):
    request = Request([50, 51], 40, temperature=0.0, ignore_eos=True)
    request.on_token = lambda token: request.cancel()
    engine.generate(request, timeout=60)
    assert request.finish_reason == "abort" and 1 <= len(request.tokens) <= 3
    assert engine.snapshot()["running"] == 0


def _save(directory, step, variables):
    with ocp.CheckpointManager(directory, item_names=("state",)) as manager:
        manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(variables)),
                     custom_metadata={"model_config": config_to_json(SERVE_CFG)})
        manager.wait_until_finished()


def test_hot_reload_serves_a_newer_committed_step(engine, tmp_path):
    old, new = init_variables(SERVE_CFG), init_variables(SERVE_CFG, seed=1)
    _save(str(tmp_path), 1, old)
    watcher = WeightsWatcher(engine, CheckpointSource(str(tmp_path)), SERVE_CFG, step=1)
    assert not watcher.poll()
    prompt = [60, 61, 62, 63]
    before = engine.generate(Request(prompt, 6, temperature=0.0), timeout=60)
    _save(str(tmp_path), 2, new)
    assert watcher.poll() and watcher.step == 2
    after = engine.generate(Request(prompt, 6, temperature=0.0), timeout=60)
    assert after.weights_version == 2 and after.cached_tokens == 0        # old rows are not reused
    (want_old, _), = greedy_reference([prompt], 6, old)
    (want_new, lp_new), = greedy_reference([prompt], 6, new)
    assert want_old != want_new
    assert _ids(before) == want_old and _ids(after) == want_new
    np.testing.assert_allclose([t.logprob for t in after.tokens], lp_new, atol=1e-4)
    engine.set_variables(old, 0)


def test_reload_follows_an_rl_runs_policy_versions(engine, tmp_path):
    new = init_variables(SERVE_CFG, seed=1)
    watcher = WeightsWatcher(engine, PolicySource(str(tmp_path), engine.variables), SERVE_CFG, step=-1)
    assert not watcher.poll()                                  # no policy published yet
    writer = PolicyWriter(str(tmp_path), max_to_keep=3)
    writer.publish(4, new, {"version": 4})
    writer.wait()
    writer.close()
    assert watcher.poll() and engine.generate(Request([1, 2], 1), timeout=60).weights_version == 4
    prompt = [60, 61, 62, 63]
    (want, _), = greedy_reference([prompt], 6, new)
    assert _ids(engine.generate(Request(prompt, 6, temperature=0.0), timeout=60)) == want
    engine.set_variables(init_variables(SERVE_CFG), 0)


def test_a_profiled_engine_traces_the_chosen_steps(tmp_path):
    """--profile_start=1 --profile_steps=2: engine steps 1 and 2 (admit + decode rounds) are traced,
    and their ops are the serving programs' (prefill, decode) with the model's attention scopes."""
    import glob

    from glm5_jax.cost.trace_categories import hlo_op_names, op_events
    from glm5_jax.telemetry import StepProfiler
    from tests.telemetry.test_profiler import traced_steps

    engine = Engine(SERVE_CFG, variables(), max_batch=2, max_seq_len=MAX_SEQ_LEN, eos_ids=eos_ids(),
                    prefill_buckets=(32,), profiler=StepProfiler(str(tmp_path), 1, 2, name="serve_step")).start()
    try:
        got = engine.generate(Request([5, 6, 7, 8], 5, temperature=0.0, ignore_eos=True), timeout=120)
    finally:
        engine.stop()
    assert len(got.tokens) == 5
    traces = glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(traces) == 1 and traced_steps(traces[0], "serve_step") == [1, 2]
    with open(traces[0], "rb") as f:
        names = hlo_op_names(f.read())
    modules = {m for m, _, _ in op_events(traces[0])}
    assert any("_decode" in m for m in modules)
    assert any("attention_core" in n for m in modules for n in names.get(m, {}).values())
