"""RL configuration: the async loop's knobs (`RLConfig`) and the experiment around them (`RLExperiment`).

A config file defines ``get_config() -> RLExperiment``; ``--set=rl.tau=0`` etc. override fields with
the same typed dotted syntax as train.py. The model is the SFT run's model (`sft_config`), so the RL
policy is always the architecture that produced its starting checkpoint.
"""
from __future__ import annotations

import dataclasses
import os
import typing

from glm5_jax import storage
from glm5_jax.model.config import DTYPES, SamplerDispatch, SamplerKernels
from glm5_jax.parallel.mesh import MeshConfig
from glm5_jax.parallel.sampling import parse_mesh_spec
from glm5_jax.train.experiment import apply_overrides, load_config_file

LOSSES = ("dis", "icepop", "ppo_clip")
SAMPLER_KERNELS, SAMPLER_DISPATCHES = typing.get_args(SamplerKernels), typing.get_args(SamplerDispatch)


def sft_checkpoint_dir(sft_workdir: str) -> str:
    """Where the SFT run that starts an RL run keeps its orbax checkpoints."""
    return storage.join(storage.absolute(sft_workdir), "checkpoints")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    task: str = "sort"                  # a name in glm5_jax.rl.tasks.TASKS
    num_versions: int = 60              # learner updates; the run ends when version num_versions is published
    tau: int = 2                        # staleness bound (τ in the GLM-5 report; AReaL's η): version lag allowed
    lockstep: bool = False              # batch o uses exactly version max(0, o - tau): bit-reproducible
    num_generators: int = 1             # fixed for a run (it defines the global batch order)
    # in-flight weight updates (PipelineRL, AReaL's interruptible rollouts; docs/rl.md#in-flight-weight-updates):
    # a generator swaps to a newer version between decode steps, keeping the cache rows computed so far, each
    # token records the version that sampled it, and the learner masks tokens more than tau versions behind
    # (per token) instead of dropping whole batches; False: a batch is sampled under one version
    inflight_updates: bool = False
    # sampling (TITO: the learner trains on exactly these tokens and their recorded logprobs)
    prompts_per_batch: int = 32
    group_size: int = 8                 # G completions per prompt (GRPO group)
    temperature: float = 1.0
    top_p: float = 1.0                  # top_p / top_k truncate the sampling distribution; the learner's
    top_k: int = 0                      # log-probs renormalise over the same kept set (ratio 1 on-policy)
    max_new_tokens: int = 7
    # compute dtype of the sampler's forward passes ("": the model's own); the learner always computes in
    # the model's dtype, so e.g. "bfloat16" against a float32 model measures the sampler/learner precision
    # mismatch (the per-version keep_fraction and ratio_dev = mean |r - 1| in rl_metrics.jsonl)
    sampler_dtype: str = ""
    # the generators' and policy servers' own sampling mesh (glm5_jax.parallel.sampling, e.g.
    # "data:2,expert:2,tensor:2": weights resident, experts over expert, heads over tensor), not the learner's
    # training mesh; "": one device
    sampler_mesh: str = ""
    # the generators' and policy servers' decode steps (RuntimeConfig.sampler_kernels, docs/inference.md#the-
    # samplers-decode-kernels): "xla" or the decode program's kernels ("pallas" on TPU, "pallas_interpret" on CPU),
    # with sampler_dispatch "gather" (a few rows a chip) or "a2a_decode" (many)
    sampler_kernels: str = "xla"
    sampler_dispatch: str = "gather"
    sampler_capacity: float = 0.0           # the dispatch's capacity factor (0: nothing dropped)
    # the policy handoff (docs/rl.md#weights-only-policy-handoff): a version carries the sampler's weights only,
    # in handoff_dtype ("": sampler_dtype, else the model's compute dtype), the routed experts INT4-packed when
    # handoff_int4_experts (generators then run the quant="int4" model); the learner's own resume state is
    # saved every learner_state_every versions (and at the last) in <workdir>/learner/
    handoff_dtype: str = ""
    handoff_int4_experts: bool = False
    # routing replay (docs/rl.md#routing-replay, glm5_jax/model/routing_replay.py): the sampler records with each
    # token the experts every MoE layer routed it to (replay_experts) and the slots every full-indexer layer
    # selected for it (replay_topk); the learner's forward takes those choices instead of recomputing them
    replay_experts: bool = False
    replay_topk: bool = False
    learner_state_every: int = 1
    # loss (docs/training.md#policy-losses): "dis" GLM-5 direct double-sided IS, "icepop" GLM-5 reasoning RL, "ppo_clip"
    loss: str = "dis"
    eps_low: float = 0.2
    eps_high: float = 0.2
    icepop_beta: float = 2.0
    advantage_std_norm: bool = True     # GRPO (R - mean) / std; False: GLM-5 agentic mean baseline only
    # optimisation
    learning_rate: float = 3e-5
    b1: float = 0.9
    b2: float = 0.99
    clip_norm: float = 1.0
    reset_optimizer_on_publish: bool = False   # the GLM-5 report resets the optimizer after each weight push
    # bookkeeping
    seed: int = 0
    eval_every: int = 5                 # versions between sampled exact-match evals (0: never)
    eval_prompts: int = 512
    max_to_keep: int = 0                # orbax versions kept; 0: tau + 3 (docs/training.md#batch-order-and-staleness)
    max_ready: int = 4                  # unconsumed rollout files a generator may have in ready/
    poll_seconds: float = 0.02
    # jax.profiler trace of updates [profile_start, profile_start + profile_steps) (0-based update indices)
    # into <workdir>/tb/plugins/profile/ (glm5_jax.telemetry.profiler); profile_steps=0: no trace
    profile_start: int = 2
    profile_steps: int = 0

    def validate(self):
        def need(ok, field, why):
            if not ok:
                raise ValueError(f"rl.{field}={getattr(self, field)!r}: {why}")
        for f in ("num_versions", "num_generators", "prompts_per_batch", "group_size", "max_new_tokens",
                  "eval_prompts", "max_ready"):
            need(getattr(self, f) >= 1, f, "must be >= 1")
        need(self.tau >= 0, "tau", "must be >= 0")
        need(not (self.inflight_updates and self.lockstep), "inflight_updates",
             "lockstep batches are sampled under exactly one version: use rl.lockstep=False")
        need(self.group_size >= 2, "group_size", "a GRPO group needs >= 2 completions")
        need(self.loss in LOSSES, "loss", f"must be one of {LOSSES}")
        need(0 <= self.eps_low < 1 and self.eps_high > 0, "eps_low", "need 0 <= eps_low < 1 and eps_high > 0")
        need(self.icepop_beta > 1, "icepop_beta", "must be > 1")
        need(self.temperature > 0, "temperature", "must be > 0")
        need(0 < self.top_p <= 1, "top_p", "must lie in (0, 1]")
        need(self.top_k >= 0, "top_k", "must be >= 0")
        need(self.sampler_dtype in ("", *DTYPES), "sampler_dtype", f"must be '' or one of {DTYPES}")
        parse_mesh_spec(self.sampler_mesh)         # MeshError naming what is wrong with the spec
        need(self.sampler_kernels in SAMPLER_KERNELS, "sampler_kernels", f"must be one of {SAMPLER_KERNELS}")
        need(self.sampler_dispatch in SAMPLER_DISPATCHES, "sampler_dispatch", f"must be one of {SAMPLER_DISPATCHES}")
        need(self.sampler_capacity >= 0, "sampler_capacity", "must be >= 0 (0: nothing dropped)")
        need(self.sampler_kernels == "xla" or not (self.replay_experts or self.replay_topk), "sampler_kernels",
             "routing replay records the routing in the per-layer cache writes of the 'xla' decode steps")
        need(self.handoff_dtype in ("", *DTYPES), "handoff_dtype", f"must be '' or one of {DTYPES}")
        need(self.learner_state_every >= 1, "learner_state_every", "must be >= 1")
        need(self.eval_every >= 0, "eval_every", "must be >= 0")
        need(self.profile_start >= 0 and self.profile_steps >= 0, "profile_steps",
             "profile_start and profile_steps must be >= 0")
        need(self.max_to_keep == 0 or self.max_to_keep >= self.tau + 2, "max_to_keep",
             f"must be 0 (auto) or >= tau + 2 = {self.tau + 2} so a lockstep generator finds its version")
        need(self.learning_rate > 0, "learning_rate", "must be > 0")

    @property
    def keep_versions(self) -> int:
        return self.max_to_keep or self.tau + 3


