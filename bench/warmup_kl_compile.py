"""Compile the warm-up stage's indexer KL (loss + gradients of the indexer's q, k, w) for a TPU topology from
this host, both ways -- the XLA path chunked over queries and the Pallas kernels -- and print the cost
model's per-chip FLOPs and HBM bytes of each (glm5_jax.cost.hlo_cost on the compiled HLO; a kernel is
charged its declared pl.CostEstimate) and the compiler's memory analysis.

    python bench/warmup_kl_compile.py --topology v5p:2x2x1 --seq 4096 [--heads 64]

One packed-free causal sequence per chip (batch split over the slice's chips): the attention's MHA query and
per-head keys (GLM-5: 192 + 64 = 256 per head) in bf16 with its fp32 log-sum-exp, the indexer's 32 heads x
128 q, its keys and weights in fp32, as the model hands them over. Needs libtpu (requirements-tpu.txt).
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from glm5_jax.cost.hlo_cost import hlo_cost  # noqa: E402
from pallas_kernels.indexer_kl import ops  # noqa: E402

D, HI, DI = 256, 32, 128


def compile_kl(mesh, impl, T, H):
    n = len(mesh.devices.reshape(-1))

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct((n, *shape), dtype, sharding=NamedSharding(mesh, P("b")))

    def step(q, k, lse, iq, ik, iw, pos, seg):
        def loss(iq, ik, iw):
            kl, count = ops.warmup_kl_sums(q, k, lse, iq, ik, iw, pos, pos, seg, seg, scale=192 ** -0.5, impl=impl)
            return jnp.sum(kl) / jnp.maximum(jnp.sum(count), 1.0)
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(iq, ik, iw)

    args = (spec((T, H, D), jnp.bfloat16), spec((T, H, D), jnp.bfloat16), spec((T, H), jnp.float32),
            spec((T, HI, DI), jnp.float32), spec((T, DI), jnp.float32), spec((T, HI), jnp.float32),
            spec((T,), jnp.int32), spec((T,), jnp.int32))
    out_specs = (P(), (P("b"), P("b"), P("b")))
    sharded = jax.shard_map(step, mesh=mesh, in_specs=(P("b"),) * 8, out_specs=out_specs, check_vma=False)
    return jax.jit(sharded).lower(*args).compile()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topology", default="v5p:2x2x1")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--impls", default="xla,pallas")
    args = parser.parse_args()
    devices = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices
    mesh = Mesh(np.array(devices).reshape(-1), ("b",))
    print(f"{args.topology}: per chip one sequence of T = S = {args.seq}, H = {args.heads} x {D} bf16, "
          f"indexer {HI} x {DI} fp32")
    for impl in args.impls.split(","):
        compiled = compile_kl(mesh, impl, args.seq, args.heads)
        cost = hlo_cost(compiled.as_text())
        mem = compiled.memory_analysis()
        print(f"{impl:>7}: FLOPs {cost.total_flops:.4g} (Mosaic kernels {cost.kernel_flops:.4g}), HBM bytes "
              f"{cost.bytes_accessed:.4g}, temp {mem.temp_size_in_bytes / 2**20:.0f} MiB per chip")


if __name__ == "__main__":
    main()
