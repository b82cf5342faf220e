"""The learner: consumes rollout batches in global order, trains, publishes each policy version.

    python -m glm5_jax.rl.learner --config=configs/rl_sort.py --workdir=W

Batch order (docs/training.md#batch-order-and-staleness): global ordinal o = seq * num_generators + generator,
consumed strictly
in increasing o. For each batch:
* a file that fails its checksum is moved to rollouts/rejected/ and counted (`rejected_corrupt`);
* a batch sampled with a version older than current − tau is dropped and counted (`dropped_stale`,
  the GLM-5 report); with rl.inflight_updates the rule is per token: tokens sampled more than tau versions
  behind leave the loss, and only a batch with no token left is dropped;
* otherwise one update with the configured loss; version v+1 is published as one orbax step holding the
  sampler's weights (glm5_jax.checkpoint.handoff.sampler_variables) and meta {watermark, ledger of every
  consumed ordinal, counters, RNG, the model config}; every rl.learner_state_every versions the learner's
  own state (variables, optimizer state, the same meta) is saved to <workdir>/learner/ as one orbax step
  (docs/training.md#params-optimiser-and-meta-commit-together, docs/rl.md#weights-only-policy-handoff).
Rollout files are deleted only once a *committed learner state's* watermark covers them
(docs/training.md#files-are-deleted-only-behind-a-committed-watermark), so a learner
killed at any moment resumes from its latest committed learner state and re-reads what it needs; the
versions it re-trains that are already published are not written again (the update is deterministic).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from glm5_jax import storage
from glm5_jax.checkpoint.handoff import LearnerCheckpoints, PolicyWriter, is_committed, sampler_variables
from glm5_jax.checkpoint.stored_config import config_to_json
from glm5_jax.generate.decoding import Sampler, generate
from glm5_jax.parallel.mesh import build_mesh
from glm5_jax.platforms import skip_absent_tpu
from glm5_jax.rl import rollouts as ro
from glm5_jax.rl.config import RLConfig
from glm5_jax.rl.loss import group_advantages, policy_loss
from glm5_jax.rl.policy import Policy, completion_logprobs, params_sha256, replayed, rl_model_config
from glm5_jax.rl.tasks import make_task
from glm5_jax.telemetry import StepProfiler
from glm5_jax.train.optim import clipped

log = logging.getLogger("glm5_jax.rl")
METRICS = "rl_metrics.jsonl"
SUMMARY = "rl_summary.json"
EVAL_SALT = 0x5EED


def make_optimizer(rl) -> optax.GradientTransformation:
    """Adam at a constant learning rate without weight decay (the frozen indexer and routing bias get zero
    updates), clipped; unlike training's `make_optimizer` no schedule, decay mask or stage labels."""
    return clipped(optax.adam(rl.learning_rate, b1=rl.b1, b2=rl.b2), rl.clip_norm)


def ordinal_of(generator: int, seq: int, num_generators: int) -> int:
    return seq * num_generators + generator


def split_ordinal(ordinal: int, num_generators: int) -> tuple[int, int]:
    """(generator, seq) of a global ordinal."""
    return ordinal % num_generators, ordinal // num_generators


def oldest_version(batch_versions) -> int:
    """The oldest policy version that produced any token of the batch. Multi-turn rows list one version
    per turn, padded with -1 (glm5_jax.rl.env.episodes_to_batch), which is not a version."""
    versions = np.asarray(batch_versions)
    return int(np.min(versions[versions >= 0]))


def staleness_of(version: int, batch_versions) -> int:
    """Learner version minus the oldest policy version that produced any sample of the batch."""
    return int(version - oldest_version(batch_versions))


def admit(version: int, batch_versions, tau: int) -> bool:
    """As in the GLM-5 report: a sample is dropped if w' - w0 > tau."""
    return staleness_of(version, batch_versions) <= tau


