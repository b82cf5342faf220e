"""Multi-turn RL through policy servers: the environments, their episode seeds, and the generator that
plays a batch of episodes over HTTP.

    python -m glm5_jax.rl.run --config=configs/rl_guess.py --workdir=W     # supervisor: all processes

Processes (each restartable at any moment): the learner (unchanged: reads rollout files, trains,
commits versions), policy servers (`glm5_jax.rl.policy_server`: the serving engine, hot-reloading
each committed version), a router in front of them (`glm5_jax.serve.router`), and generators
(`python -m glm5_jax.rl.generator`, which runs `EpisodeGenerator` when rl.task is an environment).

Batch `seq` of generator `g` has global ordinal o = seq * num_generators + g, as in single-turn RL.
It holds rl.prompts_per_batch groups of rl.group_size episodes; a group shares one environment seed
(GRPO compares its episodes with each other). Environment seeds and sampling seeds are pure functions
of (rl.seed, o), so a run with another number of generators or a restarted generator plays the same
episodes for the same ordinal. Every episode runs in its own thread: while one waits for its tool
(`agentic.step_latency_s`), the server decodes the others.

Each turn asks the server for weights at least as new as the version the batch was started with
(`min_weights_version`), so the staleness bound holds: the learner drops a batch whose oldest turn is
more than rl.tau versions behind. In lockstep (rl.tau = 0) batch o must be played entirely by version o.
With rl.inflight_updates the server swaps versions between decode steps and keeps the episode's cache rows,
each token records its version, and the learner masks tokens more than rl.tau behind instead.
"""
from __future__ import annotations

import concurrent.futures
import time

import numpy as np

from glm5_jax.model import routing_replay
from glm5_jax.rl import rollouts as ro
from glm5_jax.rl.config import resolve_sft
from glm5_jax.rl.env import Environment, Episode, ServerPolicy, ToolLatency, episodes_to_batch, run_episode
from glm5_jax.rl.number_guess import NumberGuess
from glm5_jax.rl.policy import replayed, rl_model_config
from glm5_jax.rl.rollout_generator import Generator

_ENV_SALT, _SAMPLING_SALT, _SFT_SALT = 0xE5, 0x5A, 0x5F
TURN_SEED_STRIDE = 64            # an episode's turn t samples with seed base + t (t < max_turns <= 64)


def make_env(name: str, agentic) -> Environment:
    """A fresh environment (episodes run in parallel threads: one instance each), without latency."""
    if name == "number_guess":
        return NumberGuess(digits=agentic.digits)
    raise ValueError(f"rl.task={name!r} is not a multi-turn environment")


def stop_token_ids(env: Environment) -> list[int]:
    return [env.tokens.end]


def env_seeds(seed: int, ordinal: int, n: int) -> list[int]:
    """The environment seeds of the n groups of batch `ordinal`."""
    return [int(s) for s in np.random.default_rng([seed, _ENV_SALT, ordinal]).integers(0, 2 ** 31, n)]


def sampling_seed(seed: int, ordinal: int, row: int) -> int:
    """The server sampling seed of episode `row` of batch `ordinal` (turn t adds t)."""
    return int(np.random.default_rng([seed, _SAMPLING_SALT, ordinal, row]).integers(0, 2 ** 31 - TURN_SEED_STRIDE))


def sft_seed(seed: int, index: int) -> tuple[int, np.random.Generator]:
    """(environment seed, teacher noise generator) of SFT demonstration `index`: a stream disjoint from RL's."""
    rng = np.random.default_rng([seed, _SFT_SALT, index])
    return int(rng.integers(0, 2 ** 31)), rng


def routing_shapes(exp, model_cfg, prompt_width: int) -> dict | None:
    """The record's routing fields of a run with rl.replay_* ({name: (L, X)} over rows of the prompt width and
    the episodes' completion width), None without."""
    names = replayed(exp.rl)
    if not names:
        return None
    return routing_replay.record_shapes(model_cfg, prompt_width + exp.agentic.completion_width, names)


