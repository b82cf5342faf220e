"""glm5_jax.cost.chips: the achievable fractions are the rates libtpu's own cost model uses (re-derived
by compiling for each chip), and the HBM capacities are the vendor's GiB."""
import importlib.util

import pytest

from glm5_jax.cost.chips import CHIPS, DEVICE_KINDS, GIB

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not importable (pip install -r requirements-tpu.txt)")


@pytest.mark.parametrize("chip", sorted(CHIPS))
def test_achievable_rates_are_libtpus(chip):
    from bench.chip_rates import libtpu_rates

    rates = libtpu_rates(chip)
    spec = CHIPS[chip]
    assert rates["device_kind"] == DEVICE_KINDS[chip]
    assert spec.achievable_flops == pytest.approx(rates["matmul_flops_per_s"], rel=0.005)
    assert spec.achievable_hbm_bandwidth == pytest.approx(rates["hbm_bytes_per_s"], rel=0.005)


def test_v5p_facts():
    v5p = CHIPS["v5p"]
    # libtpu's limit: a program of more is refused with "exceeds available HBM (95.74G)" (GiB, not 95e9 bytes)
    assert v5p.hbm_bytes == int(95.74 * GIB)
    assert v5p.tensor_cores == 2 and v5p.sparsecore_reduce_scatter_factor == 3.0
    assert v5p.ici_link_bandwidth * 6 * 2 == 1200e9     # 1200 GB/s bidirectional over six ports
