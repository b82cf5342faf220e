"""Asynchronous RL: generators and a learner that hand over policies through orbax checkpoints and
rollouts through atomically written files (docs/training.md#async-rl, #async-rl).

    python -m glm5_jax.rl.run --config=configs/rl_sort.py --workdir=W [--generators=N]
"""
