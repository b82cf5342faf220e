"""The RL run's starting point: find the SFT run's final checkpoint, or make it with train.py's loop.

    python -m glm5_jax.rl.sft --config=configs/rl_sort.py --workdir=W     # what the supervisor runs first
"""
from __future__ import annotations

import logging

from glm5_jax import storage
from glm5_jax.model.moe.layer import BIAS_COLLECTION
from glm5_jax.platforms import skip_absent_tpu
from glm5_jax.rl.config import sft_checkpoint_dir

log = logging.getLogger("glm5_jax.rl")


def final_sft_step(sft_cfg, sft_workdir: str) -> int | None:
    """The SFT run's last step if its checkpoint is committed, else None."""
    step = sft_cfg.train.steps
    return step if storage.isfile(storage.join(sft_checkpoint_dir(sft_workdir), str(step), "commit_success.txt")) \
        else None


def ensure_sft(sft_cfg, sft_workdir: str, exp=None) -> int:
    """Trains (or finishes training) the SFT run unless its final checkpoint exists; returns its step.
    For a multi-turn environment (`exp.is_agentic`) the SFT clones the environment's scripted teacher
    (glm5_jax.rl.agentic_sft) instead of running train.py's loop."""
    step = final_sft_step(sft_cfg, sft_workdir)
    if step is None:
        log.info("no finished SFT checkpoint in %s: training it (%d steps)", sft_workdir, sft_cfg.train.steps)
        if exp is not None and exp.is_agentic:
            from glm5_jax.rl.agentic_sft import train_teacher_sft

            train_teacher_sft(sft_cfg, sft_workdir, exp.rl.task, exp.agentic)
        else:
            from glm5_jax.train.loop import run_training

            run_training(sft_cfg, sft_workdir)
        step = final_sft_step(sft_cfg, sft_workdir)
        if step is None:
            raise RuntimeError(f"SFT training finished but {sft_checkpoint_dir(sft_workdir)} has no step "
                               f"{sft_cfg.train.steps}")
    return step


def load_sft_variables(sft_cfg, sft_workdir: str, policy) -> dict:
    """{"params", "moe_bias"} of the final SFT step, placed on `policy`'s mesh (train.init_from's reader:
    only the weights are read, and a model that does not fit names the first differing parameter)."""
    from glm5_jax.train.init_from import load_weights

    if final_sft_step(sft_cfg, sft_workdir) is None:
        raise FileNotFoundError(f"no finished SFT checkpoint (step {sft_cfg.train.steps}) under "
                                f"{sft_checkpoint_dir(sft_workdir)}")
    weights, _ = load_weights(sft_workdir, policy.abstract_variables)
    return {"params": weights["params"], BIAS_COLLECTION: weights.get("moe_bias", {})}


def main(argv):
    skip_absent_tpu()
    from absl import flags

    from glm5_jax.rl.config import load_rl_config, resolve_sft
    from glm5_jax.rl.logs import setup_logging

    setup_logging("sft")
    exp = load_rl_config(flags.FLAGS.config, flags.FLAGS.set)
    sft_cfg, sft_workdir = resolve_sft(exp, flags.FLAGS.workdir)
    ensure_sft(sft_cfg, sft_workdir, exp)


if __name__ == "__main__":
    from absl import app

    from glm5_jax.rl.flags import define_common_flags

    define_common_flags()
    app.run(main)