@dataclasses.dataclass(frozen=True)
class AgenticConfig:
    """Multi-turn RL (rl.task names an environment, glm5_jax.rl.tasks.ENVIRONMENTS): generators play
    episodes through policy servers that hot-reload each version (glm5_jax.rl.agentic)."""
    digits: int = 1                     # number_guess: the secret lies in [0, 10**digits)
    max_turns: int = 4                  # an episode ends after this many actions
    step_latency_s: float = 0.0         # each environment step sleeps this long (a real tool's latency)
    num_servers: int = 1                # policy server processes behind one router
    server_max_batch: int = 32          # cache rows per server (concurrent episodes it decodes at once)
    reload_interval_s: float = 0.05     # how often a server polls for a newer committed version
    retry_s: float = 300.0              # a generator retries an unanswered turn this long, then fails
    teacher_noise: float = 0.5          # the SFT teacher's share of random guesses (number_guess.teacher_guess)

    @property
    def max_action_tokens(self) -> int:
        return self.digits + 1          # the digits, then the end token

    @property
    def completion_width(self) -> int:
        """Longest completion: every turn's action and the observation after it (an episode that runs
        out of turns ends with the answer to its last guess)."""
        return self.max_turns * (self.max_action_tokens + 1)

    def validate(self):
        for f in ("digits", "max_turns", "num_servers", "server_max_batch"):
            if getattr(self, f) < 1:
                raise ValueError(f"agentic.{f}={getattr(self, f)}: must be >= 1")
        if self.step_latency_s < 0 or self.reload_interval_s <= 0 or self.retry_s < 0:
            raise ValueError("agentic.step_latency_s and retry_s must be >= 0, reload_interval_s > 0")
        if not 0 <= self.teacher_noise <= 1:
            raise ValueError(f"agentic.teacher_noise={self.teacher_noise}: must lie in [0, 1]")


