"""Real Mosaic/XLA TPU compiles of the KDA kernels, ahead of time from a CPU host (background:
docs/training.md#compiling-for-tpu-from-a-cpu-host).

Needs libtpu (requirements-tpu.txt); skipped without it. Shapes are GLM-5.3-Flash's linear-attention layer
per chip: 16 heads (64 under tensor = 4) of K = V = 128, one 4096-token sequence of packed documents per
chip (the batch split over a v5p:2x2x1 slice's 4 chips), bf16 q, k, v, fp32 gates, 64- and 128-token chunks.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("libtpu", reason="libtpu not installed (pip install -r requirements-tpu.txt)")

from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from pallas_kernels.kda import ops  # noqa: E402

T, H, K, V = 4096, 16, 128, 128
V5P_HBM_BYTES = 95 * 2**30
ROWS = P("b")


@pytest.fixture(scope="module")
def mesh():
    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1")
    return Mesh(np.array(topology.devices).reshape(-1), ("b",))


def compile_per_chip(mesh, fn, n_out):
    n = len(mesh.devices)
    # the heads' channels flat, [T, H * K], as the KDA layer passes them (ops.chunk_kda_flat)
    shapes = [((n, T, H * K), jnp.bfloat16), ((n, T, H * K), jnp.bfloat16), ((n, T, H * V), jnp.bfloat16),
              ((n, T, H * K), jnp.float32), ((n, T, H), jnp.float32), ((n, H, K, V), jnp.float32),
              ((n, T), jnp.int32)]
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, ROWS)) for s, d in shapes]
    sharded = jax.shard_map(fn, mesh=mesh, in_specs=(ROWS,) * len(args), out_specs=(ROWS,) * n_out,
                            check_vma=False)
    compiled = jax.jit(sharded).lower(*args).compile()
    mem = compiled.memory_analysis()
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
    print(f"\n{fn.__name__}: argument {mem.argument_size_in_bytes / 2**20:.1f} MiB, output "
          f"{mem.output_size_in_bytes / 2**20:.1f} MiB, temp {mem.temp_size_in_bytes / 2**20:.1f} MiB per chip")
    assert 0 < total < V5P_HBM_BYTES
    return compiled.as_text()


def kda(q, k, v, g, beta, init, seg, chunk=64):
    return ops.chunk_kda_flat(q, k, v, g, beta, initial_state_BHKV=init, segment_ids_BT=seg, impl="pallas",
                              chunk_size=chunk)


def test_kda_forward_compiles(mesh):
    text = compile_per_chip(mesh, kda, 2)
    assert "kda_fwd" in text and "kda_bwd" not in text


@pytest.mark.parametrize("chunk", [64, 128])   # 128: configs/glm53_flash.py's kda_chunk
def test_kda_backward_compiles(mesh, chunk):
    def kda_grads(q, k, v, g, beta, init, seg):
        (o, S), vjp = jax.vjp(lambda *x: kda(*x, seg, chunk=chunk), q, k, v, g, beta, init)
        return vjp((o, S))   # cotangents of o and of the final state

    text = compile_per_chip(mesh, kda_grads, 6)
    assert "kda_fwd" in text and "kda_bwd" in text
