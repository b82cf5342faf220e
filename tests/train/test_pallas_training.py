"""Training through the Pallas DSA kernels (Pallas interpreter on CPU) equals training on the XLA path.

Five optimizer steps of the sparse stage, on one device and on a (data, fsdp, expert, tensor) = (1, 2, 2, 1)
mesh, where the kernels run per shard inside shard_map and the init batch of 1 does not divide the
batch axes. The sequence is three times index_topk, so the top-k selection drops keys. Only the sparse
stage runs the kernels: the dense and warm-up stages attend densely (XLA under every attention_impl, see
train_step.model_config_for_stage) and select no keys, so their programs are the XLA path's.
"""
import dataclasses

import jax
import numpy as np
import pytest

from glm5_jax.parallel.mesh import MeshConfig, build_mesh
from glm5_jax.train.step import Trainer
from tests.train.test_train_step import batch, experiment

STEPS = 5
MESHES = {"one_device": (MeshConfig(data=1, fsdp=1), 1),
          "fsdp2_expert2": (MeshConfig(data=1, fsdp=2, expert=2, tensor=1), 4)}


def train(stage, impl, mesh_name):
    mesh_cfg, n_devices = MESHES[mesh_name]
    exp = experiment(stage=stage, mesh=mesh_cfg, eps=1e-4)
    exp = dataclasses.replace(exp, model=exp.model.replace(attention_impl=impl, remat_policy="full"))
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
    xla_losses, xla_params = train(stage, "xla", mesh_name)
    pallas_losses, pallas_params = train(stage, "pallas_interpret", mesh_name)
    assert np.all(np.isfinite(xla_losses)) and xla_losses[-1] != xla_losses[0]
    np.testing.assert_allclose(pallas_losses, xla_losses, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(pallas_params), jax.tree.leaves(xla_params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