def fresh_tokens(version: int, token_versions_NC, tau: int) -> np.ndarray:
    """float32 [N, C]: 1 on tokens sampled at most tau versions behind `version`, the per-token staleness rule
    of in-flight weight updates (docs/rl.md#in-flight-weight-updates); 0 on older tokens and on -1 (not
    sampled by the policy)."""
    v = np.asarray(token_versions_NC)
    return ((v >= 0) & (version - v <= tau)).astype(np.float32)


def mask_stale_tokens(batch: ro.RolloutBatch, version: int, tau: int) -> tuple[ro.RolloutBatch, dict]:
    """(the batch with tokens more than tau versions behind `version` taken out of its loss mask, counts):
    tokens {in the loss, masked as stale}, the oldest version and the mean staleness of the tokens kept
    (None when none is)."""
    versions = batch.per_token_versions()
    fresh = fresh_tokens(version, versions, tau)
    in_loss = batch.loss_mask > 0
    kept = in_loss & (fresh > 0)
    counts = {"loss_tokens": int(in_loss.sum()), "stale_tokens": int((in_loss & ~kept).sum()),
              "oldest_kept": int(versions[kept].min()) if kept.any() else None,
              "token_staleness_mean": float(np.mean(version - versions[kept])) if kept.any() else None}
    return dataclasses.replace(batch, loss_mask=batch.loss_mask * fresh), counts


