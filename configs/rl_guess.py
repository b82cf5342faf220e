"""Multi-turn RL demo: number guessing (glm5_jax.rl.number_guess, one digit, at most 4 guesses) played
through a policy server, GRPO over groups of 8 episodes of one secret, reward 1 for finding it, GLM-5
direct double-sided IS, staleness bound tau=2, 2 generators; the start is configs/guess_sft.py's clone of
a noisy teacher (made on first use). Each environment step sleeps 1.5 s, standing for a tool call.

    python -m glm5_jax.rl.run --config=configs/rl_guess.py --workdir=/tmp/glm5_rl_guess
    python -m glm5_jax.rl.run --config=configs/rl_guess.py --workdir=W --set=rl.lockstep=True --set=rl.tau=0
"""
from glm5_jax.rl.config import AgenticConfig, RLConfig, RLExperiment


def get_config() -> RLExperiment:
    rl = RLConfig(task="number_guess", num_versions=25, tau=2, num_generators=2, prompts_per_batch=8, group_size=8,
                  temperature=1.0, loss="dis", eps_low=0.2, eps_high=0.2, learning_rate=1e-3, b2=0.99,
                  clip_norm=1.0, eval_every=0)
    agentic = AgenticConfig(digits=1, max_turns=4, step_latency_s=1.5, num_servers=1, server_max_batch=64,
                            teacher_noise=0.4)
    return RLExperiment(rl=rl, sft_config="configs/guess_sft.py", agentic=agentic)
