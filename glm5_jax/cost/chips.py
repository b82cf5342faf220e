"""TPU chip facts the cost model uses, one row per chip, each with its public source.

Sources (Google Cloud TPU documentation, "System architecture" pages of each version):
* v5p: https://cloud.google.com/tpu/docs/v5p — 459 TFLOP/s bf16 peak, 95 GB HBM2e at 2765 GB/s, 1200 GB/s
  bidirectional ICI per chip over a 3D torus (6 links, so 100 GB/s per link each way); slices of 4x4x4
  chips and larger have wraparound links on every dimension.
* v5e: https://cloud.google.com/tpu/docs/v5e — 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s.
* v6e: https://cloud.google.com/tpu/docs/v6e — 918 TFLOP/s bf16, 32 GB HBM at 1640 GB/s.

The ICI model (`glm5_jax.cost.ici`) knows only v5p's torus; the other chips carry no link facts.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    peak_flops: float                 # bf16 matmul FLOP/s
    hbm_bytes: int                    # HBM capacity, as the vendor states it
    hbm_bandwidth: float              # bytes/s
    ici_link_bandwidth: float | None = None   # one direction of one ICI link, bytes/s
    min_wraparound_dim: int | None = None     # slices whose every torus dim is >= this have wraparound links


CHIPS = {
    "v5p": ChipSpec(459e12, 95 * 10**9, 2765e9, ici_link_bandwidth=100e9, min_wraparound_dim=4),
    "v5e": ChipSpec(197e12, 16 * 10**9, 819e9),
    "v6e": ChipSpec(918e12, 32 * 10**9, 1640e9),
}


def chip_of_topology(topology: str) -> ChipSpec:
    """The chip of a topology name such as ``v5p:8x16x16``; a clear error for an unknown chip."""
    kind = topology.split(":")[0]
    if kind not in CHIPS:
        raise ValueError(f"--topology={topology}: unknown chip {kind!r}; known: {sorted(CHIPS)}")
    return CHIPS[kind]