def watermark(next_ordinal: int, num_generators: int) -> dict[str, int]:
    """Per generator: the first seq not yet consumed (every ordinal below next_ordinal is)."""
    return {str(g): max(0, -(-(next_ordinal - g) // num_generators)) for g in range(num_generators)}


UPDATE_FIELDS = ("temperature", "top_p", "top_k", "loss", "eps_low", "eps_high", "icepop_beta", "learning_rate",
                 "b1", "b2", "clip_norm")


def rollout_sampler(rl) -> Sampler:
    """The distribution the generators sample from; the learner's log-probs use the same one."""
    return Sampler(rl.temperature, rl.top_p, rl.top_k)


def check_sampled_like(batch_meta: dict, rl):
    """Raise CorruptRollout unless the batch was sampled with this run's temperature / top_p / top_k:
    the importance ratio compares the learner's log-probs under those settings with the recorded ones."""
    recorded = batch_meta.get("sampler", {})
    for field in ("temperature", "top_p", "top_k"):
        if recorded.get(field) != getattr(rl, field):
            raise ro.CorruptRollout(f"sampled with {field}={recorded.get(field)!r}, the learner uses "
                                    f"rl.{field}={getattr(rl, field)!r}")


def train_step_fn(model_cfg, rl):
    """The jitted update, shared by every Learner in a process whose model and update settings agree."""
    return _train_step_fn(model_cfg, RLConfig(**{f: getattr(rl, f) for f in UPDATE_FIELDS}))


@functools.lru_cache(maxsize=4)
def _train_step_fn(model_cfg, rl):
    from glm5_jax.model.transformer import Transformer

    model, tx = Transformer(model_cfg), make_optimizer(rl)

    def train_step(variables, opt_state, batch):
        def loss_fn(params):
            logp = completion_logprobs(model, {**variables, "params": params}, batch["prompt_tokens"],
                                       batch["prompt_lengths"], batch["completion_tokens"],
                                       batch["completion_lengths"], rollout_sampler(rl), batch.get("replay"))
            return policy_loss(logp, batch["logprobs"], batch["advantages"], batch["loss_mask"], rl.loss,
                               rl.eps_low, rl.eps_high, rl.icepop_beta)

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(variables["params"])
        updates, opt_state = tx.update(grads, opt_state, variables["params"])
        params = optax.apply_updates(variables["params"], updates)
        return {**variables, "params": params}, opt_state, {**stats, "loss": loss, "grad_norm": optax.tree.norm(grads)}

    return jax.jit(train_step, donate_argnums=(1,))


class Learner:
    def __init__(self, exp, workdir: str, sft_cfg, sft_workdir: str):
        self.exp, self.rl = exp, exp.rl
        self.workdir = storage.absolute(workdir)
        self.sft_cfg, self.sft_workdir = sft_cfg, sft_workdir
        # a multi-turn environment has no held-out prompts to evaluate (its configs set eval_every=0)
        self.task = None if exp.is_agentic else make_task(self.rl.task)
        self.dirs = ro.RolloutDirs(self.workdir)
        mesh = build_mesh(exp.mesh)
        self.policy = Policy(rl_model_config(sft_cfg.model), mesh, exp.mesh.rules)
        rollout_sampler(self.rl).validate(self.policy.cfg.vocab_size)
        self.tx = make_optimizer(self.rl)
        self.writer = PolicyWriter(self.workdir, self.rl.keep_versions)
        self.state = LearnerCheckpoints(self.workdir)
        self.handoff = {"dtype": self.rl.handoff_dtype or self.rl.sampler_dtype or self.policy.cfg.jnp_dtype.name,
                        "int4_experts": self.rl.handoff_int4_experts}
        self.metrics_path = storage.join(self.workdir, METRICS)
        self._train = train_step_fn(self.policy.cfg, self.rl)
        self.abstract_opt_state = self.policy.abstract_opt_state(self.tx)
        self._opt_shardings = jax.tree.map(lambda a: a.sharding, self.abstract_opt_state)
        self.profiler = StepProfiler(storage.join(self.workdir, "tb"), self.rl.profile_start, self.rl.profile_steps,
                                     name="rl_update", before_stop=self.writer.wait)
        self._committed_next_ordinal = 0     # next_ordinal of the newest learner state known to be committed
        self._published_next_ordinal = 0     # ... of the newest learner state whose save was started

    # ------------------------------------------------------------------ state
    def _fresh_meta(self) -> dict:
        return {"version": 0, "next_ordinal": 0, "num_generators": self.rl.num_generators,
                "watermark": watermark(0, self.rl.num_generators), "ledger": [], "dropped_stale": 0,
                "rejected_corrupt": 0, "staleness_max": 0, "start_time": time.time(),
                "rng": np.asarray(jax.random.PRNGKey(self.rl.seed)).tolist()}   # unused by the update itself

    def start(self):
        """(variables, opt_state, meta) of the latest committed learner state, or version 0 = the SFT policy."""
        latest = self.state.latest_version()
        if latest is None:
            from glm5_jax.rl.sft import ensure_sft, load_sft_variables

            ensure_sft(self.sft_cfg, self.sft_workdir, self.exp)
            variables = load_sft_variables(self.sft_cfg, self.sft_workdir, self.policy)
            opt_state = jax.jit(self.tx.init)(variables["params"])
            meta = {**self._fresh_meta(), "record": {"time": time.time()}}
            self._truncate_metrics(-1)
            self._publish(0, variables, opt_state, meta)
            self._log_version(variables, meta, meta["record"])
            log.info("published version 0 (the SFT policy)")
            return variables, opt_state, meta
        variables, opt_state, meta = self.state.restore(latest, self.policy.abstract_variables,
                                                        self.abstract_opt_state)
        if meta["num_generators"] != self.rl.num_generators:
            raise ValueError(f"{self.workdir} was run with {meta['num_generators']} generators; rl.num_generators="
                             f"{self.rl.num_generators} would change the batch order. Use a new workdir.")
        if self._truncate_metrics(latest) < latest and "record" in meta:
            self._log_version(variables, meta, meta["record"])    # killed between publish and logging
        self._committed_next_ordinal = self._published_next_ordinal = meta["next_ordinal"]
        self._collect_garbage()
        log.info("resumed at version %d (next ordinal %d)", latest, meta["next_ordinal"])
        return variables, opt_state, meta

    # ------------------------------------------------------------------ training
    def train_on(self, variables, opt_state, batch: ro.RolloutBatch):
        adv = group_advantages(jnp.asarray(batch.rewards), self.rl.group_size, self.rl.advantage_std_norm)
        arrays = {name: jnp.asarray(getattr(batch, name)) for name in
                  ("prompt_tokens", "prompt_lengths", "completion_tokens", "completion_lengths", "logprobs",
                   "loss_mask")}
        if names := replayed(self.rl):       # the sampler's recorded routing, replayed by the forward
            missing = [name for name in names if getattr(batch, name) is None]
            if missing:
                raise ValueError(f"rl.replay_experts / rl.replay_topk: the rollout batch carries no {missing} (its "
                                 "generator ran without them: give generators and learner the same rl.replay_*)")
            arrays["replay"] = {name: jnp.asarray(getattr(batch, name), jnp.int32) for name in names}
        # the same placement every call (restored, freshly initialised and updated trees alike), so the
        # step compiles once; a no-op when the arrays are already there
        variables = jax.device_put(variables, self.policy.shardings)
        opt_state = jax.device_put(opt_state, self._opt_shardings)
        with self.policy.context():
            variables, opt_state, stats = self._train(variables, opt_state, {**arrays, "advantages": adv})
        if self.rl.reset_optimizer_on_publish:        # as in the GLM-5 report: reset after each weight push
            opt_state = jax.jit(self.tx.init)(variables["params"])
        return variables, opt_state, {k: float(v) for k, v in jax.device_get(stats).items()}

    # ------------------------------------------------------------------ eval
    def eval_exact_match(self, variables) -> float:
        """Mean reward of one sampled completion per fixed held-out prompt (same key every time)."""
        rl = self.rl
        prompts, lengths = self.task.eval_prompts(rl.seed, rl.eval_prompts)
        with self.policy.context():
            out = generate(self.policy.cfg, variables, prompts, lengths, max_new_tokens=rl.max_new_tokens,
                           temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k,
                           rng=jax.random.PRNGKey(rl.seed ^ EVAL_SALT), eos_ids=self.task.eos_ids)
        tokens, out_lengths = np.asarray(out.tokens), np.asarray(out.lengths)
        return float(np.mean(self.task.rewards(prompts, lengths, tokens, out_lengths)))

    # ------------------------------------------------------------------ loop
    def wait_for(self, path: str) -> float:
        """Seconds spent waiting until `path` exists in ready/ or was already moved to rejected/ (by this
        learner before a crash: it is rejected again, deterministically)."""
        start = time.perf_counter()
        rejected = storage.join(self.dirs.rejected, storage.basename(path))
        while not storage.exists(path) and not storage.exists(rejected):
            time.sleep(self.rl.poll_seconds)
        return time.perf_counter() - start

    def warm_up(self, variables, opt_state, batch: ro.RolloutBatch) -> float:
        """Compiles the update on a batch of the run's shape (results discarded, state untouched);
        seconds taken."""
        t0 = time.perf_counter()
        self.train_on(variables, jax.tree.map(jnp.copy, opt_state), batch)     # the update donates opt_state
        return time.perf_counter() - t0

    def run(self):
        rl = self.rl
        variables, opt_state, meta = self.start()
        version = meta["version"]
        if self.exp.is_agentic and version < rl.num_versions:
            from glm5_jax.rl.agentic import empty_batch

            # multi-turn batches have a fixed shape: compile while the servers play the first episodes
            log.info("update compiled in %.1f s", self.warm_up(variables, opt_state,
                                                                   empty_batch(self.exp, self.policy.cfg)))
        while version < rl.num_versions:
            ordinal = meta["next_ordinal"]
            generator, seq = split_ordinal(ordinal, rl.num_generators)
            path = self.dirs.path(generator, seq)
            wait_seconds = self.wait_for(path)
            entry = {"ordinal": ordinal, "generator": generator, "seq": seq}
            try:
                if not storage.exists(path):
                    raise ro.CorruptRollout(f"{path} was rejected before")
                batch, sha = ro.read_batch(path)
                if (batch.meta.get("generator"), batch.meta.get("seq")) != (generator, seq):
                    raise ro.CorruptRollout(f"{path} holds generator/seq {batch.meta.get('generator')}/"
                                            f"{batch.meta.get('seq')}")
                check_sampled_like(batch.meta, rl)
            except ro.CorruptRollout as e:
                log.warning("rejecting %s: %s", path, e)
                if storage.exists(path):
                    self.dirs.reject(path)
                meta = self._advance(meta, {**entry, "status": "rejected_corrupt"}, rejected=1)
                continue
            sampled_with = oldest_version(batch.versions)
            staleness = staleness_of(version, batch.versions)
            admitted, token_stats = admit(version, batch.versions, rl.tau), {}
            if rl.inflight_updates:
                # per token: tokens more than tau behind leave the loss; the batch is dropped only when no
                # token of its loss is left. sampled_with = the oldest version among the tokens trained on.
                batch, counts = mask_stale_tokens(batch, version, rl.tau)
                entry.update(oldest_version=sampled_with, stale_tokens=counts["stale_tokens"])
                if counts["loss_tokens"]:
                    admitted = counts["oldest_kept"] is not None
                if counts["oldest_kept"] is not None:
                    sampled_with, staleness = counts["oldest_kept"], version - counts["oldest_kept"]
                token_stats = {"stale_token_fraction": counts["stale_tokens"] / max(counts["loss_tokens"], 1),
                               "token_staleness_mean": counts["token_staleness_mean"]}
            entry.update(sha256=sha, sampled_with=sampled_with, trained_at=version)
            if "episodes" in batch.meta:          # multi-turn: the environment seeds played, turns per episode
                entry.update(episodes=batch.meta["episodes"], turns=batch.meta["turns"])
            if not admitted:
                log.info("dropping ordinal %d: sampled with version %d, %d > tau=%d behind", ordinal,
                         sampled_with, staleness, rl.tau)
                meta = self._advance(meta, {**entry, "status": "dropped_stale"}, dropped=1)
                continue
            t0 = time.perf_counter()
            with self.profiler.step(version):
                variables, opt_state, stats = self.train_on(variables, opt_state, batch)
            self.profiler.after_step(version, variables)
            train_seconds = time.perf_counter() - t0
            version += 1
            meta = self._advance(meta, {**entry, "status": "used"}, version=version, staleness=staleness)
            # the metrics of a version travel in its meta, so a learner killed after the publish logs them
            meta["record"] = {"mean_reward": float(np.mean(batch.rewards)), "staleness": staleness, **stats,
                              **token_stats, "sample_seconds": batch.meta.get("sample_seconds"),
                              "train_seconds": train_seconds, "wait_seconds": wait_seconds, "time": time.time()}
            t0 = time.perf_counter()
            self._publish(version, variables, opt_state, meta)
            handoff_seconds = time.perf_counter() - t0
            self._collect_garbage()
            self._log_version(variables, meta, {**meta["record"], "handoff_seconds": handoff_seconds})
        self.profiler.stop()
        self.writer.wait()
        self.state.wait()
        self._committed_next_ordinal = self._published_next_ordinal
        self._collect_garbage()
        self._write_summary(variables, meta)
        self.writer.close()
        self.state.close()

    def _advance(self, meta, entry, *, version=None, staleness=0, dropped=0, rejected=0) -> dict:
        meta = dict(meta)
        meta["next_ordinal"] += 1
        meta["watermark"] = watermark(meta["next_ordinal"], self.rl.num_generators)
        meta["ledger"] = meta["ledger"] + [entry]
        meta["dropped_stale"] += dropped
        meta["rejected_corrupt"] += rejected
        meta["staleness_max"] = max(meta["staleness_max"], staleness)
        if version is not None:
            meta["version"] = version
        return meta

    # ------------------------------------------------------------------ files
    def _publish(self, version, variables, opt_state, meta):
        meta = {**meta, "model_config": config_to_json(self.policy.cfg), "handoff": self.handoff}
        # a version re-trained after a restart from an older learner state is already published (the same
        # bits: the update is deterministic)
        if not is_committed(self.writer.directory, version):
            int4 = self.handoff["int4_experts"]
            weights = sampler_variables(variables, jnp.dtype(self.handoff["dtype"]), self.policy.cfg if int4 else None)
            # the config of the model the version's tree belongs to travels with it, so the policy alone can
            # be served or exported
            served_cfg = self.policy.cfg.replace(quant="int4") if int4 else self.policy.cfg
            self.writer.publish(version, weights, {**meta, "model_config": config_to_json(served_cfg)})
        if version % self.rl.learner_state_every == 0 or version == self.rl.num_versions:
            self.state.save(version, variables, opt_state, meta)
            # save() returns once the previous learner state has committed (orbax finishes it first)
            self._committed_next_ordinal = self._published_next_ordinal
            self._published_next_ordinal = meta["next_ordinal"]

    def _collect_garbage(self):
        """Deletes ready/ files that the watermark of a committed learner state covers.

        Background: docs/training.md#files-are-deleted-only-behind-a-committed-watermark.
        """
        limit = watermark(self._committed_next_ordinal, self.rl.num_generators)
        for g in range(self.rl.num_generators):
            for seq in self.dirs.seqs_of(g):
                if seq < limit[str(g)]:
                    try:
                        storage.remove(self.dirs.path(g, seq))
                    except FileNotFoundError:
                        pass

    def _truncate_metrics(self, version: int) -> int:
        """Drops metrics lines past `version` (logged by a learner killed before that version committed);
        returns the last version still logged (-1: none)."""
        self.metrics_log = storage.JsonlLog(self.metrics_path, keep=lambda record: record["version"] <= version)
        kept = storage.read_jsonl(self.metrics_path)
        return kept[-1]["version"] if kept else -1

    def _log_version(self, variables, meta, record):
        version = meta["version"]
        record = {"version": version, **record, "batches_consumed": meta["next_ordinal"],
                  "dropped_stale": meta["dropped_stale"], "rejected_corrupt": meta["rejected_corrupt"],
                  "staleness_max": meta["staleness_max"], "elapsed": record["time"] - meta["start_time"]}
        rl = self.rl
        if rl.eval_every and (version % rl.eval_every == 0 or version == rl.num_versions):
            t0 = time.perf_counter()
            record["eval_exact_match"] = self.eval_exact_match(variables)
            record["eval_seconds"] = time.perf_counter() - t0
        self.metrics_log.append(record)
        log.info("version %d  reward %s  eval %s  staleness %s  keep %s", version,
                 _fmt(record.get("mean_reward")), _fmt(record.get("eval_exact_match")), record.get("staleness"),
                 _fmt(record.get("keep_fraction")))

    def _write_summary(self, variables, meta):
        summary = {"final_version": meta["version"], "params_sha256": params_sha256(variables),
                   "batches_consumed": meta["next_ordinal"], "dropped_stale": meta["dropped_stale"],
                   "rejected_corrupt": meta["rejected_corrupt"], "staleness_max": meta["staleness_max"],
                   "consumed": meta["ledger"]}
        ro.write_atomically(storage.join(self.workdir, SUMMARY), json.dumps(summary, indent=1).encode(),
                            self.workdir)
        log.info("final version %d, params sha256 %s", meta["version"], summary["params_sha256"])


def _fmt(x):
    return "-" if x is None else f"{x:.3f}"


def main(argv):
    skip_absent_tpu()
    from absl import flags

    from glm5_jax.rl.config import load_rl_config, resolve_sft
    from glm5_jax.rl.logs import setup_logging

    setup_logging("learner")
    exp = load_rl_config(flags.FLAGS.config, flags.FLAGS.set)
    sft_cfg, sft_workdir = resolve_sft(exp, flags.FLAGS.workdir)
    Learner(exp, flags.FLAGS.workdir, sft_cfg, sft_workdir).run()


if __name__ == "__main__":
    from absl import app

    from glm5_jax.rl.flags import define_common_flags

    define_common_flags()
    app.run(main)
