"""The grouped matmul: the megablox kernel path (Pallas interpreter) equals `jax.lax.ragged_dot` forward and in
both gradients; empty experts get exactly zero weight gradient; a real Mosaic compile at GLM-5's expert widths
has the kernels and no dense weight-gradient product; training steps with it equal the ragged_dot ones."""
import dataclasses
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import kernel, ops, reference


def _operands(group_sizes, K, N, dtype, M=None, seed=0):
    group_sizes = jnp.asarray(group_sizes, jnp.int32)
    M = int(group_sizes.sum()) if M is None else M
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    lhs = jax.random.normal(k[0], (M, K)).astype(dtype)
    rhs = (0.3 * jax.random.normal(k[1], (group_sizes.shape[0], K, N))).astype(dtype)
    dy = jax.random.normal(k[2], (M, N), jnp.float32)
    return lhs, rhs, group_sizes, dy


def _value_and_grads(impl, lhs, rhs, group_sizes, dy):
    def loss(a, b):
        return jnp.sum(ops.grouped_matmul(a, b, group_sizes, impl=impl) * dy)

    return ops.grouped_matmul(lhs, rhs, group_sizes, impl=impl), *jax.grad(loss, (0, 1))(lhs, rhs)


CASES = {
    "empty_experts_and_rows_past_the_groups": ([9, 0, 17, 0, 11, 0], 45),   # 8 rows belong to no expert
    "all_rows_on_one_expert": ([0, 0, 40, 0], None),
    "every_expert_used": ([5, 12, 3, 20], None),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gmm_interpret_equals_ragged_dot(case, dtype):
    sizes, M = CASES[case]
    lhs, rhs, gs, dy = _operands(sizes, 24, 20, dtype, M)
    ref = _value_and_grads("ragged_dot", lhs, rhs, gs, dy)
    got = _value_and_grads("gmm_interpret", lhs, rhs, gs, dy)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
    y, d_lhs, d_rhs = got
    if dtype == jnp.float32:
        for a, b in zip(got, ref):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    else:   # the kernel backward takes the cotangent in bf16, ragged_dot's in fp32
        np.testing.assert_allclose(y, ref[0], rtol=1e-5, atol=1e-5)    # same bf16 products, fp32 sums
        for a, b in zip(got[1:], ref[1:]):
            b = np.asarray(b, np.float32)
            np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=0, atol=0.02 * np.abs(b).max())
    empty = np.asarray(gs) == 0
    assert np.all(np.asarray(d_rhs[empty]) == 0)                # no rows: exactly zero weight gradient
    assert np.all(np.asarray(d_rhs[~empty]) != 0)
    past = int(gs.sum())
    assert np.all(np.asarray(y[past:]) == 0) and np.all(np.asarray(d_lhs[past:]) == 0)


@pytest.mark.parametrize("impl", ["ragged_dot", "gmm_interpret"])
def test_transposed_rhs_equals_the_product_with_the_swapped_weights(impl):
    """rhs stored [E, N, K] with transpose_rhs: the product and d lhs equal the [E, K, N] call's, and d rhs is
    the [E, K, N] call's gradient transposed (the kernel computes it as dy^T lhs per group)."""
    sizes, M = CASES["empty_experts_and_rows_past_the_groups"]
    lhs, rhs, gs, dy = _operands(sizes, 24, 20, jnp.float32, M)
    y_ref, d_lhs_ref, d_rhs_ref = _value_and_grads("ragged_dot", lhs, rhs, gs, dy)
    rhs_t = jnp.swapaxes(rhs, 1, 2)

    def loss(a, b):
        return jnp.sum(ops.grouped_matmul(a, b, gs, impl=impl, transpose_rhs=True) * dy)

    y = ops.grouped_matmul(lhs, rhs_t, gs, impl=impl, transpose_rhs=True)
    d_lhs, d_rhs_t = jax.grad(loss, (0, 1))(lhs, rhs_t)
    assert d_rhs_t.shape == rhs_t.shape
    for a, b in ((y, y_ref), (d_lhs, d_lhs_ref), (d_rhs_t, jnp.swapaxes(d_rhs_ref, 1, 2))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"rhs \[E, N, K\] expected"):
        ops.grouped_matmul(lhs, rhs, gs, impl=impl, transpose_rhs=True)


def test_auto_on_cpu_is_ragged_dot():
    sizes, M = CASES["empty_experts_and_rows_past_the_groups"]
    lhs, rhs, gs, dy = _operands(sizes, 24, 20, jnp.float32, M)
    for a, b in zip(_value_and_grads("auto", lhs, rhs, gs, dy), _value_and_grads("ragged_dot", lhs, rhs, gs, dy)):
        np.testing.assert_array_equal(a, b)


