"""GLM-5 (744B) pretraining: the dense stage (dense MLA attention, no indexer) at 4K on 2048 v5p chips.

The model, batch (1024 x 4096), remat policy and bf16 gradient reduce-scatters are configs/glm5_744b.py's; the mesh
is the dense-stage sweep's best (`python bench/mesh_sweep.py --config=configs/glm5_744b.py --topology=v5p:8x16x16/dense
--out=bench/results/mesh_sweep_dense.json`, bench/results/mesh_sweep_dense.md): fsdp 32 x context 2 x expert 32.
With 32 experts' worth of chips per expert group each chip holds 8 routed experts instead of 32, so the
experts' weight gathers, gradient reduce-scatters and weight re-reads shrink 4x for a wider all-to-all. AOT check:

    python train.py --config=configs/glm5_744b_pretrain.py --compile_only --topology=v5p:8x16x16 --workdir=DIR \
        --set=model.attention_impl=pallas
"""
import dataclasses

from configs import glm5_744b
from glm5_jax.parallel.mesh import MeshConfig
from glm5_jax.train.experiment import ExperimentConfig


def get_config() -> ExperimentConfig:
    cfg = glm5_744b.get_config()
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, stage="dense"),
                               mesh=MeshConfig(data=1, fsdp=32, context=2, expert=32, tensor=1))
