"""Sweep the grouped-matmul tiles at GLM-5's per-chip routed-expert shapes: compile the megablox kernels
(`pallas_kernels/grouped_matmul/kernel.py`: `gmm` forward / input gradient, `tgmm` weight gradient) for a
TPU topology from this host with each (rows, contraction, output) tiling, and print per tiling the cost
model's HBM bytes and MXU FLOPs of the kernels at the row tiles they visit for the routed rows
(`glm5_jax.cost.hlo_cost`: the tiles the rows cover plus one per group boundary, which both groups compute
in full; the kernels' static estimate counts every row of the buffer once and no boundary), and
each product at its own roofline at the chip's achievable rates, for `gmm` and `tgmm` apart (kernel.py takes
the best of each).

    python bench/gmm_tiling_compile.py [--topology v5p:2x2x1] [--rows 10240 --filled 8192 --experts 8] [--aligned] \
        [--hidden 6144 --ffn 2048] [--conservative] [--tilings 256,1024,2048 256,1024,1024]

``--conservative``: under the cost model's conservative rules (glm5_jax.cost.hlo_cost.CONSERVATIVE: each
kernel by the TensorCores its parallel grid axis can use, 0.35 us per grid step, its bytes by its grid, 1 us
per top-level instruction); megablox splits only its output-column tiles over v5p's two cores, so a product
with one (or an odd number of) column tiles leaves a core idle.

Defaults: the 744B config's per-chip shapes (fsdp 32 x context 2 x expert 32, two token chunks through the
expert all-to-all): 10,240 received rows per chunk (the 1.25 capacity buffer; 8,192 of them routed rows on
average), 8 local experts, D = 6144, F = 2048, bf16 operands and fp32 accumulation. The products of one
SwiGLU expert pass: gate and up ([rows, D] x [D, F] each), down ([rows, F] x [F, D]); their input gradients
(the same shapes transposed) and weight gradients (`tgmm`, [D, F] and [F, D] per expert). Writes JSON with
``--json``. Needs libtpu.
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
from glm5_jax.cost.hlo_cost import (CONSERVATIVE, GroupedMatmulLoad, StepTiming, grouped_matmul_tiles,  # noqa: E402
                                     hlo_cost)
from pallas_kernels.grouped_matmul import kernel  # noqa: E402

D, F = 6144, 2048
TILINGS = [(128, 1024, 1024), (256, 512, 512), (256, 1024, 1024), (256, 2048, 1024), (256, 1024, 2048),
           (384, 1024, 1024), (512, 512, 1024), (512, 1024, 512), (512, 1024, 1024), (512, 2048, 2048)]


def products(D, F):
    """(what, kind, K, N, products per SwiGLU pass): gmm [M, K] x [K, N], or tgmm -> [E, K, N]."""
    return [("gate/up forward + down input grad", "gmm", D, F, 4),
            ("down forward + gate/up input grads", "gmm", F, D, 3),
            ("gate/up weight grads", "tgmm", D, F, 2),
            ("down weight grad", "tgmm", F, D, 1)]


def compile_product(mesh, kind, M, E, K, N, tiling):
    n = mesh.devices.size
    spec = lambda shape: jax.ShapeDtypeStruct((n, *shape), jnp.bfloat16,  # noqa: E731
                                              sharding=NamedSharding(mesh, P("c")))
    sizes = jax.ShapeDtypeStruct((n, E), jnp.int32, sharding=NamedSharding(mesh, P("c")))

    def per_chip(a, b, g):
        if kind == "gmm":
            return kernel.gmm(a[0], b[0], g[0], out_dtype=jnp.bfloat16, tiling=tiling)[None]
        return kernel.tgmm(a[0], b[0], g[0], out_dtype=jnp.bfloat16, tiling=tiling)[None]

    operands = (spec((M, K)), spec((E, K, N)), sizes) if kind == "gmm" else (spec((M, K)), spec((M, N)), sizes)
    fn = jax.shard_map(per_chip, mesh=mesh, in_specs=(P("c"),) * 3, out_specs=P("c"), check_vma=False)
    return jax.jit(fn).lower(*operands).compile()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topology", default="v5p:2x2x1")
    parser.add_argument("--rows", type=int, default=10240, help="rows per chip per kernel call (buffer)")
    parser.add_argument("--filled", type=int, default=8192, help="of which routed rows (sum of group sizes)")
    parser.add_argument("--experts", type=int, default=8, help="local experts per chip")
    parser.add_argument("--aligned", action="store_true",
                        help="each expert's rows start on a row tile (the a2a transport's moe_group_align)")
    parser.add_argument("--hidden", type=int, default=D, help="model width D (GLM-5.3-Flash: 4096)")
    parser.add_argument("--ffn", type=int, default=F, help="expert width F")
    parser.add_argument("--json", default=None)
    parser.add_argument("--conservative", action="store_true", help="under the conservative cost rules")
    parser.add_argument("--tilings", nargs="*", default=None, help="rows,K,N each (default: the sweep's)")
    args = parser.parse_args()
    tilings = [tuple(int(v) for v in t.split(",")) for t in args.tilings] if args.tilings else TILINGS
    rules = dataclasses.replace(CONSERVATIVE, cores_per_chip=chip_of_topology(args.topology).tensor_cores) \
        if args.conservative else None
    devices = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices
    mesh = Mesh(np.array(devices).reshape(-1), ("c",))
    chip = chip_of_topology(args.topology)
    timing = StepTiming(chip.achievable_flops, chip.achievable_hbm_bandwidth, lambda op: 0.0)
    M, E, filled, d, ffn = args.rows, args.experts, args.filled, args.hidden, args.ffn
    packing = "each expert's rows from a row tile" if args.aligned else "back to back"
    print(f"{args.topology} per chip: {M} rows ({filled} routed) over {E} experts ({packing}), D={d}, F={ffn}, "
          f"bf16; one SwiGLU expert pass forward + backward: 7 gmm + 3 tgmm products")
    print(f"{'tiling (rows, K, N)':>20s} | {'kernel':6s} | {'HBM GB':>7s} | {'MXU TFLOP':>9s} | "
          f"{'partial tiles':>13s} | {'roofline ms':>11s}")
    rows = []
    for tiling in tilings:
        per_kernel = {}
        for _, kind, K, N, times in products(d, ffn):
            entry = per_kernel.setdefault(kind, dict(hbm_bytes=0.0, mxu_flops=0.0, roofline_seconds=0.0))
            if entry.get("error"):
                continue
            try:
                compiled = compile_product(mesh, kind, M, E, K, N, tiling)
            except Exception as e:          # a tiling Mosaic rejects (scoped VMEM) is reported, not fatal
                entry["error"] = str(e).splitlines()[0][:160]
                continue
            # the row tiles the kernel visits for `filled` routed rows (glm5_jax.cost.hlo_cost: the rows' tiles
            # plus one per group boundary; megablox's own estimate counts 2 M K N over the whole buffer)
            cost = hlo_cost(compiled.as_text(), timing=timing,
                            grouped_matmul_load=GroupedMatmulLoad(filled, args.aligned), rules=rules)
            entry["hbm_bytes"] += times * cost.bytes_accessed
            entry["mxu_flops"] += times * cost.kernel_flops
            entry["roofline_seconds"] += times * cost.roofline_seconds
        tm = kernel.row_tile(M, tiling[0])      # both kernels' row tile: the work past the routed rows
        waste = grouped_matmul_tiles(filled, tm, E, args.aligned) * tm / filled - 1
        for kind, entry in per_kernel.items():
            rows.append(dict(tiling=tiling, kernel=kind, partial_tile_fraction=waste, **entry))
            if entry.get("error"):
                print(f"{str(tiling):>20s} | {kind:6s} | does not compile: {entry['error'][:90]}")
            else:
                print(f"{str(tiling):>20s} | {kind:6s} | {entry['hbm_bytes'] / 1e9:7.2f} | "
                      f"{entry['mxu_flops'] / 1e12:9.3f} | {100 * waste:12.1f}% | "
                      f"{entry['roofline_seconds'] * 1e3:11.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(topology=args.topology, rows=M, filled=filled, experts=E, aligned=args.aligned, D=d, F=ffn,
                           conservative=args.conservative, tilings=rows), f, indent=1)


if __name__ == "__main__":
    main()
