"""A generator: polls for the newest committed policy, samples groups, scores them, writes TITO batches
(run as ``python -m glm5_jax.rl.generator``).

Batch `seq` of generator `g` has global ordinal o = seq * num_generators + g. Its prompts and its
sampling key are pure functions of (seed, g, seq), so a restarted generator resumes at
max(last seq on disk + 1, the learner's watermark for g) and neither skips nor repeats a batch
(docs/training.md#generators-resume-without-gaps-or-repeats).

Back-pressure (docs/training.md#batch-order-and-staleness, counted over all generators — per-generator counting
dropped half
the batches): batch o starts only while o <= consumed + tau, where consumed is the number of ordinals
the newest committed version has consumed (= its version when nothing was dropped), and while this
generator has fewer than max_ready unconsumed files. In lockstep mode batch o waits for, and samples
with, exactly version max(0, o - tau), so the run is bit-reproducible whatever the timing. With
rl.inflight_updates a batch starts with the newest version and swaps to each newer one between decode steps
(glm5_jax.rl.inflight); every token records the version that sampled it (`token_versions`).

For a multi-turn environment (rl.task in glm5_jax.rl.tasks.ENVIRONMENTS) the same loop runs with
`glm5_jax.rl.agentic.EpisodeGenerator`, which plays episodes through a policy server (--policy_url).
"""
from __future__ import annotations

import logging
import time

import jax
import numpy as np

from glm5_jax import storage
from glm5_jax.checkpoint.handoff import PolicyReader
from glm5_jax.generate.decoding import Sampler
from glm5_jax.generate.on_mesh import generate_on_mesh
from glm5_jax.rl import rollouts as ro
from glm5_jax.rl.inflight import sample_inflight
from glm5_jax.model import routing_replay
from glm5_jax.rl.policy import replayed, sampling_policy
from glm5_jax.rl.tasks import make_task

log = logging.getLogger("glm5_jax.rl")


def may_start(ordinal: int, consumed: int, tau: int) -> bool:
    """Global back-pressure (AReaL's capacity rule; docs/training.md#batch-order-and-staleness):
    batch `ordinal` may start while it is
    at most tau ahead of the ordinals the learner has consumed, counted over all generators."""
    return ordinal <= consumed + tau


def lockstep_version(ordinal: int, tau: int) -> int:
    """Lockstep mode: batch o is sampled with exactly version max(0, o - tau)."""
    return max(0, ordinal - tau)


def sampling_key(seed: int, generator: int, seq: int):
    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), generator), seq)


