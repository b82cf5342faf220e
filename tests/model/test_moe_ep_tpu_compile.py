"""The ragged_all_to_all expert-parallel transport, which XLA:CPU cannot run, compiled for TPU ahead of time
from this CPU host (libtpu; docs/training.md#compiling-for-tpu-from-a-cpu-host): the MoE layer forward and backward on
v5p:2x2x1 with expert = 4.

GLM-5 expert widths (D = 6144, F = 2048, top-8 of 16 experts here: 4 per chip), 4 x 256 tokens. Checks that
libtpu compiles it, that the program really exchanges rows with ragged all-to-alls in both directions,
and that XLA's per-chip memory is what the shapes imply.
"""
import importlib.util

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax.core import meta

from glm5_jax.model.config import ModelConfig, RuntimeConfig
from glm5_jax.model.moe.expert_parallel import capacity
from glm5_jax.model.moe.layer import MoE
from glm5_jax.parallel.mesh import DEFAULT_RULES, MeshConfig, build_mesh, logical_shardings

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not importable (pip install -r requirements-tpu.txt)")

D, F, E, K, B, T = 6144, 2048, 16, 8, 4, 256
N = B * T
CFG = ModelConfig(vocab_size=128, hidden_size=D, num_hidden_layers=2, first_k_dense_replace=1, intermediate_size=64,
                  num_attention_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8,
                  v_head_dim=8, index_n_heads=2, index_head_dim=8, index_topk=4, n_routed_experts=E,
                  num_experts_per_tok=K, n_shared_experts=0, moe_intermediate_size=F,
                  runtime=RuntimeConfig(dtype="bfloat16", param_dtype="float32", moe_ep="ragged_a2a",
                                        moe_capacity_factor=1.25, remat_policy="none"))


@pytest.mark.slow   # ~85 s of libtpu compile on one core (forward + backward, Mosaic ragged-dot kernels)
def test_ragged_all_to_all_moe_compiles_for_v5p():
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices
    mesh = build_mesh(MeshConfig(data=1, fsdp=1, expert=4, tensor=1), devices=devices)
    x = jnp.zeros((B, T, D), jnp.float32)
    mask = jnp.ones((B, T), bool)
    boxed = jax.eval_shape(lambda: MoE(CFG).init(jax.random.PRNGKey(0), x, mask))
    shardings = meta.unbox(logical_shardings(boxed, mesh, DEFAULT_RULES))
    variables = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             meta.unbox(boxed), shardings)
    tokens = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert", None, None))
    x_spec = jax.ShapeDtypeStruct((B, T, D), jnp.float32, sharding=tokens)
    # tests/conftest.py sets "highest" matmul precision for CPU numerics; with it libtpu's ragged-dot kernel
    # is asked for an fp32-precision contraction of bf16 operands, which Mosaic rejects ("Bad lhs type").
    # train.py runs with the default precision, as here.
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES), jax.default_matmul_precision("default"):

        def loss(params, others, x):
            out, aux = MoE(CFG).apply({**others, "params": params}, x, mask)
            return jnp.sum(out.astype(jnp.float32) ** 2), aux["dropped"]

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 2), has_aux=True))
        others = {k: v for k, v in variables.items() if k != "params"}
        compiled = step.lower(variables["params"], others, x_spec).compile()
    hlo = compiled.as_text()
    # forward (tokens out, results back) and backward (the same two, transposed): >= 4 ragged exchanges
    assert hlo.count("ragged-all-to-all(") >= 4, hlo.count("ragged-all-to-all(")
    mem = compiled.memory_analysis()
    expert_bytes = 3 * E * D * F * 4 // 4          # fp32 routed-expert weights, a quarter per chip
    assert expert_bytes < mem.argument_size_in_bytes < 1.1 * expert_bytes + N * D * 4
    assert mem.output_size_in_bytes >= expert_bytes          # their gradients
    # transport buffers: R = 4 * (E/4) * cap rows of D per chip at least, in bf16
    rows = 4 * (E // 4) * capacity(N // 4, K, E, CFG.moe_capacity_factor)
    assert rows * D * 2 < mem.temp_size_in_bytes < 95 * 10**9
