"""python -m glm5_jax.rl.generator --config=configs/rl_sort.py --workdir=W --generator_id=0 [--policy_url=URL]

One generator process: `rollout_generator.Generator` for single-turn tasks, `agentic.EpisodeGenerator` (episodes
played through a policy server) when rl.task is a multi-turn environment.
"""
from __future__ import annotations

from absl import app, flags

from glm5_jax.platforms import skip_absent_tpu
from glm5_jax.rl.agentic import EpisodeGenerator
from glm5_jax.rl.config import load_rl_config, resolve_sft
from glm5_jax.rl.flags import define_common_flags
from glm5_jax.rl.logs import setup_logging
from glm5_jax.rl.rollout_generator import Generator


def main(argv):
    skip_absent_tpu()
    setup_logging(f"gen{flags.FLAGS.generator_id}")
    exp = load_rl_config(flags.FLAGS.config, flags.FLAGS.set)
    if exp.is_agentic:
        if not flags.FLAGS.policy_url:
            raise app.UsageError(f"rl.task={exp.rl.task!r} is played through a policy server: give --policy_url")
        EpisodeGenerator(exp, flags.FLAGS.workdir, flags.FLAGS.generator_id, flags.FLAGS.policy_url).run()
        return
    sft_cfg, _ = resolve_sft(exp, flags.FLAGS.workdir)
    Generator(exp, flags.FLAGS.workdir, flags.FLAGS.generator_id, sft_cfg).run()


if __name__ == "__main__":
    define_common_flags()
    flags.DEFINE_integer("generator_id", 0, "This generator's index in [0, rl.num_generators).")
    flags.DEFINE_string("policy_url", None, "Multi-turn environments: the policy server (or router) to play through.")
    app.run(main)