@dataclasses.dataclass(frozen=True)
class RLExperiment:
    rl: RLConfig = RLConfig()
    sft_config: str = "configs/sort_sft.py"   # train.py config of the starting policy (and its model)
    sft_workdir: str = ""                      # where its checkpoint is found or made; "": <workdir>/sft
    mesh: MeshConfig = MeshConfig(data=1, fsdp=-1)
    agentic: AgenticConfig = AgenticConfig()   # used when rl.task is a multi-turn environment

    @property
    def is_agentic(self) -> bool:
        from glm5_jax.rl.tasks import is_environment

        return is_environment(self.rl.task)

    def validate(self):
        self.rl.validate()
        if self.is_agentic:
            self.agentic.validate()
            if self.rl.eval_every:
                raise ValueError("rl.eval_every must be 0 for a multi-turn environment: its success rate is "
                                 "the batches' mean reward (rl_metrics.jsonl mean_reward)")
            if self.rl.lockstep and self.rl.tau:
                raise ValueError("rl.lockstep with a policy server needs rl.tau=0: a server serves its newest "
                                 "version, so batch o can only be pinned to version o")
        return self


def load_rl_config(path: str, overrides=()) -> RLExperiment:
    return apply_overrides(load_config_file(path, RLExperiment), list(overrides)).validate()


def resolve_sft(exp: RLExperiment, workdir: str, config_dir: str | None = None):
    """(SFT ExperimentConfig, absolute SFT workdir). A relative sft_config is looked up from the current
    directory, then from the repository root."""
    path = exp.sft_config
    if not os.path.isabs(path) and not os.path.isfile(path):
        root = config_dir or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.path.join(root, path)
    sft_workdir = storage.absolute(exp.sft_workdir or storage.join(workdir, "sft"))
    return load_config_file(path), sft_workdir
