"""The sparse stage's attention core in its two TPU forms, compiled for a TPU topology from this host: the
gather kernels (pallas_kernels/sparse_mla: absorbed form, each query's k selected latent rows DMA-gathered,
row gradients scatter-added) and the flash kernel over the selection as a mask (pallas_kernels/
flash_attention: MHA form over every causal key the mask allows). Forward + backward of one context shard
per chip; prints each program's per-chip HBM bytes, FLOPs and per-op roofline time from the cost model
(glm5_jax.cost.hlo_cost; a kernel is charged its declared pl.CostEstimate) and writes them as JSON.

    python bench/sparse_attention_compile.py --topology v5p:2x2x1 --queries 2048 --keys 4096 --topk 2048 \
        --out bench/results/sparse_attention_compile.json

Shapes are GLM-5's: 64 heads; absorbed latent rows of 512 + 64 (values 512); MHA q / k of 192 + 64 and
values of 256. The operands are abstract (a compile needs only shapes): the flash kernel declares the pairs
of a causal sequence's needed blocks, the gather kernels k slots per query, whichever keys the selection
names. Needs libtpu.
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from glm5_jax.cost.chips import chip_of_topology  # noqa: E402
from glm5_jax.cost.hlo_cost import StepTiming, hlo_cost  # noqa: E402
from pallas_kernels.flash_attention import ops as flash_ops  # noqa: E402
from pallas_kernels.sparse_mla import ops as sparse_ops  # noqa: E402

H, LATENT, ROPE, D_MHA, V_MHA = 64, 512, 64, 256, 256
SCALE = 192 ** -0.5


def _gather_form(T, S, K):
    """(function, operand shapes) of the absorbed gather kernels, forward + backward."""
    def fwd_bwd(q, kv, idx, valid):
        def attend(q, kv):
            r = sparse_ops.sparse_mla(q, kv, idx, valid, scale=SCALE, v_dim=LATENT, impl="pallas",
                                      training_rows=False)
            return r.out, r.lse
        (out, lse), vjp = jax.vjp(attend, q, kv)
        return (out, *vjp((out, jnp.zeros_like(lse))))

    C = LATENT + ROPE
    return fwd_bwd, [((T, H, C), jnp.bfloat16), ((S, C), jnp.bfloat16), ((T, K), jnp.int32), ((T, K), jnp.bool_)]


def _masked_flash_form(T, S):
    """(function, operand shapes) of the flash kernel over the selection mask, forward + backward."""
    def fwd_bwd(q, k, v, q_pos, kv_pos, seg_q, seg_kv, allowed):
        def attend(q, k, v):
            r = flash_ops.flash_attention(q, k, v, q_pos, kv_pos, seg_q, seg_kv, scale=SCALE, impl="pallas",
                                          allowed_BTS=allowed)
            return r.out, r.lse
        (out, lse), vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp((out, jnp.zeros_like(lse))))

    return fwd_bwd, [((T, H, D_MHA), jnp.bfloat16), ((S, H, D_MHA), jnp.bfloat16), ((S, H, V_MHA), jnp.bfloat16),
                     ((T,), jnp.int32), ((S,), jnp.int32), ((T,), jnp.int32), ((S,), jnp.int32),
                     ((T, S), jnp.int8)]


def measure(mesh, fn, shapes, timing):
    n = mesh.devices.size
    spec = P("b")
    # one shard per chip: each chip's operands carry a batch dim of 1, as the kernels expect
    operands = [jax.ShapeDtypeStruct((n, *s), d, sharding=NamedSharding(mesh, spec)) for s, d in shapes]
    n_out = len(jax.eval_shape(fn, *[jax.ShapeDtypeStruct((1, *s), d) for s, d in shapes]))
    sharded = jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(shapes), out_specs=(spec,) * n_out,
                            check_vma=False)
    compiled = jax.jit(sharded).lower(*operands).compile()
    cost = hlo_cost(compiled.as_text(), timing=timing)
    return {"hbm_gb": cost.bytes_accessed / 1e9, "gflops": (cost.flops + cost.kernel_flops) / 1e9,
            "roofline_ms": cost.roofline_seconds * 1e3,
            "temp_gib": compiled.memory_analysis().temp_size_in_bytes / 2**30}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topology", default="v5p:2x2x1")
    parser.add_argument("--queries", type=int, default=2048)
    parser.add_argument("--keys", type=int, default=4096)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    T, S, K = args.queries, args.keys, args.topk
    devices = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices
    mesh = Mesh(np.array(devices).reshape(-1), ("b",))
    chip = chip_of_topology(args.topology)
    timing = StepTiming(chip.achievable_flops, chip.achievable_hbm_bandwidth, lambda op: 0.0)
    forms = {"gather kernels (absorbed)": _gather_form(T, S, K), "flash over the mask (MHA)": _masked_flash_form(T, S)}
    rows = {name: measure(mesh, fn, shapes, timing) for name, (fn, shapes) in forms.items()}
    print(f"{args.topology}, per chip: {T} queries over {S} keys, top-{K}, {H} heads, forward + backward\n")
    print("| form | HBM GB | GFLOP | roofline ms | temp GiB |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['hbm_gb']:.2f} | {r['gflops']:.0f} | {r['roofline_ms']:.2f} | {r['temp_gib']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"topology": args.topology, "queries": T, "keys": S, "topk": K, "heads": H, "forms": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
