"""DSA (indexer top-k + sparse absorbed MLA) vs dense causal absorbed MLA on the XLA path (CPU).

Dense baseline: `bench/flash_dense.py`, causal attention in flash form (each query block scores only the
key blocks at or before it, online softmax, no [T, T] mask, a FlashAttention-2 backward). Sparse: the
lightning indexer's top-k (`lightning_indexer.ops.indexer_topk`, each query chunk scores only the key
window it can see) + `sparse_mla.ops.sparse_mla`, both impl="xla". Two programs per side: the forward,
and forward + backward (gradients of q and kv under a fixed random output cotangent; the indexer, whose
top-k is discrete, runs forward only). After one untimed call of each, the four programs alternate for
--reps rounds (median reported), so both sides see the same machine state. Peak memory is read from each
compiled program's memory_analysis (argument + output + temp bytes). Dims are reduced so the sweep fits
a small CPU box; the T sweep is what matters: dense costs O(T^2 * H * C) (half of the [T, T] pairs, the
causal ones), DSA O(T^2 * H_I * d_I) for the indexer plus O(T * k * H * C) for the attention.

    python bench/dsa.py --out=bench/results/dsa.json            # T = 2K .. 32K
    python bench/dsa.py --quick --reps=1 --out=/tmp/dsa.json     # T = 1K .. 4K, smaller dims
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.flash_dense import causal_dense_mla  # noqa: E402
from bench.timing import interleaved_seconds  # noqa: E402
from pallas_kernels.lightning_indexer import ops as indexer_ops  # noqa: E402
from pallas_kernels.sparse_mla import ops as sparse_ops  # noqa: E402

# Reduced dims that keep GLM-5's cost ratio per (query, key) pair: dense absorbed attention does
# H * (C + V) = 64 * 1088 MACs against the indexer's H_I * d_I = 32 * 128, about 17 : 1; here
# 16 * 288 against 4 * 64 is 18 : 1. (With H=4, C=64 the indexer would cost as much as dense attention.)
FULL = dict(T=[2048, 4096, 8192, 16384, 32768], H=16, C=160, V=128, topk=512, H_I=4, d_I=64, block=256)
QUICK = dict(T=[1024, 2048, 4096], H=4, C=64, V=48, topk=256, H_I=2, d_I=32, block=256)


def make_inputs(T, dims, dtype):
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)  # noqa: E731
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    seg = jnp.ones((1, T), jnp.int32)
    return dict(q=normal(1, T, dims["H"], dims["C"]), kv=normal(1, T, dims["C"]),
                iq=normal(1, T, dims["H_I"], dims["d_I"]), ik=normal(1, T, dims["d_I"]),
                iw=normal(1, T, dims["H_I"]).astype(jnp.float32), pos=pos, seg=seg,
                dout=normal(1, T, dims["H"], dims["V"]))


def dense_fn(dims):
    def dense(q, kv, iq, ik, iw, pos, seg):
        del iq, ik, iw, pos, seg            # one causal sequence: positions 0..T-1, one segment
        return causal_dense_mla(q, kv, dims["C"] ** -0.5, dims["V"], dims["block"])[0]
    return dense


def sparse_fn(dims):
    def sparse(q, kv, iq, ik, iw, pos, seg):
        idx, valid = indexer_ops.indexer_topk(iq, ik, iw, pos, pos, seg, seg, topk=dims["topk"], impl="xla")
        return sparse_ops.sparse_mla(q, kv, idx, valid, scale=dims["C"] ** -0.5, v_dim=dims["V"], impl="xla")[0]
    return sparse


def with_backward(fn):
    """(q, kv, ..., dout) -> (dq, dkv) of sum(fn(...) * dout): the forward plus its backward."""
    def fwd_bwd(q, kv, iq, ik, iw, pos, seg, dout):
        loss = lambda q, kv: jnp.sum(fn(q, kv, iq, ik, iw, pos, seg).astype(jnp.float32) * dout)  # noqa: E731
        return jax.grad(loss, argnums=(0, 1))(q, kv)
    return fwd_bwd


class Compiled:
    """A jitted program compiled for fixed arguments; calling it runs it -> seconds."""

    def __init__(self, fn, args):
        self.compiled, self.args = jax.jit(fn).lower(*args).compile(), args
        mem = self.compiled.memory_analysis()
        self.peak_bytes = int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes)

    def __call__(self) -> float:
        start = time.perf_counter()
        jax.block_until_ready(self.compiled(*self.args))
        return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sweep and dims")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--reps", type=int, default=3, help="timed rounds (median reported)")
    parser.add_argument("--max_t", type=int, default=None, help="drop sweep points above this T")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    dims = dict(QUICK if args.quick else FULL)
    sweep = [t for t in dims.pop("T") if args.max_t is None or t <= args.max_t]
    dtype = jnp.dtype(args.dtype)
    print(f"dims {dims}, dtype {dtype.name}, backend {jax.default_backend()}, {os.cpu_count()} CPUs, "
          f"median of {args.reps}")
    print(f"{'T':>7} {'dense fwd s':>12} {'sparse fwd s':>13} {'ratio':>6} {'dense f+b s':>12} {'sparse f+b s':>13} "
          f"{'ratio':>6} {'dense peak MiB':>15} {'sparse peak MiB':>16}")
    rows = []
    for T in sweep:
        x = make_inputs(T, dims, dtype)
        fwd_args = tuple(x[k] for k in ("q", "kv", "iq", "ik", "iw", "pos", "seg"))
        programs = {"dense_fwd": Compiled(dense_fn(dims), fwd_args),
                    "sparse_fwd": Compiled(sparse_fn(dims), fwd_args),
                    "dense_fwd_bwd": Compiled(with_backward(dense_fn(dims)), fwd_args + (x["dout"],)),
                    "sparse_fwd_bwd": Compiled(with_backward(sparse_fn(dims)), fwd_args + (x["dout"],))}
        times = interleaved_seconds(programs, args.reps, warmup=1)
        row = {"T": T, "seconds": times}
        for name, program in programs.items():
            row[f"{name}_s"] = statistics.median(times[name])
            row[f"{name}_peak_bytes"] = program.peak_bytes
        row["fwd_ratio"] = row["dense_fwd_s"] / row["sparse_fwd_s"]
        row["fwd_bwd_ratio"] = row["dense_fwd_bwd_s"] / row["sparse_fwd_bwd_s"]
        rows.append(row)
        print(f"{T:>7} {row['dense_fwd_s']:>12.3f} {row['sparse_fwd_s']:>13.3f} {row['fwd_ratio']:>6.2f} "
              f"{row['dense_fwd_bwd_s']:>12.3f} {row['sparse_fwd_bwd_s']:>13.3f} {row['fwd_bwd_ratio']:>6.2f} "
              f"{row['dense_fwd_peak_bytes'] / 2**20:>15.1f} {row['sparse_fwd_peak_bytes'] / 2**20:>16.1f}",
              flush=True)
    print_table(rows)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"dims": dict(dims, dtype=dtype.name, backend=jax.default_backend(), reps=args.reps,
                                    statistic="median"), "rows": rows}, f, indent=1)


def print_table(rows):
    """The table in bench/README.md (markdown)."""
    print("| T | dense fwd s | sparse fwd s | dense / sparse | dense fwd+bwd s | sparse fwd+bwd s | dense / sparse | "
          "dense fwd+bwd peak MiB | sparse fwd+bwd peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['dense_fwd_s']:.3f} | {r['sparse_fwd_s']:.3f} | {r['fwd_ratio']:.2f} | "
              f"{r['dense_fwd_bwd_s']:.3f} | {r['sparse_fwd_bwd_s']:.3f} | {r['fwd_bwd_ratio']:.2f} | "
              f"{r['dense_fwd_bwd_peak_bytes'] / 2**20:.1f} | {r['sparse_fwd_bwd_peak_bytes'] / 2**20:.1f} |")


if __name__ == "__main__":
    main()
