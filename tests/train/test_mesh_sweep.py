"""bench/mesh_sweep.py: every point is a valid mesh for its topology, the cache key follows the resolved
config, a cached report is reused without compiling, and the table shows what the reports say."""
import json
import math
import os

import pytest

from bench import mesh_sweep
from glm5_jax.cost.ici import torus_dims
from glm5_jax.parallel.mesh import check_mesh_fits_model
from glm5_jax.train.experiment import apply_overrides, load_config_file
from tests.train.test_train_cli import ROOT

CONFIG = os.path.join(ROOT, "configs", "glm5_744b.py")


@pytest.mark.parametrize("sweep", sorted(mesh_sweep.SWEEPS))
def test_points_are_valid_meshes(sweep):
    points = mesh_sweep.SWEEPS[sweep]
    chips = math.prod(torus_dims(sweep.split("/")[0]))
    cfgs = {name: apply_overrides(load_config_file(CONFIG), overrides) for name, overrides in points.items()}
    for name, cfg in cfgs.items():
        sizes = cfg.mesh.axis_sizes(chips)
        assert math.prod(sizes.values()) == chips, name
        assert cfg.data.batch_size % cfg.train.grad_accum == 0, name
        micro_batch = cfg.data.batch_size // cfg.train.grad_accum
        check_mesh_fits_model(sizes, cfg.model, micro_batch)
    assert all("model.attention_impl=pallas" in o for o in points.values())   # the TPU path
    if sweep in ("v5p:8x16x16", "v5p:4x4x8"):
        policies = {cfg.model.runtime.remat_policy for cfg in cfgs.values()}
        assert len(points) >= 8 and {"full", "offload_dots", "selection_saveable"} <= policies
    if sweep.endswith("/tokens"):     # tokens per chip: the batch is what varies, from 1024 to 8192 sequences
        assert {cfg.data.batch_size for cfg in cfgs.values()} == {1024, 2048, 4096, 8192}


def test_cache_key_follows_the_resolved_config():
    base = mesh_sweep.SWEEPS["v5p:8x16x16"]["baseline"]
    key = mesh_sweep.point_key(CONFIG, base, "v5p:8x16x16", "src")
    assert key == mesh_sweep.point_key(CONFIG, list(base), "v5p:8x16x16", "src")
    assert key != mesh_sweep.point_key(CONFIG, base + mesh_sweep._RAGGED, "v5p:8x16x16", "src")
    assert key != mesh_sweep.point_key(CONFIG, base, "v5p:8x16x16", "other sources")
    # stating one of the point's own axes again resolves to the same config
    assert key == mesh_sweep.point_key(CONFIG, base + ["mesh.tensor=2"], "v5p:8x16x16", "src")
    # every point names all four mesh axes, so its key does not depend on the config file's mesh
    cfg = apply_overrides(load_config_file(CONFIG), base)
    assert (cfg.mesh.fsdp, cfg.mesh.context, cfg.mesh.expert, cfg.mesh.tensor) == (128, 1, 8, 2)


def test_cached_point_is_read_not_compiled(tmp_path):
    report = {"topology": "v5p:8x16x16", "mesh": {"data": 1, "fsdp": 128, "expert": 8, "tensor": 2},
              "remat_policy": "full", "moe_ep": "a2a", "grad_accum": 1, "batch_size": 1024, "fits": True,
              "per_device_bytes": {"total": 30.5e9}, "flops_per_model_flop": 3.25, "mfu": 0.21,
              "communication": {"bytes_per_chip": 2e11, "seconds": 2.5, "exposed_seconds": 1.25},
              "estimated_step_seconds": 6.5, "measuring_sha256": "m"}
    (tmp_path / "compile_report.json").write_text(json.dumps(report))
    # a timeout of 0 s would fail any compile: the cached report must come back as it is
    got = mesh_sweep.compile_point(CONFIG, "v5p:8x16x16", [], str(tmp_path), timeout=0, measuring="m")
    assert got == report
    row = mesh_sweep.row("baseline", [], got)
    assert row["gb_per_chip"] == 30.5 and row["comm_gb_per_chip"] == 200.0
    line = mesh_sweep.markdown([row], "v5p:8x16x16").splitlines()[-1]
    assert line == "| baseline | 128 x 8 x 2 | full | a2a | 1 | 30.5 | True | 3.25 | 200.0 | 2.50 | 1.25 | 6.50 | 0.210 |"
