"""DSA (indexer top-k + sparse absorbed MLA) vs dense causal absorbed MLA on the XLA path (CPU).

Times one jitted forward of each (after a warm-up call) and reads its peak memory from the compiled
program's memory_analysis (argument + output + temp bytes). Dims are reduced so the sweep fits a small
CPU box; the T sweep is what matters: dense costs O(T^2 * H * C), DSA O(T^2 * H_I * d_I) for the indexer
plus O(T * k * H * C) for the attention.

    python bench/dsa.py --out=bench/results/dsa.json            # T = 2K .. 32K
    python bench/dsa.py --quick --out=/tmp/dsa.json              # T = 1K .. 4K, smaller dims
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.lightning_indexer import ops as indexer_ops  # noqa: E402
from pallas_kernels.masking import visible_mask  # noqa: E402
from pallas_kernels.sparse_mla import ops as sparse_ops  # noqa: E402
from pallas_kernels.sparse_mla import reference as sparse_reference  # noqa: E402

# Reduced dims that keep GLM-5's cost ratio per (query, key) pair: dense absorbed attention does
# H * (C + V) = 64 * 1088 MACs against the indexer's H_I * d_I = 32 * 128, about 17 : 1; here
# 16 * 288 against 4 * 64 is 18 : 1. (With H=4, C=64 the indexer would cost as much as dense attention.)
FULL = dict(T=[2048, 4096, 8192, 16384, 32768], H=16, C=160, V=128, topk=512, H_I=4, d_I=64)
QUICK = dict(T=[1024, 2048, 4096], H=4, C=64, V=48, topk=256, H_I=2, d_I=32)


def make_inputs(T, dims, dtype):
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)  # noqa: E731
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    seg = jnp.ones((1, T), jnp.int32)
    return dict(q=normal(1, T, dims["H"], dims["C"]), kv=normal(1, T, dims["C"]),
                iq=normal(1, T, dims["H_I"], dims["d_I"]), ik=normal(1, T, dims["d_I"]),
                iw=normal(1, T, dims["H_I"]).astype(jnp.float32), pos=pos, seg=seg)


def dense_fn(dims):
    def dense(q, kv, pos, seg):
        visible = visible_mask(pos, pos, seg, seg)
        return sparse_reference.dense_mla(q, kv, visible, scale=dims["C"] ** -0.5, v_dim=dims["V"])[0]
    return dense


def sparse_fn(dims):
    def sparse(q, kv, iq, ik, iw, pos, seg):
        idx, valid = indexer_ops.indexer_topk(iq, ik, iw, pos, pos, seg, seg, topk=dims["topk"], impl="xla")
        return sparse_ops.sparse_mla(q, kv, idx, valid, scale=dims["C"] ** -0.5, v_dim=dims["V"], impl="xla")[0]
    return sparse


def measure(fn, args, reps):
    compiled = jax.jit(fn).lower(*args).compile()
    mem = compiled.memory_analysis()
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return min(times), peak


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sweep and dims")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--max_t", type=int, default=None, help="drop sweep points above this T")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    dims = dict(QUICK if args.quick else FULL)
    sweep = [t for t in dims.pop("T") if args.max_t is None or t <= args.max_t]
    dtype = jnp.dtype(args.dtype)
    print(f"dims {dims}, dtype {dtype.name}, backend {jax.default_backend()}, {os.cpu_count()} CPUs")
    print(f"{'T':>7} {'dense s':>9} {'sparse s':>9} {'ratio':>6} {'dense peak MiB':>15} {'sparse peak MiB':>16}")
    rows = []
    for T in sweep:
        x = make_inputs(T, dims, dtype)
        dense_s, dense_peak = measure(dense_fn(dims), (x["q"], x["kv"], x["pos"], x["seg"]), args.reps)
        sparse_s, sparse_peak = measure(
            sparse_fn(dims), (x["q"], x["kv"], x["iq"], x["ik"], x["iw"], x["pos"], x["seg"]), args.reps)
        row = dict(T=T, dense_s=dense_s, sparse_s=sparse_s, ratio=dense_s / sparse_s,
                   dense_peak_bytes=int(dense_peak), sparse_peak_bytes=int(sparse_peak))
        rows.append(row)
        print(f"{T:>7} {dense_s:>9.3f} {sparse_s:>9.3f} {row['ratio']:>6.2f} "
              f"{dense_peak / 2**20:>15.1f} {sparse_peak / 2**20:>16.1f}", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"dims": dict(dims, dtype=dtype.name, backend=jax.default_backend(), reps=args.reps),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
