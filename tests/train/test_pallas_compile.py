"""The whole GLM-5 train step compiled for TPU (v5p:2x2x1, libtpu AOT from this CPU host) with the Pallas
DSA kernels: reduced widths, 1 dense + 2 MoE layers + MTP, a2a expert parallelism, full remat, an
fsdp 2 x expert 2 mesh. The compiled HLO holds the Mosaic kernels of the lightning indexer and of the
sparse attention's forward and backward, inside the scanned layers."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.train.test_compile_report import SMALL
from tests.train.test_train_cli import ROOT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not importable (pip install -r requirements-tpu.txt)")

# Compiles the step like `train.py --compile_only` and reports, per Mosaic kernel in the optimized HLO,
# how many custom calls name it, plus what the report needs.
SCRIPT = r"""
import collections, json, re, sys
from glm5_jax.train.compile_report import abstract_batch, topology_devices
from glm5_jax.train.experiment import apply_overrides, load_config_file
from glm5_jax.parallel.mesh import build_mesh
from glm5_jax.train.step import Trainer

cfg = apply_overrides(load_config_file(sys.argv[1]), sys.argv[2:])
trainer = Trainer(cfg, build_mesh(cfg.mesh, devices=topology_devices("v5p:2x2x1")))
with trainer.context():
    compiled = trainer._step.lower(trainer.abstract_state, abstract_batch(trainer, cfg.data.batch_size,
                                                                          cfg.data.seq_len)).compile()
hlo = compiled.as_text()
calls = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
names = collections.Counter()
for line in calls:
    for kernel in ("lightning_indexer_scores", "sparse_mla_fwd", "sparse_mla_bwd"):
        if kernel in line:
            names[kernel] += 1
mem = compiled.memory_analysis()
print("REPORT" + json.dumps({"tpu_custom_calls": len(calls), "kernels": names,
                             "temp_bytes": int(mem.temp_size_in_bytes)}))
"""


def test_train_step_with_pallas_kernels_compiles_for_v5p():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    overrides = SMALL + ["model.attention_impl=pallas", "model.moe_ep=a2a", "model.remat_policy=full"]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, os.path.join(ROOT, "configs", "glm5_744b.py"), *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(proc.stdout.split("REPORT")[-1])
    kernels = report["kernels"]
    # indexer scores and sparse forward run in every full layer's forward (+ its remat recompute); the
    # backward kernel in the backward pass: each appears in the scanned layer bodies and the MTP layer
    assert kernels.get("lightning_indexer_scores", 0) >= 2, report
    assert kernels.get("sparse_mla_fwd", 0) >= 2, report
    assert kernels.get("sparse_mla_bwd", 0) >= 2, report
    assert report["temp_bytes"] > 0