def empty_batch(exp, model_cfg) -> ro.RolloutBatch:
    """A batch of the run's shape with nothing in the loss: the learner compiles its update on it while
    the first episodes are played."""
    rl, ag = exp.rl, exp.agentic
    n = rl.prompts_per_batch * rl.group_size
    episode = Episode(prompt=make_env(rl.task, ag).reset(0))
    return episodes_to_batch([episode] * n, np.zeros(n), {}, completion_width=ag.completion_width,
                             turns_width=ag.max_turns,
                             routing_shapes=routing_shapes(exp, model_cfg, len(episode.prompt)))


class EpisodeGenerator(Generator):
    """A generator whose batches are multi-turn episodes played through the policy server at `policy_url`."""

    def __init__(self, exp, workdir: str, generator_id: int, policy_url: str):
        self.policy_url, self.exp = policy_url, exp
        # with rl.replay_*: the model's config, for the record's routing shapes (the server samples)
        self.model_cfg = rl_model_config(resolve_sft(exp, workdir)[0].model) if replayed(exp.rl) else None
        super().__init__(exp, workdir, generator_id, sft_cfg=None)

    def _init_sampler(self, exp, sft_cfg):
        import httpx2

        self.agentic, self.env_name = exp.agentic, exp.rl.task
        episodes = self.rl.prompts_per_batch * self.rl.group_size
        self.http = httpx2.Client(timeout=600.0, limits=httpx2.Limits(max_connections=episodes + 4))
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=episodes, thread_name_prefix="episode")

    def _play(self, ordinal: int, row: int, env_seed: int, version: int):
        rl, ag = self.rl, self.agentic
        env = make_env(self.env_name, ag)
        policy = ServerPolicy(self.policy_url, temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k,
                              seed=sampling_seed(rl.seed, ordinal, row), min_weights_version=version,
                              retry_s=ag.retry_s, client=self.http, return_routing=bool(replayed(rl)))
        episode = run_episode(policy, ToolLatency(env, ag.step_latency_s), env_seed, max_turns=ag.max_turns,
                              max_action_tokens=ag.max_action_tokens, stop_token_ids=stop_token_ids(env))
        return episode, policy.retries

    def sample(self, seq: int, version: int) -> ro.RolloutBatch:
        rl, ag = self.rl, self.agentic
        t0 = time.perf_counter()
        ordinal = seq * rl.num_generators + self.gen
        seeds = np.repeat(env_seeds(rl.seed, ordinal, rl.prompts_per_batch), rl.group_size)  # groups contiguous
        played = list(self.pool.map(lambda row: self._play(ordinal, row, int(seeds[row]), version),
                                    range(len(seeds))))
        episodes = [e for e, _ in played]
        turn_versions = sorted({v for e in episodes for v in e.weights_versions})
        if rl.lockstep and turn_versions != [version]:
            raise RuntimeError(f"lockstep batch {ordinal} was played with versions {turn_versions}, not {version}")
        meta = {"generator": self.gen, "seq": seq, "ordinal": ordinal, "version": version,
                "sampler": {"temperature": rl.temperature, "top_p": rl.top_p, "top_k": rl.top_k,
                            "max_new_tokens": ag.max_action_tokens, "group_size": rl.group_size,
                            "max_turns": ag.max_turns},
                "seed": rl.seed, "episodes": [int(s) for s in seeds[::rl.group_size]],
                "turns": [e.turns for e in episodes], "turn_versions": turn_versions,
                "token_versions": sorted({v for e in episodes for v in e.token_versions if v >= 0}),
                "retries": sum(r for _, r in played), "step_latency_s": ag.step_latency_s,
                "sample_seconds": time.perf_counter() - t0, "written_at": time.time()}
        group_ids = ordinal * rl.prompts_per_batch + np.arange(len(seeds)) // rl.group_size
        prompt_width = max(len(e.prompt) for e in episodes)
        return episodes_to_batch(episodes, group_ids, meta, completion_width=ag.completion_width,
                                 turns_width=ag.max_turns,
                                 routing_shapes=routing_shapes(self.exp, self.model_cfg, prompt_width))
