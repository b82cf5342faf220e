"""The whole GLM-5 train step compiled for TPU (v5p:2x2x1, libtpu AOT from this CPU host) with the Pallas
DSA kernels: reduced widths, 1 dense + 2 MoE layers + MTP, a2a expert parallelism, full remat, an
fsdp 2 x expert 2 mesh, in both forms of the sparse core: the gather kernels (``masked_flash_factor=0``, the
long-context form) and, at this length (128 tokens, k = 64), the default flash kernel over the selection mask
with the indexer KL on the warm-up kernels. The compiled HLO holds the Mosaic kernels of the lightning
indexer and of the form's attention forward and backward, inside the scanned layers."""
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
from glm5_jax.cost.chips import topology_devices
from glm5_jax.train.compile_report import abstract_batch
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
    for kernel in ("lightning_indexer_scores", "sparse_mla_fwd", "sparse_mla_bwd", "flash_attention_fwd_masked",
                   "flash_attention_bwd", "indexer_kl_warmup_grads"):
        if kernel in line:
            names[kernel] += 1
mem = compiled.memory_analysis()
print("REPORT" + json.dumps({"tpu_custom_calls": len(calls), "kernels": names,
                             "temp_bytes": int(mem.temp_size_in_bytes)}))
"""


FORM_KERNELS = {"gather": ("sparse_mla_fwd", "sparse_mla_bwd"),
                "masked_flash": ("flash_attention_fwd_masked", "flash_attention_bwd", "indexer_kl_warmup_grads")}


@pytest.mark.parametrize("form", list(FORM_KERNELS))
def test_train_step_with_pallas_kernels_compiles_for_v5p(form):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    overrides = SMALL + ["model.attention_impl=pallas", "model.moe_ep=a2a", "model.remat_policy=full",
                         f"model.masked_flash_factor={0.0 if form == 'gather' else 4.0}"]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, os.path.join(ROOT, "configs", "glm5_744b.py"), *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(proc.stdout.split("REPORT")[-1])
    kernels = report["kernels"]
    # indexer scores and the attention forward run in every full layer's forward (+ its remat recompute);
    # the backward kernels in the backward pass: each appears in the scanned layer bodies and the MTP layer
    assert kernels.get("lightning_indexer_scores", 0) >= 2, report
    for kernel in FORM_KERNELS[form]:
        assert kernels.get(kernel, 0) >= 2, (kernel, report)
    other = FORM_KERNELS["masked_flash" if form == "gather" else "gather"]
    assert not any(kernels.get(kernel) for kernel in other), report
    assert report["temp_bytes"] > 0