class Generator:
    def __init__(self, exp, workdir: str, generator_id: int, sft_cfg):
        self.rl = exp.rl
        if not 0 <= generator_id < self.rl.num_generators:
            raise ValueError(f"--generator_id={generator_id} is outside [0, rl.num_generators="
                             f"{self.rl.num_generators})")
        self.gen = generator_id
        self.workdir = storage.absolute(workdir)
        self.dirs = ro.RolloutDirs(self.workdir)
        self.reader = PolicyReader(self.workdir)
        self._meta_cache: dict[int, dict] = {}
        self._loaded: tuple[int, dict] | None = None
        self._last_poll = 0.0
        self._init_sampler(exp, sft_cfg)

    def _init_sampler(self, exp, sft_cfg):
        """The task and the local sampling model (a subclass samples elsewhere: glm5_jax.rl.agentic)."""
        self.task = make_task(self.rl.task)
        self.policy = sampling_policy(self.rl, sft_cfg.model)      # rl.sampler_mesh, not the learner's mesh

    # ------------------------------------------------------------------ policy versions
    def meta(self, version: int) -> dict:
        if version not in self._meta_cache:
            self._meta_cache = {version: self.reader.read_meta(version)}
        return self._meta_cache[version]

    def wait_for_first_version(self) -> int:
        while (latest := self.reader.latest_version()) is None:
            time.sleep(self.rl.poll_seconds)
        return latest

    def finished(self, latest: int) -> bool:
        return latest >= self.rl.num_versions

    def variables(self, version: int):
        if self._loaded is None or self._loaded[0] != version:
            t0 = time.perf_counter()
            self._loaded = (version, self.reader.restore_variables(version, self.policy.abstract_variables))
            log.debug("restored version %d in %.3f s", version, time.perf_counter() - t0)
        return self._loaded[1]

    def newer_version(self, current: int):
        """(newest committed version, its variables) when it is newer than `current`, else None; looked up
        at most every rl.poll_seconds (asked between decode steps by in-flight sampling)."""
        now = time.monotonic()
        if now - self._last_poll < self.rl.poll_seconds:
            return None
        self._last_poll = now
        latest = self.reader.latest_version()
        if latest is None or latest <= current:
            return None
        return latest, self.variables(latest)

    def version_for(self, ordinal: int) -> int | None:
        """The version to sample batch `ordinal` with, or None while back-pressure holds it (or the run
        is over: check `finished`)."""
        rl = self.rl
        latest = self.reader.latest_version()
        if latest is None or self.finished(latest):
            return None
        if rl.lockstep:
            target = lockstep_version(ordinal, rl.tau)
            return target if self.reader.has_version(target) else None
        meta = self.meta(latest)
        if not may_start(ordinal, meta["next_ordinal"], rl.tau):
            return None
        unconsumed = [s for s in self.dirs.seqs_of(self.gen) if s >= meta["watermark"][str(self.gen)]]
        if len(unconsumed) >= rl.max_ready:
            return None
        return latest

    # ------------------------------------------------------------------ sampling
    def sample(self, seq: int, version: int) -> ro.RolloutBatch:
        rl = self.rl
        t0 = time.perf_counter()
        prompts, prompt_lengths = self.task.prompts(rl.seed, self.gen, seq, rl.prompts_per_batch)
        prompts = np.repeat(prompts, rl.group_size, axis=0)               # G samples per prompt, contiguous
        prompt_lengths = np.repeat(prompt_lengths, rl.group_size)
        variables = self.variables(version)
        if rl.inflight_updates:
            tokens, lengths, logprobs, token_versions, routing = sample_inflight(
                self.policy.cfg, self.policy.mesh, self.policy.rules, variables, version, prompts, prompt_lengths,
                max_new_tokens=rl.max_new_tokens, sampler=Sampler(rl.temperature, rl.top_p, rl.top_k),
                rng=sampling_key(rl.seed, self.gen, seq), eos_ids=self.task.eos_ids, newer=self.newer_version)
        else:
            out = generate_on_mesh(self.policy.cfg, variables, prompts, prompt_lengths, self.policy.mesh,
                                   rules=self.policy.rules, max_new_tokens=rl.max_new_tokens,
                                   temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k,
                                   rng=sampling_key(rl.seed, self.gen, seq), eos_ids=self.task.eos_ids)
            tokens, lengths, logprobs = (np.asarray(x) for x in jax.device_get((out.tokens, out.lengths,
                                                                                out.logprobs)))
            routing = jax.device_get(out.routing)
        rewards = self.task.rewards(prompts, prompt_lengths, tokens, lengths)
        mask = (np.arange(rl.max_new_tokens)[None, :] < lengths[:, None]).astype(np.float32)
        if not rl.inflight_updates:
            token_versions = np.where(mask > 0, version, -1).astype(np.int32)
        n = len(prompts)
        ordinal = seq * rl.num_generators + self.gen
        replay = {}
        if routing is not None:     # per position of the learner's rows: prompt width + completion width
            names = replayed(rl)
            arrays = routing_replay.extract(self.policy.cfg, routing, prompts.shape[1] + rl.max_new_tokens)
            replay = ro.routing_fields(arrays, names)
        return ro.RolloutBatch(
            prompt_tokens=prompts.astype(np.int32), prompt_lengths=prompt_lengths.astype(np.int32),
            completion_tokens=tokens.astype(np.int32), completion_lengths=lengths.astype(np.int32),
            logprobs=logprobs.astype(np.float32), loss_mask=mask, rewards=rewards,
            group_ids=(ordinal * rl.prompts_per_batch + np.arange(n) // rl.group_size).astype(np.int32),
            versions=np.full((n, 1), version, np.int32), token_versions=token_versions, **replay,
            meta={"generator": self.gen, "seq": seq, "ordinal": ordinal, "version": version,
                  "token_versions": sorted({int(v) for v in np.unique(token_versions) if v >= 0}),
                  "sampler": {"temperature": rl.temperature, "top_p": rl.top_p, "top_k": rl.top_k,
                              "max_new_tokens": rl.max_new_tokens, "group_size": rl.group_size},
                  "seed": rl.seed, "sample_seconds": time.perf_counter() - t0, "written_at": time.time()})

    # ------------------------------------------------------------------ loop
    def resume_seq(self) -> int:
        """max(last seq on disk + 1, watermark): list files first, then read the (newer) watermark."""
        on_disk = self.dirs.seqs_of(self.gen)
        latest = self.wait_for_first_version()
        meta = self.meta(latest)
        if meta["num_generators"] != self.rl.num_generators:
            raise ValueError(f"the learner runs with {meta['num_generators']} generators, this config says "
                             f"{self.rl.num_generators}")
        return max(on_disk[-1] + 1 if on_disk else 0, meta["watermark"][str(self.gen)])

    def run(self):
        rl = self.rl
        self.dirs.clear_tmp(self.gen)
        seq = self.resume_seq()
        log.info("generator %d starts at seq %d", self.gen, seq)
        while True:
            ordinal = seq * rl.num_generators + self.gen
            while (version := self.version_for(ordinal)) is None:
                latest = self.reader.latest_version()
                if latest is not None and self.finished(latest):
                    log.info("learner published its last version %d: generator %d stops", latest, self.gen)
                    return
                time.sleep(rl.poll_seconds)
            batch = self.sample(seq, version)
            ro.write_batch(self.dirs, self.gen, seq, batch)
            log.info("wrote seq %d (ordinal %d) with version %d (tokens from versions %s): reward %.3f, %.2f s", seq,
                     ordinal, version, batch.meta.get("token_versions"), float(np.mean(batch.rewards)),
                     batch.meta["sample_seconds"])
            seq += 1
