"""SFT for a multi-turn environment: behaviour cloning of a noisy scripted teacher's episodes.

The teacher (`number_guess.teacher_guess`) plays binary search but guesses at random in a share
`agentic.teacher_noise` of its turns, so the cloned policy wins only some episodes and RL has room to
improve it. The loss is the mean negative log-likelihood of the teacher's action tokens given the
episode so far; the environment's tokens are context only (loss mask 0), exactly as in the RL batches.
The model trained is the RL policy's (`rl_model_config`), and the result is written as a train.py-style
checkpoint (``<sft_workdir>/checkpoints/<steps>/{state, meta}``), which the learner, `load_for_inference`
and `python -m glm5_jax.serve` read like any other.
"""
from __future__ import annotations

import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.core import meta as flax_meta

from glm5_jax.generate.decoding import Sampler
from glm5_jax.model.moe.layer import BIAS_COLLECTION
from glm5_jax.parallel.mesh import build_mesh
from glm5_jax.rl.agentic import make_env, sft_seed, stop_token_ids
from glm5_jax.rl.env import Sampled, episodes_to_batch, run_episode
from glm5_jax.rl.number_guess import teacher_guess
from glm5_jax.rl.policy import Policy, completion_logprobs, rl_model_config
from glm5_jax.train.optim import clipped

log = logging.getLogger("glm5_jax.rl")
SFT_SOURCE = "number_guess"          # DataConfig.source of an SFT config for the number_guess environment


def teacher_episodes(env_name: str, agentic, seed: int, first: int, n: int):
    """Demonstrations first .. first + n - 1 (each a pure function of (seed, index))."""
    episodes = []
    for index in range(first, first + n):
        env = make_env(env_name, agentic)
        env_seed, rng = sft_seed(seed, index)

        def teacher(context, max_tokens, stop_ids, env=env, rng=rng):
            action = env.encode_guess(teacher_guess(env, context, agentic.teacher_noise, rng))
            return Sampled(action, [0.0] * len(action))

        episodes.append(run_episode(teacher, env, env_seed, max_turns=agentic.max_turns,
                                    max_action_tokens=agentic.max_action_tokens, stop_token_ids=stop_token_ids(env)))
    return episodes


def _sft_step_fn(policy: Policy, tx):
    def loss_fn(params, variables, batch):
        logp = completion_logprobs(policy.model, {**variables, "params": params}, batch["prompt_tokens"],
                                   batch["prompt_lengths"], batch["completion_tokens"], batch["completion_lengths"],
                                   Sampler(temperature=1.0))
        return -jnp.sum(logp * batch["loss_mask"]) / jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)

    def step(variables, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(variables["params"], variables, batch)
        updates, opt_state = tx.update(grads, opt_state, variables["params"])
        return {**variables, "params": optax.apply_updates(variables["params"], updates)}, opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def train_teacher_sft(sft_cfg, sft_workdir: str, env_name: str, agentic) -> int:
    """Trains sft_cfg.train.steps steps on teacher episodes (sft_cfg.data.batch_size per step) and writes
    the final checkpoint; returns its step."""
    import orbax.checkpoint as ocp

    from glm5_jax.checkpoint.run import config_as_json
    from glm5_jax.rl.config import sft_checkpoint_dir

    if sft_cfg.data.source != SFT_SOURCE:
        raise ValueError(f"an SFT config for {env_name!r} needs data.source={SFT_SOURCE!r}, "
                         f"got {sft_cfg.data.source!r}")
    train, batch_size = sft_cfg.train, sft_cfg.data.batch_size
    policy = Policy(rl_model_config(sft_cfg.model), build_mesh(sft_cfg.mesh), sft_cfg.mesh.rules)
    with policy.context():
        boxed = jax.jit(policy.model.init)(jax.random.PRNGKey(train.seed), jnp.zeros((1, 8), jnp.int32))
    unboxed = flax_meta.unbox(boxed)
    variables = jax.device_put({"params": unboxed["params"], BIAS_COLLECTION: unboxed.get(BIAS_COLLECTION, {})},
                               policy.shardings)
    schedule = optax.linear_schedule(0.0, train.learning_rate, max(train.warmup_steps, 1))
    tx = clipped(optax.adam(schedule, b1=train.b1, b2=train.b2), train.clip_norm)
    opt_state = jax.jit(tx.init)(variables["params"])
    opt_shardings = jax.tree.map(lambda a: a.sharding, policy.abstract_opt_state(tx))
    step_fn = _sft_step_fn(policy, tx)
    t0, wins, loss = time.perf_counter(), [], float("nan")
    for step in range(train.steps):
        episodes = teacher_episodes(env_name, agentic, train.seed, step * batch_size, batch_size)
        wins += [e.reward for e in episodes]
        batch = episodes_to_batch(episodes, np.zeros(batch_size), {}, completion_width=agentic.completion_width,
                                  turns_width=agentic.max_turns)
        arrays = {k: jnp.asarray(getattr(batch, k)) for k in ("prompt_tokens", "prompt_lengths", "completion_tokens",
                                                               "completion_lengths", "loss_mask")}
        # the same placement every step (as the learner does), so the step compiles once
        variables = jax.device_put(variables, policy.shardings)
        opt_state = jax.device_put(opt_state, opt_shardings)
        with policy.context():
            variables, opt_state, loss = step_fn(variables, opt_state, arrays)
        if (step + 1) % train.log_every == 0 or step + 1 == train.steps:
            log.info("teacher SFT step %d/%d: loss %.4f (%.1f s)", step + 1, train.steps, float(loss),
                     time.perf_counter() - t0)
    summary = {"config": config_as_json(sft_cfg),
               "teacher": {"env": env_name, "noise": agentic.teacher_noise, "success_rate": float(np.mean(wins)),
                           "episodes": len(wins)}, "final_loss": float(loss)}
    manager = ocp.CheckpointManager(sft_checkpoint_dir(sft_workdir), item_names=("state", "meta"),
                                    options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False))
    manager.save(train.steps, args=ocp.args.Composite(state=ocp.args.StandardSave(variables),
                                                      meta=ocp.args.JsonSave(summary)))
    manager.wait_until_finished()
    manager.close()
    log.info("teacher SFT done: teacher success rate %.3f over %d demos, final loss %.4f, in %s",
             summary["teacher"]["success_rate"], len(wins), float(loss), os.path.abspath(sft_workdir))
    return train.steps
