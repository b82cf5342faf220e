"""Training through the Pallas DSA kernels (Pallas interpreter on CPU) equals training on the XLA path.

Two optimizer steps of the sparse stage in both forms of its attention core on TPU impls: on one device
the per-query row gathers (sparse_mla kernels + the sparse KL kernels, ``masked_flash_factor=0``), and on
a (data, fsdp, expert, tensor) = (1, 2, 2, 1) mesh the flash kernel over the selection mask + the warm-up
KL kernels over it (the default at this length), where the kernels run per shard inside shard_map and the
init batch of 1 does not divide the batch axes. The sequence is three times index_topk, so the top-k
selection drops keys. (Dense and warm-up stages through the flash kernel: test_flash_attention.py and
test_context_parallel.py.)
"""
import dataclasses

import jax
import numpy as np
import pytest

from glm5_jax.model.attention import masked_flash_core
from glm5_jax.parallel.mesh import MeshConfig, build_mesh
from glm5_jax.train.step import Trainer
from tests.train.test_train_step import MODEL, T, batch, experiment

STEPS = 2                # the second step's loss and the params after two updates see the first update
# name: (mesh, devices, masked_flash_factor)
MESHES = {"one_device_gathered": (MeshConfig(data=1, fsdp=1), 1, 0.0),
          "fsdp2_expert2_masked": (MeshConfig(data=1, fsdp=2, expert=2, tensor=1), 4, 4.0)}


def train(stage, impl, mesh_name):
    mesh_cfg, n_devices, factor = MESHES[mesh_name]
    exp = experiment(stage=stage, mesh=mesh_cfg, eps=1e-4)
    exp = dataclasses.replace(exp, model=exp.model.replace(attention_impl=impl, remat_policy="full",
                                                           masked_flash_factor=factor))
    trainer = Trainer(exp, build_mesh(mesh_cfg, jax.devices()[:n_devices]))
    state = trainer.init_state(0)
    losses = []
    for i in range(STEPS):
        state, metrics = trainer.step(state, trainer.put_batch(batch(seed=i)))
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state.params)


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("stage", ["sparse"])
def test_pallas_training_equals_xla(stage, mesh_name):
    pallas_model = MODEL.replace(attention_impl="pallas_interpret", masked_flash_factor=MESHES[mesh_name][2])
    assert masked_flash_core(pallas_model, T, decoding=False) == mesh_name.endswith("masked")   # the form named
    xla_losses, xla_params = train(stage, "xla", mesh_name)
    pallas_losses, pallas_params = train(stage, "pallas_interpret", mesh_name)
    assert np.all(np.isfinite(xla_losses)) and xla_losses[-1] != xla_losses[0]
    np.testing.assert_allclose(pallas_losses, xla_losses, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(pallas_params), jax.tree.leaves(xla_params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
