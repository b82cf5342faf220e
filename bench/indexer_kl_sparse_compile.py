"""Compile the sparse-stage indexer KL (loss and gradients of the indexer's q, k, w) for a TPU topology from
this host, once in XLA (pallas_kernels/indexer_kl/reference.py) and once on the Pallas kernels
(sparse_kernel.py), and print each program's per-chip HBM bytes, FLOPs and roofline time from the cost model
(glm5_jax.cost.hlo_cost; a kernel is charged its declared pl.CostEstimate).

    python bench/indexer_kl_sparse_compile.py --topology v5p:2x2x1 --seq 4096 --topk 2048
    python bench/indexer_kl_sparse_compile.py --seq 3168 --keys 202752    # a 200K context shard

One sequence per chip (batch split over the slice's chips), indexer q [T, 32, 128] and k [S, 128] in
``--dtype`` (default fp32, as the model's Indexer returns them), fp32 w [T, 32], the selection idx / valid
[T, k] and the target p [T, k] fp32 as inputs. ``pallas_row_dma``: the kernels with the keys left in HBM
(one row DMA per slot, what they do past 16K keys). ``--keys S`` (default T): a context shard's T queries
over the S keys of the whole sequence (past 32K the backward's row gradients go through HBM to the row
scatter-add kernel, pallas_kernels/row_scatter).
Needs libtpu.
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

from glm5_jax.cost.chips import chip_of_topology  # noqa: E402
from glm5_jax.cost.hlo_cost import StepTiming, hlo_cost  # noqa: E402
from pallas_kernels.indexer_kl import ops, sparse_pallas  # noqa: E402

HI, DI = 32, 128
ROW_DMA = "pallas_row_dma"


def compile_kl(mesh, T, K, impl, dtype=jnp.float32, S=None):
    n = mesh.devices.size

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct((n, *shape), dtype, sharding=NamedSharding(mesh, P("b")))

    def per_token(*a):
        if impl == ROW_DMA:     # the kernels with ik left in HBM (one row DMA per slot), as for long key sets
            return sparse_pallas.sparse_kl_per_token(*a, resident=False)
        return ops.sparse_kl_per_token(*a, impl=impl)

    def loss_and_grads(iq, ik, iw, idx, valid, p):
        def loss(iq, ik, iw):
            return ops.mean_over_tokens(*per_token(iq, ik, iw, idx, valid, p))
        value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(iq, ik, iw)
        return (value[None],) + grads

    operands = (spec((T, HI, DI), dtype), spec((S or T, DI), dtype), spec((T, HI), jnp.float32),
                spec((T, K), jnp.int32), spec((T, K), jnp.bool_), spec((T, K), jnp.float32))
    fn = jax.shard_map(loss_and_grads, mesh=mesh, in_specs=(P("b"),) * 6, out_specs=(P("b"),) * 4,
                       check_vma=False)
    return jax.jit(fn).lower(*operands).compile()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topology", default="v5p:2x2x1")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--keys", type=int, default=None, help="keys per sequence (default: --seq)")
    parser.add_argument("--impls", default=f"xla,pallas,{ROW_DMA}")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="of the indexer q and k (the model's Indexer returns fp32)")
    args = parser.parse_args()
    devices = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices
    mesh = Mesh(np.array(devices).reshape(-1), ("b",))
    chip = chip_of_topology(args.topology)
    timing = StepTiming(chip.achievable_flops, chip.achievable_hbm_bandwidth, lambda op: 0.0)
    print(f"{args.topology}, per chip: {args.seq} queries x {args.topk} selected of {args.keys or args.seq} "
          f"keys, indexer {HI} x {DI} "
          f"{args.dtype}, loss + gradients")
    for impl in args.impls.split(","):
        compiled = compile_kl(mesh, args.seq, args.topk, impl, jnp.dtype(args.dtype), args.keys)
        mem = compiled.memory_analysis()
        cost = hlo_cost(compiled.as_text(), timing=timing)
        flops = cost.flops + cost.kernel_flops
        print(f"  {impl:14s}: HBM {cost.bytes_accessed / 1e9:8.3f} GB, FLOPs {flops / 1e9:8.1f} G "
              f"(kernels {cost.kernel_flops / 1e9:.1f} G), roofline {cost.roofline_seconds * 1e3:7.2f} ms, "
              f"temp {mem.temp_size_in_bytes / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
