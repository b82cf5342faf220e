"""Compile the dense-stage flash attention (forward + backward, Mosaic) for a TPU topology from this host
and print its per-chip memory and XLA cost analysis beside the attention FLOPs of the MHA and absorbed
MLA forms.

    python bench/flash_attention_compile.py --topology v5p:2x2x1 --seq 4096 [--kv-seq 4096] [--heads 64] \
        [--blocks 256,512,1024 --json OUT]

One sequence per chip (batch split over the slice's chips), bf16, GLM-5 heads (q/k 192 + 64, v 256; the
absorbed form's latent 512 + 64). ``--seq`` < ``--kv-seq`` is a context-parallel shard's queries (zig-zag
layout) over the gathered keys. ``--blocks``: compile once per kernel block size and print each one's
forward and backward kernels under the cost model (glm5_jax.cost.hlo_cost) with and without its
conservative rules (`CONSERVATIVE`: each kernel by the TensorCores its parallel grid axes use, 0.35 us per
grid step -- a step whose block pair no query can see still costs its step --, its bytes by its grid).
Needs libtpu (requirements-tpu.txt).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from glm5_jax.cost.chips import chip_of_topology  # noqa: E402
from glm5_jax.cost.hlo_cost import CONSERVATIVE, StepTiming, hlo_cost  # noqa: E402
from pallas_kernels.flash_attention import ops as flash_ops  # noqa: E402

D_NOPE, D_ROPE, D_V, D_LATENT = 192, 64, 256, 512


def causal_pairs(T, S):
    """Visible (query, key) pairs of one sequence (T = S), or of a context shard's T queries over S keys in
    the zig-zag layout (glm5_jax/parallel/context.py: natural chunks 0 and 2n-1 of T/2 tokens, every
    shard the same count)."""
    c = T // 2
    first, last = range(c), range(S - c, S) if T < S else range(c, T)
    return sum(t + 1 for t in first) + sum(t + 1 for t in last)


def attention_flops(T, S, H):
    """Training FLOPs (forward + 2 x forward for the backward) of the visible causal pairs, MHA vs absorbed."""
    pairs = causal_pairs(T, S)
    mha = 2 * (D_NOPE + D_ROPE) + 2 * D_V
    absorbed = 2 * (D_LATENT + D_ROPE) + 2 * D_LATENT
    return {"pairs": pairs, "mha": 3 * pairs * H * mha, "absorbed": 3 * pairs * H * absorbed,
            "absorbed_all_pairs": 3 * T * S * H * absorbed}


def compile_fwd_bwd(mesh, T, S, H, block):
    """The flash forward + backward (Mosaic) at one block size, one sequence per chip."""
    n, D = mesh.devices.size, D_NOPE + D_ROPE

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct((n, *shape), dtype, sharding=NamedSharding(mesh, P("b")))

    def fwd_bwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg):
        def attend(q, k, v):
            return tuple(flash_ops.flash_attention(q, k, v, q_pos, kv_pos, q_seg, kv_seg, scale=D_NOPE ** -0.5,
                                                   impl="pallas", block=block))
        (out, lse), vjp = jax.vjp(attend, q, k, v)
        return (out, lse, *vjp((out, lse)))

    operands = (spec((T, H, D), jnp.bfloat16), spec((S, H, D), jnp.bfloat16), spec((S, H, D_V), jnp.bfloat16),
                spec((T,), jnp.int32), spec((S,), jnp.int32), spec((T,), jnp.int32), spec((S,), jnp.int32))
    return jax.jit(jax.shard_map(fwd_bwd, mesh=mesh, in_specs=(P("b"),) * 7, out_specs=(P("b"),) * 5,
                                 check_vma=False)).lower(*operands).compile()


def kernel_rows(hlo_text, timing, rules):
    """{"forward" / "backward": (roofline s, HBM bytes, FLOPs)} of the step's flash kernels under ``rules``."""
    cost = hlo_cost(hlo_text, timing=timing, rules=rules, top=100)
    rows = {}
    for t in cost.top_instructions:
        kind = ("backward" if "flash_attention_bwd" in t.op_name     # the fused kernel, or dK/dV and dQ
                else "forward" if "flash_attention_fwd" in t.op_name else None)
        if kind is not None and t.opcode == "custom-call":
            s, b, f = rows.get(kind, (0.0, 0.0, 0.0))
            rows[kind] = (s + t.seconds, b + t.bytes, f + t.flops)
    return rows, cost.grid_steps


