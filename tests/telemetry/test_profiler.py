"""Profiler traces of train steps: the chosen steps are traced, the trace's ops carry the model's named
scopes and fall into the compile report's categories; with the option off no profiler call is made."""
import glob
import os

import jax
import numpy as np
import pytest

from glm5_jax.cost.trace_categories import hlo_op_names, time_by_category
from glm5_jax.parallel.mesh import build_mesh
from glm5_jax.telemetry import StepProfiler
from glm5_jax.train.step import Trainer
from tests.train.test_train_step import batch, experiment


def traced_steps(xplane_path: str, name: str = "train") -> list[int]:
    """The step numbers of the trace's StepTraceAnnotation(name, step_num=...) events."""
    steps = []
    for plane in jax.profiler.ProfileData.from_file(xplane_path).planes:
        for line in plane.lines:
            steps += [int(dict(e.stats)["step_num"]) for e in line.events
                      if e.name == name and "step_num" in dict(e.stats)]
    return sorted(steps)


def _train(profiler: StepProfiler, steps: int):
    exp = experiment()
    trainer = Trainer(exp, build_mesh(exp.mesh, jax.devices()[:1]))
    state = trainer.init_state(0)
    for step in range(steps):
        with profiler.step(step):
            state, metrics = trainer.step(state, trainer.put_batch(batch(step)))
        profiler.after_step(step, metrics)
    profiler.stop()


def _double_steps(profiler: StepProfiler, steps: int, after_each=lambda step: None):
    """`steps` jitted doublings through the profiler's step / after_step hooks, then its stop."""
    double = jax.jit(lambda x: 2 * x)
    x = np.ones(3)
    for step in range(steps):
        with profiler.step(step):
            x = double(x)
        profiler.after_step(step, x)
        after_each(step)
    profiler.stop()


def test_a_trace_of_two_steps_holds_the_models_scopes(tmp_path):
    _train(StepProfiler(str(tmp_path), start=1, num_steps=2), steps=3)
    traces = glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(traces) == 1
    assert glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "*.trace.json.gz"))   # Perfetto / trace viewer
    assert traced_steps(traces[0]) == [1, 2]                  # step 0 (the compile) is not traced
    with open(traces[0], "rb") as f:
        op_names = "\n".join(hlo_op_names(f.read())["jit__train_step"].values())
    for scope in ("attention_core", "indexer_kl", "/moe/", "/mtp/"):
        assert scope in op_names
    seconds = time_by_category(traces[0], "jit__train_step")
    for category in ("attention_core", "indexer_topk", "indexer_kl", "routed_experts", "shared_mlp", "mtp",
                     "lm_head_loss", "optimizer"):
        assert seconds.get(category, 0) > 0, seconds


def test_profiling_off_calls_no_profiler(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a profiler function was called")
    for name in ("start_trace", "stop_trace", "StepTraceAnnotation"):
        monkeypatch.setattr(jax.profiler, name, refuse)
    profiler = StepProfiler(str(tmp_path), start=0, num_steps=0)
    _double_steps(profiler, 3)
    assert not profiler.enabled and os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="must be >= 0"):
        StepProfiler(str(tmp_path), start=-1, num_steps=2)


def test_the_trace_stops_after_before_stop(tmp_path, monkeypatch):
    """`before_stop` (the loop's wait for an async checkpoint save) runs once, right before stop_trace,
    after the last traced step."""
    calls = []
    monkeypatch.setattr(jax.profiler, "start_trace", lambda *a, **k: calls.append("start"))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: calls.append("stop"))
    profiler = StepProfiler(str(tmp_path), start=1, num_steps=2, before_stop=lambda: calls.append("wait"))
    _double_steps(profiler, 4, after_each=lambda step: calls.append(f"step {step}"))
    assert calls == ["step 0", "start", "step 1", "wait", "stop", "step 2", "step 3"]