def test_small_tiles_groups_straddling_row_tiles():
    """16-row tiles over 100 rows: groups start and end inside tiles, one empty group between them."""
    lhs, rhs, gs, dy = _operands([7, 30, 0, 1, 45], 256, 256, jnp.float32, M=100)
    tiles = (16, 128, 128)
    y = kernel.gmm(lhs, rhs, gs, interpret=True, tiling=tiles)
    y_ref, vjp = jax.vjp(lambda a, b: reference.grouped_matmul(a, b, gs), lhs, rhs)
    d_lhs_ref, d_rhs_ref = vjp(dy)
    d_lhs = kernel.gmm(dy, rhs, gs, transpose_rhs=True, interpret=True, tiling=tiles)
    d_rhs = kernel.tgmm(lhs, dy, gs, out_dtype=jnp.float32, interpret=True, tiling=tiles)
    for a, b in ((y, y_ref), (d_lhs, d_lhs_ref), (d_rhs, d_rhs_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(d_rhs[2]) == 0)


def test_bad_operands_are_named():
    lhs, rhs, gs, _ = _operands([3, 4], 8, 8, jnp.float32)
    with pytest.raises(ValueError, match="unknown impl"):
        ops.grouped_matmul(lhs, rhs, gs, impl="cuda")
    with pytest.raises(ValueError, match="one entry per rhs group"):
        ops.grouped_matmul(lhs, rhs, gs[:1], impl="gmm_interpret")
    with pytest.raises(ValueError, match="no multiple-of-128 tile"):
        kernel.gmm(jnp.zeros((8, 1000)), jnp.zeros((2, 1000, 8)), gs, tiling=(8, 512, 128), interpret=True)


# ------------------------------------------------------------------ Mosaic compile at GLM-5 widths
D, F, E_LOCAL, ROWS = 6144, 2048, 32, 40960     # GLM-5 per chip: 256 experts over 8, 4096 tokens x 8 x 1.25


def _weight_grad_products(hlo: str) -> list[str]:
    """dot / convolution instructions whose result has an expert weight's shape [E_LOCAL, D, F] or [E_LOCAL, F, D]
    (ragged_dot's weight gradient on TPU: a dense batched product masked per expert over all rows)."""
    pattern = re.compile(rf"= \w+\[{E_LOCAL},({D},{F}|{F},{D})\]\S* (convolution|dot)\(")
    return [line for line in hlo.splitlines() if pattern.search(line)]


def _kernel_result_shapes(hlo: str) -> list[str]:
    """Result shapes of the Mosaic custom calls."""
    return re.findall(r"= (\w+\[[\d,]*\])\S* custom-call\(.*custom_call_target=\"tpu_custom_call\"", hlo)


needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not importable (pip install -r requirements-tpu.txt)")


def _compiled_swiglu_gradients(impl, gate_up_transposed=False) -> str:
    """Optimized HLO of the routed experts' SwiGLU gradients (x and the three weights) at GLM-5 per-chip
    shapes, compiled for v5p:2x2x1 with one shard of rows and experts per chip; gate / up weights [E, D, F],
    or [E, F, D] with ``gate_up_transposed`` (the expert-parallel layout)."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from glm5_jax.model.moe.experts import swiglu_rows

    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices
    mesh = Mesh(np.array(devices).reshape(-1), ("expert",))
    n = len(devices)

    def local(x, group_sizes, wg, wu, wd, dy):
        def loss(x, wg, wu, wd):
            return jnp.sum(swiglu_rows(x, group_sizes[0], wg, wu, wd, jnp.bfloat16, impl,
                                       gate_up_transposed=gate_up_transposed) * dy)

        return jax.grad(loss, argnums=(0, 1, 2, 3))(x, wg, wu, wd)

    spec = P("expert")
    shaped = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))  # noqa: E731
    gate_up = (n * E_LOCAL, F, D) if gate_up_transposed else (n * E_LOCAL, D, F)
    args = (shaped((n * ROWS, D), jnp.bfloat16), shaped((n, E_LOCAL), jnp.int32),
            shaped(gate_up, jnp.bfloat16), shaped(gate_up, jnp.bfloat16),
            shaped((n * E_LOCAL, F, D), jnp.bfloat16), shaped((n * ROWS, D), jnp.float32))
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 6, out_specs=(spec,) * 4, check_vma=False))
    # tests/conftest.py asks for "highest" matmul precision (CPU numerics); Mosaic rejects an fp32-precision
    # contraction of bf16 operands, and training runs with the default precision.
    with jax.default_matmul_precision("default"):
        return step.lower(*args).compile().as_text()


@needs_libtpu
# "auto" lowered for TPU is the kernel, no conditional; the expert-parallel layout (gate / up as [E, F, D])
@pytest.mark.parametrize("impl,gate_up_transposed", [("gmm", False), ("auto", True)], ids=["gmm", "auto_EFD"])
def test_gmm_swiglu_forward_and_backward_compile_for_v5p(impl, gate_up_transposed):
    hlo = _compiled_swiglu_gradients(impl, gate_up_transposed)
    # forward gmm for gate and up (the down projection's output is not needed for these gradients; they
    # come out in the compute dtype), 3 gmm for the input gradients, 3 tgmm for the weight gradients (each
    # in its weight's layout)
    assert hlo.count('custom_call_target="tpu_custom_call"') == 8
    gate_up = f"bf16[{E_LOCAL},{F},{D}]" if gate_up_transposed else f"bf16[{E_LOCAL},{D},{F}]"
    assert sorted(_kernel_result_shapes(hlo)) == sorted(
        [gate_up] * 2 + [f"bf16[{E_LOCAL},{F},{D}]"] + [f"bf16[{ROWS},{F}]"] * 2
        + [f"bf16[{ROWS},{D}]"] * 2 + [f"bf16[{ROWS},{F}]"])
    assert _weight_grad_products(hlo) == []
    assert " ragged-dot(" not in hlo and " conditional(" not in hlo


@needs_libtpu
def test_ragged_dot_weight_gradient_is_a_dense_masked_product_on_tpu():
    """What the kernel replaces (and a check that `_weight_grad_products` finds it): XLA's TPU lowering of
    ragged_dot's weight gradient multiplies every local expert's weights by all rows, masked."""
    hlo = _compiled_swiglu_gradients("ragged_dot")
    assert len(_weight_grad_products(hlo)) == 3
    assert re.search(rf"\[{E_LOCAL},{ROWS},{D}\]", hlo)        # the rows broadcast to every expert
    assert not any(s.startswith(f"bf16[{E_LOCAL},") for s in _kernel_result_shapes(hlo))


# ------------------------------------------------------------------ training steps
def _train(moe_impl, moe_ep="none", mesh=None, steps=5):
    from glm5_jax.parallel.mesh import MeshConfig, build_mesh
    from glm5_jax.train.step import Trainer
    from tests.train.test_train_step import MODEL, batch, experiment

    mesh = mesh or MeshConfig(data=1, fsdp=1)
    exp_cfg = experiment(eps=1e-4, mesh=mesh)
    # one MoE layer and no MTP module: enough here, and the interpreted kernels compile slowly
    model = MODEL.replace(moe_impl=moe_impl, moe_ep=moe_ep, moe_capacity_factor=1.0, num_hidden_layers=1,
                          first_k_dense_replace=0, num_nextn_predict_layers=0, mtp_depth=0)
    exp_cfg = dataclasses.replace(exp_cfg, model=model)
    n_dev = mesh.data * mesh.fsdp * mesh.expert * mesh.tensor
    trainer = Trainer(exp_cfg, build_mesh(exp_cfg.mesh, jax.devices()[:n_dev]))
    state, losses = trainer.init_state(0), []
    for step in range(steps):
        state, metrics = trainer.step(state, trainer.put_batch(batch(seed=step)))
        losses.append(float(jax.device_get(metrics["loss"])))
    return np.array(losses), jax.device_get(state.params)


def _assert_same_training(got, ref):
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    assert len(set(np.round(ref[0], 6))) == len(ref[0])            # the loss really changed each step
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree_util.tree_leaves(ref[1])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=jax.tree_util.keystr(path))


def test_five_training_steps_with_gmm_interpret_equal_ragged_dot():
    _assert_same_training(_train("gmm_interpret"), _train("ragged_dot"))


def test_five_expert_parallel_steps_with_gmm_interpret_equal_ragged_dot():
    """a2a transport over expert=2 (capacity-padded buffers, packed before the grouped matmul)."""
    from glm5_jax.parallel.mesh import MeshConfig

    mesh = MeshConfig(data=1, fsdp=1, expert=2, tensor=1)
    _assert_same_training(_train("gmm_interpret", "a2a", mesh), _train("ragged_dot", "a2a", mesh))
