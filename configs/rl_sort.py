"""Async RL on the sorting task (docs/training.md#the-sort-task): GRPO with an exact-match reward, GLM-5 direct
double-sided IS, staleness bound tau=2, starting from configs/sort_sft.py's checkpoint (made on first use).

    python -m glm5_jax.rl.run --config=configs/rl_sort.py --workdir=/tmp/glm5_rl_sort
"""
from glm5_jax.rl.config import RLConfig, RLExperiment


def get_config() -> RLExperiment:
    rl = RLConfig(task="sort", num_versions=60, tau=2, num_generators=1, prompts_per_batch=32, group_size=8,
                  temperature=1.0, max_new_tokens=7, loss="dis", eps_low=0.2, eps_high=0.2,
                  learning_rate=3e-5, b2=0.99, clip_norm=1.0, eval_every=5, eval_prompts=512)
    return RLExperiment(rl=rl, sft_config="configs/sort_sft.py")