def sweep_blocks(mesh, topology, T, S, H, blocks, json_path):
    chip = chip_of_topology(topology)
    timing = StepTiming(chip.achievable_flops, chip.achievable_hbm_bandwidth, lambda op: 0.0)
    rules = dataclasses.replace(CONSERVATIVE, cores_per_chip=chip.tensor_cores)
    print(f"{topology}, per chip: {T} queries x {S} keys x {H} heads, flash forward + backward kernels")
    print("| block | kernel | grid steps | HBM GB | TFLOP | roofline ms (optimistic) | roofline ms (conservative) |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    out = []
    for block in blocks:
        text = compile_fwd_bwd(mesh, T, S, H, block).as_text()
        optimistic, _ = kernel_rows(text, timing, None)
        conservative, steps = kernel_rows(text, timing, rules)
        for kind in ("forward", "backward"):
            s_c, b_c, f_c = conservative[kind]
            print(f"| {block} | {kind} | | {b_c / 1e9:.2f} | {f_c / 1e12:.3f} | {optimistic[kind][0] * 1e3:.3f} | "
                  f"{s_c * 1e3:.3f} |")
        total_o = sum(v[0] for v in optimistic.values())
        total_c = sum(v[0] for v in conservative.values())
        print(f"| {block} | **both** | {steps:.0f} | | | {total_o * 1e3:.3f} | **{total_c * 1e3:.3f}** |")
        out.append({"block": block, "grid_steps": steps, "optimistic_seconds": total_o,
                    "conservative_seconds": total_c,
                    "kernels": {k: {"conservative_seconds": v[0], "hbm_bytes": v[1], "flops": v[2],
                                    "optimistic_seconds": optimistic[k][0]} for k, v in conservative.items()}})
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"topology": topology, "queries": T, "keys": S, "heads": H, "blocks": out}, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topology", default="v5p:2x2x1")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--kv-seq", type=int, default=None)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--blocks", default=None, help="comma-separated kernel block sizes to compare")
    parser.add_argument("--json", default=None, help="with --blocks: write the rows here")
    args = parser.parse_args()
    T, S, H = args.seq, args.kv_seq or args.seq, args.heads
    devices = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices
    mesh = Mesh(np.array(devices).reshape(-1), ("b",))
    if args.blocks:
        return sweep_blocks(mesh, args.topology, T, S, H, [int(b) for b in args.blocks.split(",")], args.json)
    compiled = compile_fwd_bwd(mesh, T, S, H, flash_ops.BLOCK)
    mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
    flops = attention_flops(T, S, H)
    gib = 2 ** 30
    print(f"{args.topology}, per chip: {T} queries x {S} keys x {H} heads, forward + backward")
    print(f"  memory_analysis: argument {mem.argument_size_in_bytes / gib:.3f} GiB, output "
          f"{mem.output_size_in_bytes / gib:.3f} GiB, temp {mem.temp_size_in_bytes / gib:.3f} GiB")
    print(f"  cost_analysis: {cost['flops']:.4g} FLOPs, {cost['bytes accessed']:.4g} bytes accessed, "
          f"{cost.get('transcendentals', 0):.4g} transcendentals")
    print(f"  model FLOPs (train = 3 x forward) of the visible pairs: MHA {flops['mha']:.4g}, absorbed "
          f"{flops['absorbed']:.4g} ({flops['absorbed'] / flops['mha']:.3f}x), absorbed over every pair as the "
          f"XLA dense_mla computes it {flops['absorbed_all_pairs']:.4g}")
    print(f"  kernels / MHA model FLOPs: {cost['flops'] / flops['mha']:.3f}")


if __name__ == "__main__":
    main()
