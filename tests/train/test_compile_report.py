"""AOT compile of the real train step for TPU from this CPU host (libtpu) through `train.py --compile_only`
on v5p:2x2x1 (4 chips), checked for a sane compile_report.json.

* `test_compile_only_small_glm5_on_v5p` (CI): the GLM-5 structure (MLA + DSA indexer, 1 dense + 2 MoE
  layers + MTP, a2a expert parallelism, full remat) at configs/tiny.py widths: 60-90 s on one core of the
  shared host, most of it libtpu's compile (fewer layers, no MTP or no remat do not make it faster).
* `test_compile_only_reduced_glm5_on_v5p` (slow): production widths (hidden 6144, 64 heads, MLA/DSA dims,
  154880 vocab, expert width 2048), 1 dense + 1 MoE layer + MTP: 5-8 minutes of libtpu compile on one core
  of the shared 2-core host (a single production-width layer alone takes over 100 s), so not in CI.
"""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from tests.train.test_train_cli import ROOT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not importable (pip install -r requirements-tpu.txt)")

MESH = ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=1"]
SMALL = ["model.vocab_size=4096", "data.vocab_size=4096", "model.hidden_size=128", "model.intermediate_size=384",
         "model.num_attention_heads=4", "model.q_lora_rank=96", "model.kv_lora_rank=64", "model.qk_nope_head_dim=32",
         "model.qk_rope_head_dim=16", "model.v_head_dim=32", "model.index_n_heads=4", "model.index_head_dim=32",
         "model.index_topk=64", "model.n_routed_experts=8", "model.moe_intermediate_size=128",
         "model.eos_token_id=(1,)", "model.pad_token_id=0", "model.first_k_dense_replace=1",
         "model.num_hidden_layers=3", "data.batch_size=4", "data.seq_len=128"] + MESH
# production widths; 2 layers (1 dense + 1 MoE) + MTP, 8 experts, short sequences
REDUCED = ["model.first_k_dense_replace=1", "model.num_hidden_layers=2", "model.n_routed_experts=8",
           "model.index_topk=64", "data.batch_size=4", "data.seq_len=128"] + MESH


def compile_only(tmp_path, overrides):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    args = [sys.executable, os.path.join(ROOT, "train.py"), f"--config={os.path.join(ROOT, 'configs', 'glm5_744b.py')}",
            "--compile_only", "--topology=v5p:2x2x1", f"--workdir={tmp_path}"] + [f"--set={s}" for s in overrides]
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.load(open(tmp_path / "compile_report.json"))
    assert report["topology"] == "v5p:2x2x1" and report["num_devices"] == 4
    assert report["mesh"] == {"data": 1, "fsdp": 2, "expert": 2, "tensor": 1}
    assert report["moe_ep"] == "a2a" and report["remat_policy"] == "full"
    assert report["hbm_bytes_per_device"] == 95 * 10**9
    return report


def state_param_count(overrides):
    """Parameters of the model the overrides describe (main stack + MTP), counted here from the config."""
    from glm5_jax.experiment import apply_overrides, load_config_file
    from glm5_jax.param_count import count_params

    cfg = apply_overrides(load_config_file(os.path.join(ROOT, "configs", "glm5_744b.py")), overrides).model
    counts = count_params(cfg)
    return counts["total"] + counts["mtp"]


def check_memory_and_flops(report, n_params):
    mem = report["per_device_bytes"]
    # fp32 params + 2 Adam moments: each of the 4 chips holds at least a quarter, at most all of them
    state = 3 * 4 * n_params
    assert state / 4 < mem["argument"] < 1.05 * state
    assert mem["alias"] > 0.9 * mem["argument"]          # the state is donated: outputs reuse it
    assert mem["temp"] > 0
    assert mem["total"] == mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] + mem["generated_code"]
    assert report["fits"] == (mem["total"] <= 95 * 10**9)
    assert report["flops_source"] == "hlo_matmuls_x_loop_trip_counts"
    assert None not in report["hlo_loop_trip_counts"]   # every loop's trip count was read
    # executed matmul FLOPs over all chips vs the analytic model FLOPs (glm5_jax/flops.py): at least the
    # model (x 4/3 for the full-remat recompute of the layers), at most ~4x (MTP layer + head, capacity
    # padding of the expert buffers, recompute)
    assert 1.3 < report["flops_per_model_flop"] < 4.0, report["flops_per_model_flop"]
    assert math.isclose(report["flops_per_model_flop"],
                        report["flops"] * 4 / report["model_flops_per_step"], rel_tol=1e-9)
    assert report["bytes_accessed"] > mem["argument"]    # the step reads the whole state at least once
    peak, bw = report["peak_flops_per_device"], report["hbm_bytes_per_second"]
    assert report["estimated_step_seconds"] == max(report["flops"] / peak, report["bytes_accessed"] / bw)
    assert math.isclose(report["mfu"], report["model_flops_per_step"] / (4 * peak * report["estimated_step_seconds"]))
    assert 0 < report["mfu"] < 1
    assert report["compiler_flops"] > 0


def test_compile_only_small_glm5_on_v5p(tmp_path):
    report = compile_only(tmp_path, SMALL)
    assert report["num_hidden_layers"] == 3
    check_memory_and_flops(report, state_param_count(SMALL))


@pytest.mark.slow   # 5-8 minutes on one core: run with `pytest -m slow`
def test_compile_only_reduced_glm5_on_v5p(tmp_path):
    report = compile_only(tmp_path, REDUCED)
    assert report["num_hidden_layers"] == 2
    n_params = state_param_count(REDUCED)
    # the vocab tables alone: 2 x 154880 x 6144 fp32 params + 2 moments, sharded 4 ways at best
    assert n_params > 2 * 154880 * 6144
    check_memory_and_flops(report, n_params)
    # at production widths the matmuls are nearly all the work: loops here only ever run <= 2 trips, so
    # the loop-aware matmul count cannot be below ~what XLA counts with bodies once
    assert report["flops"] > 0.8 * report["compiler_flops"]
