"""TPU chip facts the cost model uses: one row per chip, each number with where it comes from.

Vendor facts (Google Cloud TPU documentation, each version's "System architecture" page):
* v5p (https://cloud.google.com/tpu/docs/v5p): 459 TFLOP/s bf16 per chip, 96 GiB of HBM at 2765 GB/s, of
  which libtpu lets a program use 95.74 GiB (it refuses a larger compile with "exceeds available HBM
  (95.74G)"; the vendor page's "95 GiB user-allocatable" is rounded down), 1200 GB/s bidirectional ICI
  per chip over a 3D torus: six ports (+-x, +-y, +-z), so 100 GB/s per port in each direction; slices of
  4x4x4 chips and larger have wraparound links on every dimension; two TensorCores per chip (megacore),
  over which a Pallas kernel splits the iterations of its "parallel" grid axes.
* v5e (https://cloud.google.com/tpu/docs/v5e): 197 TFLOP/s bf16, 16 GiB HBM at 819 GB/s.
* v6e (https://cloud.google.com/tpu/docs/v6e): 918 TFLOP/s bf16, 32 GiB HBM at 1640 GB/s.
* TPU7x / Ironwood (libtpu's ``tpu7x`` topologies): 192 GB of HBM per chip (Google's Ironwood
  announcement, April 2025). libtpu exposes each of a chip's two TensorCores as a device, so its row is
  per device (half the chip's HBM), with the rates libtpu's own cost model uses (below) as its peaks; its
  ICI is not modelled here.

Achievable fractions: what a well-formed op reaches, not the vendor peak. They are read from libtpu's own
TPU cost model (``compiled.cost_analysis()``: ``flops`` or ``bytes accessed`` over ``optimal_seconds``)
on an 8192 x 8192 bf16 matmul and an elementwise pass over the same array, compiled for each chip with
libtpu 0.0.42 (``bench/chip_rates.py`` reprints them; tests/cost/test_chip_facts.py checks them):

    chip   matmul FLOP/s   = peak x   HBM bytes/s   = peak x
    v5p    3.94e14           0.858    2.35e12         0.850
    v5e    1.97e14           1.000    7.38e11         0.901
    v6e    9.18e14           1.000    1.64e12         0.999
    tpu7x  9.96e14 / device   -       3.69e12 / device  -

ICI achievable fraction: no public measurement of v5p ICI utilisation was found; the model takes 0.85,
the same fraction libtpu's model assumes for v5p HBM, and states it as an assumption in every report.

SparseCore collectives (v5p): how fast the SparseCores drive the links is not public; the public v5p
recipes tell libtpu's scheduler to expect an offloaded reduce-scatter to take 3x its estimate
(``--xla_tpu_sparse_core_reduce_scatter_latency_multiplier=3``), so reports take 3x for those
(``sparsecore_reduce_scatter_factor``) and show 1x as a sensitivity row.
"""
from __future__ import annotations

import dataclasses

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    peak_flops: float                 # bf16 matmul FLOP/s per device, the vendor's peak (MFU's denominator)
    hbm_bytes: int                    # user-allocatable HBM per device
    hbm_bandwidth: float              # vendor peak HBM bytes/s per device
    flops_fraction: float = 1.0       # achievable share of peak_flops (libtpu's cost model)
    hbm_fraction: float = 1.0         # achievable share of hbm_bandwidth (libtpu's cost model)
    ici_link_bandwidth: float | None = None   # one direction of one ICI link, bytes/s
    ici_fraction: float | None = None         # achievable share of the link bandwidth (an assumption)
    ici_step_latency: float | None = None     # seconds per step of a ring / pairwise collective (assumption)
    min_wraparound_dim: int | None = None     # slices whose every torus dim is >= this have wraparound links
    sparsecore_reduce_scatter_factor: float = 1.0   # an offloaded reduce-scatter's time / its link time
    tensor_cores: int = 1                     # TensorCores a device's Pallas grids may split over (megacore)

    @property
    def achievable_flops(self) -> float:
        return self.peak_flops * self.flops_fraction

    @property
    def achievable_hbm_bandwidth(self) -> float:
        return self.hbm_bandwidth * self.hbm_fraction

    @property
    def achievable_link_bandwidth(self) -> float | None:
        if self.ici_link_bandwidth is None:
            return None
        return self.ici_link_bandwidth * (self.ici_fraction or 1.0)


CHIPS = {
    "v5p": ChipSpec(459e12, int(95.74 * GIB), 2765e9, flops_fraction=0.858, hbm_fraction=0.850,
                    ici_link_bandwidth=100e9, ici_fraction=0.85, ici_step_latency=1e-6, min_wraparound_dim=4,
                    sparsecore_reduce_scatter_factor=3.0, tensor_cores=2),
    "v5e": ChipSpec(197e12, 16 * GIB, 819e9, flops_fraction=1.0, hbm_fraction=0.901),
    "v6e": ChipSpec(918e12, 32 * GIB, 1640e9, flops_fraction=1.0, hbm_fraction=0.999),
    # per device (one TensorCore); peak = libtpu's own matmul rate, so the fractions are 1 by construction
    "tpu7x": ChipSpec(9.96e14, 96 * 10**9, 3.686e12),
}
# libtpu's name of each chip (its topology descriptions' device_kind)
DEVICE_KINDS = {"v5p": "TPU v5", "v5e": "TPU v5 lite", "v6e": "TPU v6 lite", "tpu7x": "TPU7x"}


def chip_of_topology(topology: str) -> ChipSpec:
    """The chip of a topology name such as ``v5p:8x16x16``; a clear error for an unknown chip."""
    kind = topology.split(":")[0]
    if kind not in CHIPS:
        raise ValueError(f"--topology={topology}: unknown chip {kind!r}; known: {sorted(CHIPS)}")
    return CHIPS[kind]


def topology_devices(topology: str):
    """The devices of a TPU topology such as ``v5p:8x16x16`` (libtpu's description: no TPU needed), for an
    ahead-of-time compile from any host."""
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
