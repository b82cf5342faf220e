"""configs/glm5_744b_long.py: each stage's documented ``--set`` items turn the final (200K) config into that stage."""
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.mark.parametrize("stage", ["32k", "128k", "200k"])
def test_stage_overrides_rebuild_the_stage(stage):
    sys.path.insert(0, ROOT)
    from configs.glm5_744b_long import STAGES, get_config, stage_config, stage_overrides
    from glm5_jax.train.experiment import apply_overrides

    items = stage_overrides(stage)
    assert apply_overrides(get_config(), items) == stage_config(stage)
    seq_len, batch, context, _ = STAGES[stage]
    cfg = stage_config(stage)
    assert (cfg.data.seq_len, cfg.data.batch_size, cfg.mesh.context) == (seq_len, batch, context)
    # every stage keeps the mesh on all 2048 chips and about 4K tokens or fewer per chip
    assert cfg.mesh.fsdp * cfg.mesh.context * cfg.mesh.expert == 2048
    assert seq_len * batch // 2048 <= 4096
    # a stage's remat policy travels as a model.* item
    assert (f"model.remat_policy={cfg.model.runtime.remat_policy}" in items) == (stage != "200k")
