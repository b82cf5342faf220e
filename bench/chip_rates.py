"""The matmul and HBM rates libtpu's own TPU cost model assumes for each chip (the achievable fractions of
glm5_jax/cost/chips.py): an 8192 x 8192 bf16 matmul and an elementwise pass over the same array are
AOT-compiled for each chip on this host (libtpu, no TPU), and ``flops`` / ``bytes accessed`` are divided
by the cost analysis' ``optimal_seconds``.

    JAX_PLATFORMS=cpu python -m bench.chip_rates [--json bench/results/chip_rates.json]
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from glm5_jax.cost.chips import CHIPS

TOPOLOGIES = {"v5p": "v5p:2x2x1", "v5e": "v5e:2x2", "v6e": "v6e:2x2", "tpu7x": "tpu7x:2x2x1"}
N = 8192


def _cost(fn, *args) -> dict:
    with jax.default_matmul_precision("default"):
        cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return cost[0] if isinstance(cost, (list, tuple)) else cost


def libtpu_rates(chip: str) -> dict:
    """{"matmul_flops_per_s", "hbm_bytes_per_s", "device_kind"} from libtpu's cost model for `chip`."""
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    device = topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[chip]).devices[0]
    x = jax.ShapeDtypeStruct((N, N), jnp.bfloat16, sharding=SingleDeviceSharding(device))
    mm = _cost(lambda a, b: a @ b, x, x)
    ew = _cost(lambda a: a * 2, x)
    return {"device_kind": device.device_kind, "matmul_flops_per_s": mm["flops"] / mm["optimal_seconds"],
            "hbm_bytes_per_s": ew["bytes accessed"] / ew["optimal_seconds"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    print(f"{'chip':6} {'matmul FLOP/s':>14} {'/ peak':>7} {'HBM B/s':>10} {'/ peak':>7}  device_kind")
    for chip, spec in CHIPS.items():
        r = libtpu_rates(chip)
        rows.append({"chip": chip, **r, "flops_fraction": r["matmul_flops_per_s"] / spec.peak_flops,
                     "hbm_fraction": r["hbm_bytes_per_s"] / spec.hbm_bandwidth})
        print(f"{chip:6} {r['matmul_flops_per_s']:14.3e} {rows[-1]['flops_fraction']:7.3f} "
              f"{r['hbm_bytes_per_s']:10.3e} {rows[-1]['hbm_fraction']:7.3f}  {r['device_kind']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
