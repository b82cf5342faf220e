"""AOT compile of the real train step for TPU from this CPU host (libtpu): a 2-layer GLM-5 at production
widths on v5p:2x2x1 through `train.py --compile_only`, checked for a sane compile_report.json."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.train.test_train_cli import ROOT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not importable (pip install -r requirements-tpu.txt)")

# production widths (hidden 6144, 64 heads, MLA/DSA dims, 154880 vocab, expert width 2048); 2 layers
# (1 dense + 1 MoE) + MTP, 8 experts, short sequences so the TPU compile stays within minutes on 2 cores
REDUCED = ["model.first_k_dense_replace=1", "model.num_hidden_layers=2", "model.n_routed_experts=8",
           "model.index_topk=64", "data.batch_size=4", "data.seq_len=128", "mesh.fsdp=2", "mesh.expert=2"]


@pytest.mark.slow   # minutes on 2 cores: run with `pytest -m slow` (kept out of CI's 20-minute budget)
def test_compile_only_reduced_glm5_on_v5p(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    args = [sys.executable, os.path.join(ROOT, "train.py"), f"--config={os.path.join(ROOT, 'configs', 'glm5_744b.py')}",
            "--compile_only", "--topology=v5p:2x2x1", f"--workdir={tmp_path}"] + [f"--set={s}" for s in REDUCED]
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.load(open(tmp_path / "compile_report.json"))
    assert report["topology"] == "v5p:2x2x1" and report["num_devices"] == 4
    assert report["mesh"] == {"data": 1, "fsdp": 2, "expert": 2, "tensor": 1}
    assert report["moe_ep"] == "a2a" and report["num_hidden_layers"] == 2
    mem = report["per_device_bytes"]
    # fp32 params + 2 Adam moments, sharded 4 ways: the vocab tables alone are 2 x 154880 x 6144 x 4 B x 3 / 4
    assert mem["argument"] > 2 * 154880 * 6144 * 4 * 3 / 4
    assert mem["temp"] > 0 and mem["total"] >= mem["argument"]
    assert report["hbm_bytes_per_device"] == 95 * 10**9 and report["fits"] == (mem["total"] <= 95 * 10**9)
    assert report["flops"] > 0 and report["estimated_step_seconds"] > 0
    # the step does at least the model's FLOPs (the compiler counts per device; 4 devices)
    assert report["flops"] * 4 > 0.5 * report["model_flops_per_step"]
    assert 0 < report["mfu"] < 1
