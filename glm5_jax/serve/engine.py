"""Continuous batching over a static latent cache, with prefix reuse keyed by token ids.

The cache holds ``max_batch`` slots (batch rows) of ``max_seq_len + 1`` positions each; every jitted
program has a fixed shape. A background thread repeats:

1. admit waiting requests into free slots: pick the slot whose cached tokens share the longest prefix
   with the prompt (copying a busy slot's row into a free one when that slot is the best match), prefill
   only the rest of the prompt, ``prefill_chunk`` tokens per call (each padded to a power-of-two bucket,
   so memory is bounded by the chunk, not the prompt), and sample the first token;
2. run one decode step for all slots at once: each active slot feeds its last sampled token at its own
   position; inactive slots write to the spare last position, which no query ever sees (a query at
   position p attends to slots <= p, and p < max_seq_len);
3. hand each new token to its request, finish requests on a stop id, a stop check, ``max_tokens`` or a
   cancel, and free their slots between steps.

A request with ``prompt_logprobs`` is prefilled by a program that also scores every prompt token (its
log-probability given the tokens before it, and the top alternatives) from the same forward; it reuses no
cached prefix, so every position is scored, and with ``max_tokens=0`` it ends after the prefill.

A freed slot keeps its rows and the token ids they hold, so a later request that extends them (the next
turn of a conversation, or n samples of one prompt) only prefills what is new. Slots are evicted least
recently used first. New weights (`set_variables`) are swapped in between steps (running requests go on with
them; each token records the version that sampled it); cached prefixes computed with older weights are dropped,
unless ``keep_stale_prefix`` (RL with in-flight weight updates, docs/rl.md#in-flight-weight-updates: the rows
stay, as PipelineRL keeps its KV cache across a weight update).

A model with recurrent layers (GLM-5.3-Flash's KDA) keeps each slot's recurrent state beside its latent rows:
a prefill from position 0 zeroes it, prefill chunks and decode steps advance it. A state cannot be rewound to a
shared prefix, so such a model reuses no prefix (every prompt is prefilled whole), and a prompt's last chunk
never overlaps the one before (each token is absorbed once): when its padded bucket would pass the row's end it
is split into smaller power-of-two chunks instead of shifted back.

On a sampling ``mesh`` (`glm5_jax.parallel.sampling`) the weights stay resident by SAMPLING_RULES, the
cache's slots (batch rows) split over the batch axes (``max_batch`` a multiple of them) and its positions
over ``context`` (the row padded to a multiple); a decode step runs every slot under SAMPLING_RULES, a
prefill its one row under ONE_ROW_RULES (the row replicated over the batch axes, heads and experts split).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import os
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.checkpoint.placement import variable_shardings
from glm5_jax.generate.decoding import PREFILL_CHUNK, Sampler
from glm5_jax.generate.slot_sampling import NUM_TOP_LOGPROBS, decode_logits, decode_slots, sample_rows
from glm5_jax.generate.settings import (cache_slot_multiple, decode_config, has_recurrent_layers, kernels_context,
                                        sampler_configs, step_variables)
from glm5_jax.model import routing_replay
from glm5_jax.model.kv_cache import cache_shardings, init_cache
from glm5_jax.model.transformer import Transformer
from glm5_jax.parallel.axes import BATCH, CACHE_SEQ
from glm5_jax.parallel.mesh import MeshError, mesh_and_rules
from glm5_jax.parallel.sampling import ONE_ROW_RULES, SAMPLING_RULES, axis_shards, check_sampling_fits
from glm5_jax.serve import cache_rows
from glm5_jax.telemetry import StepProfiler

MIN_PREFILL_BUCKET = 16


class RequestError(ValueError):
    """A request the engine cannot run (bad sampling parameters, token ids or lengths)."""


@dataclasses.dataclass
class Token:
    id: int
    logprob: float
    top: list[tuple[int, float]]     # (id, logprob) of the most likely alternatives, best first
    weights_version: int | None = None   # the weights that sampled it (set when emitted)


@dataclasses.dataclass(eq=False)
class Request:
    """One completion. ``on_token(token)`` and ``on_finish(request)`` are called from the engine thread."""
    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_ids: frozenset = frozenset()
    num_top: int = 0
    ignore_eos: bool = False                  # True: only stop_ids end the request, not the model's EOS ids
    stop_check: Callable[[list[int]], bool] | None = None   # True: stop after this token (e.g. a stop string)
    prompt_logprobs: bool = False             # score the prompt's tokens (then max_tokens may be 0)
    on_token: Callable[[Token], None] | None = None
    on_finish: Callable[["Request"], None] | None = None
    # filled in by the engine
    tokens: list[Token] = dataclasses.field(default_factory=list)
    prompt_scores: list[Token | None] = dataclasses.field(default_factory=list)  # per prompt token; None first
    finish_reason: str | None = None          # "stop", "length" or "abort"
    cached_tokens: int = 0                    # prompt tokens reused from the prefix cache
    weights_version: int | None = None
    # with cfg.runtime.capture_routing, set when it finishes: what the model chose at every position it ran
    # (the prompt and each fed token: all but the last), {name: [positions, L, X]} int32 in model layer order
    # (glm5_jax/model/routing_replay.py `extract`)
    routing: dict | None = None
    cancelled: bool = False
    done: threading.Event = dataclasses.field(default_factory=threading.Event)

    def cancel(self):
        """Ask the engine to stop this request and free its slot (safe from any thread)."""
        self.cancelled = True


@dataclasses.dataclass(eq=False)
class _Slot:
    index: int
    tokens: list[int] = dataclasses.field(default_factory=list)   # ids whose rows the cache holds, from 0
    request: Request | None = None
    pending: int = 0                  # the last sampled token, fed at position len(tokens) next step
    key_data: np.ndarray | None = None
    last_used: float = 0.0
    version: int = 0                  # weights version its rows were computed with


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Engine:
    """Serve `Request`s over one model; `start()` runs the batching thread, `submit()` queues work."""

    def __init__(self, cfg, variables, *, max_batch: int = 8, max_seq_len: int = 1024, eos_ids=(),
                 cache_dtype=None, weights_version: int = 0, prefill_buckets=None,
                 prefill_chunk: int = PREFILL_CHUNK, profiler: StepProfiler | None = None, mesh=None,
                 keep_stale_prefix: bool = False):
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch}: must be >= 1")
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk={prefill_chunk}: must be >= 0 (0 = a whole prompt per call)")
        if not 2 <= max_seq_len < cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len}: must be in [2, max_position_embeddings="
                             f"{cfg.max_position_embeddings})")
        self.cfg = decode_config(cfg)
        # the decode step's settings (RuntimeConfig.sampler_kernels; prompts prefill with self.cfg's)
        self._step_cfg = sampler_configs(cfg)[1]
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.prefill_chunk = min(prefill_chunk or max_seq_len, max_seq_len)
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.num_top = min(NUM_TOP_LOGPROBS, cfg.vocab_size)
        self.mesh = mesh
        # recurrent (KDA) layers: a slot's state holds its whole sequence, so no prefix is reused
        self.recurrent = has_recurrent_layers(cfg)
        slots = max_seq_len + 1                   # the last one: where inactive slots write
        multiple = cache_slot_multiple(cfg)       # slots the decode step's kernels can read (per context shard)
        slots += -slots % multiple
        if mesh is not None:
            check_sampling_fits(mesh, self.cfg)
            if max_batch % axis_shards(mesh, BATCH):
                raise MeshError(f"max_batch={max_batch}: the sampling mesh splits the batch "
                                f"{axis_shards(mesh, BATCH)} ways; give a multiple of that")
            slots += -slots % (axis_shards(mesh, CACHE_SEQ) * multiple)
            self._variable_shardings = variable_shardings(self.cfg, mesh, SAMPLING_RULES)
            variables = self._placed(variables)
        self._set_weights(variables, weights_version)
        self.keep_stale_prefix = keep_stale_prefix
        self.row_len = slots
        self._cache = init_cache(self.cfg, max_batch, slots, cache_dtype)["decoder"]
        layout = None if mesh is None else cache_shardings(self._cache, mesh, SAMPLING_RULES)
        if layout is not None:
            self._cache = jax.device_put(self._cache, layout)
        self._slots = [_Slot(i) for i in range(max_batch)]
        self._waiting: collections.deque[Request] = collections.deque()
        self._cv = threading.Condition()
        self._next_variables = None
        self._thread = None
        self._stop = False
        self.error: BaseException | None = None
        # traces engine steps (one admit + decode round each, counted from start) when enabled
        self.profiler = profiler or StepProfiler("", 0, 0)
        self.steps_run = 0
        self.stats = collections.Counter()        # prompt_tokens, cached_tokens, generated_tokens, requests
        self._recent = collections.deque()        # (time, tokens) of recent steps, for tokens/s
        # prompt chunks are padded to one of these lengths (one compiled prefill each)
        self.buckets = sorted({min(b, self.prefill_chunk) for b in prefill_buckets or _powers_of_two(max_seq_len)}
                              | {self.prefill_chunk})
        # a recurrent model's last chunk, when its bucket would pass the row's end: the largest that fits
        self._fitting_buckets = sorted(set(self.buckets) | set(_powers_of_two(MIN_PREFILL_BUCKET - 1, 1)))
        self._prefill, self._decode, self._copy = (_programs(self.cfg, self.num_top) if layout is None else
                                                   _programs_on_mesh(self.cfg, self.num_top, layout))

    def _set_weights(self, variables, version: int):
        """``variables`` (already placed) for the prefill, and as the decode step reads them (`step_variables`)."""
        self.variables, self.weights_version = variables, version
        self._step_variables = step_variables(self._step_cfg, variables)

    def _placed(self, variables):
        """`variables` on the engine's mesh (a no-op without one, or for variables already there)."""
        if self.mesh is None:
            return variables
        return {c: jax.device_put(v, self._variable_shardings[c]) for c, v in variables.items()}

    def _rules(self, rules):
        """The context an engine program is traced in: `rules` on the engine's mesh (nothing without one)."""
        return kernels_context(self.cfg) if self.mesh is None else mesh_and_rules(self.mesh, rules)

    # ---- public API (any thread) ----

    def validate(self, request: Request) -> None:
        """Raise RequestError naming what is wrong with `request`."""
        n = len(request.prompt)
        if n == 0:
            raise RequestError("the prompt is empty")
        bad = [t for t in request.prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids must be in [0, {self.cfg.vocab_size}); got {bad[:5]}")
        if n >= self.max_seq_len:
            raise RequestError(f"the prompt has {n} tokens; this server's context is {self.max_seq_len} tokens "
                               f"(prompt + completion), so prompts must be shorter than that")
        if request.max_tokens < (0 if request.prompt_logprobs else 1):
            raise RequestError(f"max_tokens={request.max_tokens}: must be >= 1 (0 only when scoring the prompt)")
        if n + request.max_tokens > self.max_seq_len:
            raise RequestError(f"prompt ({n} tokens) + max_tokens ({request.max_tokens}) exceeds the context of "
                               f"{self.max_seq_len} tokens")
        try:
            Sampler(float(request.temperature), float(request.top_p), int(request.top_k)).validate(self.cfg.vocab_size)
        except ValueError as e:
            raise RequestError(str(e)) from None
        if not 0 <= request.num_top <= self.num_top:
            raise RequestError(f"top logprobs = {request.num_top}: must be in [0, {self.num_top}]")

    def submit(self, request: Request) -> Request:
        self.validate(request)
        request.stop_ids = frozenset(request.stop_ids) | (frozenset() if request.ignore_eos else self.eos_ids)
        if self.error is not None:
            raise RuntimeError(f"the engine stopped: {self.error!r}")
        with self._cv:
            self._waiting.append(request)
            self._cv.notify()
        return request

    def generate(self, request: Request, timeout: float | None = None) -> Request:
        """Submit and wait (for tests and offline use)."""
        self.submit(request).done.wait(timeout)
        return request

    def set_variables(self, variables, version: int) -> None:
        """Swap in new weights before the next step."""
        variables = self._placed(variables)
        with self._cv:
            self._next_variables = (variables, version)
            self._cv.notify()

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._run, name="serve-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()

    def warmup(self, prompt_lengths=(1,)) -> None:
        """Compile the decode step and the prefill buckets for these prompt lengths (call before start)."""
        for n in prompt_lengths:
            self._run_prefill(self._slots[0], [0] * n, 0, Request([0] * n, 1, temperature=0.0))
        self._decode_step(self._slots[:1], dry=True)
        self._slots[0].tokens = []

    def snapshot(self) -> dict:
        """Numbers for /metrics (read without locking: approximate by a step at most)."""
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - 10:
            self._recent.popleft()
        window = (now - self._recent[0][0]) if len(self._recent) > 1 else 0.0
        busy = [s for s in self._slots if s.request is not None]
        return {
            "queue_length": len(self._waiting),
            "running": len(busy),
            "max_batch": self.max_batch,
            "tokens_per_second": sum(n for _, n in list(self._recent)[1:]) / window if window > 0 else 0.0,
            "cache_used_fraction": sum(len(s.tokens) for s in busy) / (self.max_batch * self.max_seq_len),
            "cache_held_fraction": sum(len(s.tokens) for s in self._slots) / (self.max_batch * self.max_seq_len),
            "prefix_hit_rate": self.stats["cached_tokens"] / max(self.stats["prompt_tokens"], 1),
            "weights_version": self.weights_version,
            **{k: int(v) for k, v in self.stats.items()},
        }

    # ---- engine thread ----

    def _run(self):
        try:
            while True:
                with self._cv:
                    while not (self._stop or self._waiting or self._next_variables
                               or any(s.request for s in self._slots)):
                        self._cv.wait()
                    if self._stop:
                        break
                    if self._next_variables is not None:
                        update, self._next_variables = self._next_variables, None
                        self._set_weights(*update)
                        for slot in self._slots:
                            if slot.request is None and not self.keep_stale_prefix:
                                slot.tokens = []
                with self.profiler.step(self.steps_run):
                    self._drop_cancelled()
                    self._admit()
                    active = [s for s in self._slots if s.request is not None]
                    if active:
                        self._decode_step(active)
                self.profiler.after_step(self.steps_run, self._cache)
                self.steps_run += 1
        except BaseException as e:   # fail every request rather than hang its client
            self.error = e
            for slot in self._slots:
                if slot.request is not None:
                    self._finish(slot, "abort")
            with self._cv:
                waiting, self._waiting = list(self._waiting), collections.deque()
            for request in waiting:
                request.finish_reason = "abort"
                request.done.set()
                if request.on_finish:
                    request.on_finish(request)
            raise
        finally:
            self.profiler.stop()

    def _drop_cancelled(self):
        for slot in self._slots:
            if slot.request is not None and slot.request.cancelled:
                self._finish(slot, "abort")
        with self._cv:
            cancelled = [r for r in self._waiting if r.cancelled]
            for r in cancelled:
                self._waiting.remove(r)
        for r in cancelled:
            self.stats["finished_abort"] += 1
            r.finish_reason = "abort"
            r.done.set()
            if r.on_finish:
                r.on_finish(r)

    def _admit(self):
        while True:
            free = [s for s in self._slots if s.request is None]
            with self._cv:
                if not free or not self._waiting:
                    return
                request = self._waiting.popleft()
            slot, reuse = self._choose_slot(request.prompt, free,
                                            reuse_prefix=not (request.prompt_logprobs or self.recurrent))
            request.weights_version = self.weights_version
            request.cached_tokens = reuse
            self.stats["requests"] += 1
            self.stats["prompt_tokens"] += len(request.prompt)
            self.stats["cached_tokens"] += reuse
            slot.request, slot.version = request, self.weights_version
            seed = request.seed if request.seed is not None else int.from_bytes(os.urandom(4), "little")
            slot.key_data = np.asarray(jax.random.key_data(jax.random.key(seed)))
            token = self._run_prefill(slot, request.prompt, reuse, request)
            if request.max_tokens == 0:          # prompt scoring only
                self._finish(slot, "length")
            else:
                self._emit(slot, token)

    def _choose_slot(self, prompt: list[int], free: list[_Slot], reuse_prefix: bool = True) -> tuple[_Slot, int]:
        """(slot to run in, number of prompt tokens whose rows it already holds)."""
        if not reuse_prefix:
            return min(free, key=lambda s: (s.last_used, s.index)), 0
        best, best_len = None, 0
        for slot in self._slots:
            n = _common_prefix(slot.tokens, prompt)
            if n > best_len or (n == best_len and best is not None and best.request is not None
                                and slot.request is None):
                best, best_len = slot, n
        reuse = min(best_len, len(prompt) - 1)        # at least one token is prefilled: it gives the logits
        if reuse > 0 and best.request is None:
            return best, reuse
        target = min(free, key=lambda s: (s.last_used, s.index))     # least recently used
        if reuse > 0:
            with self._rules(SAMPLING_RULES):
                self._cache = self._copy(self._cache, best.index, target.index)
            target.tokens = best.tokens[:reuse]
            return target, reuse
        return target, 0

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _run_prefill(self, slot: _Slot, prompt: list[int], start: int, request: Request) -> Token:
        """Write prompt[start:]'s rows into the slot, at most ``prefill_chunk`` tokens per call (each call
        padded to a bucket), and sample the first token from the last call's logits."""
        key_data = slot.key_data if slot.key_data is not None else np.zeros(2, np.uint32)
        n = len(prompt)
        scores = [None] * n if request.prompt_logprobs else None
        out = None
        while out is None or start < n:
            end = min(start + self.prefill_chunk, n)
            T = self._bucket(end - start)
            if self.recurrent and start + T > self.row_len:
                # a recurrent state absorbs each token once: no overlap with the last chunk, a smaller one
                T = max(b for b in self._fitting_buckets if start + b <= self.row_len)
                end = min(end, start + T)
            start = min(start, self.row_len - T)  # the padded chunk must fit in the slot's row
            chunk = np.zeros((1, T), np.int32)
            chunk[0, :end - start] = prompt[start:end]
            args = (self.variables, self._cache, np.int32(slot.index), chunk, np.int32(start), np.int32(end - start),
                    np.float32(request.temperature), np.float32(request.top_p), np.int32(request.top_k), key_data,
                    np.int32(0))
            if scores is None:
                with self._rules(ONE_ROW_RULES):
                    self._cache, out = self._prefill(*args)
            else:
                # position p scores prompt[p + 1], the token after it (the last position has none)
                targets = np.zeros((1, T), np.int32)
                targets[0, :end - start - 1] = prompt[start + 1:end]
                if end < n:
                    targets[0, end - start - 1] = prompt[end]
                with self._rules(ONE_ROW_RULES):
                    self._cache, (out, scored) = self._prefill(*args, targets)
                for p, token in enumerate(_tokens_from(*jax.device_get(scored)), start):
                    if p + 1 < min(end + 1, n):
                        token.top = token.top[:request.num_top]
                        scores[p + 1] = token
            start = end
        slot.tokens = list(prompt)
        if scores is not None:
            request.prompt_scores = scores
        return _tokens_from(*jax.device_get(out))[0]

    def _decode_step(self, active: list[_Slot], dry: bool = False):
        B = self.max_batch
        tokens = np.zeros(B, np.int32)
        positions = np.full(B, self.max_seq_len, np.int32)      # inactive slots write the spare position
        temperature, top_p = np.zeros(B, np.float32), np.ones(B, np.float32)
        top_k, index = np.zeros(B, np.int32), np.zeros(B, np.int32)
        key_data = np.zeros((B, 2), np.uint32)
        for s in active:
            tokens[s.index], positions[s.index] = s.pending, len(s.tokens)
            if not dry:
                r = s.request
                temperature[s.index], top_p[s.index], top_k[s.index] = r.temperature, r.top_p, r.top_k
                index[s.index] = len(r.tokens)
                key_data[s.index] = s.key_data
        with self._rules(SAMPLING_RULES):
            self._cache, out = self._decode(self._step_variables, self._cache, tokens, positions, temperature, top_p,
                                            top_k, key_data, index)
        new = _tokens_from(*jax.device_get(out))
        if dry:
            return
        for s in active:
            s.tokens.append(s.pending)
        self._recent.append((time.monotonic(), len(active)))
        for s in active:
            self._emit(s, new[s.index])

    def _emit(self, slot: _Slot, token: Token):
        request = slot.request
        token.top = token.top[:request.num_top]
        token.weights_version = self.weights_version
        request.tokens.append(token)
        slot.pending = token.id
        self.stats["generated_tokens"] += 1
        if request.on_token:
            request.on_token(token)
        ids = [t.id for t in request.tokens]
        if token.id in request.stop_ids or (request.stop_check is not None and request.stop_check(ids)):
            self._finish(slot, "stop")
        elif len(request.tokens) >= request.max_tokens:
            self._finish(slot, "length")

    def _routing_of(self, slot: _Slot) -> dict:
        """The recorded routing of the slot's held rows (its tokens: positions 0 .. len - 1)."""
        row = jax.tree.map(lambda x: x[:, slot.index:slot.index + 1], routing_replay.recorded(self._cache))
        return {name: a[0] for name, a in routing_replay.extract(self.cfg, jax.device_get(row),
                                                                 len(slot.tokens)).items()}

    def _finish(self, slot: _Slot, reason: str):
        request, slot.request = slot.request, None
        slot.last_used = time.monotonic()
        self.stats[f"finished_{reason}"] += 1
        if self.recurrent or (slot.version != self.weights_version and not self.keep_stale_prefix):
            # a recurrent state past the prompt, or rows from older weights (unless kept on purpose): no prefix
            slot.tokens = []
        if self.cfg.runtime.capture_routing:
            request.routing = self._routing_of(slot)
        request.finish_reason = reason
        request.done.set()
        if request.on_finish:
            request.on_finish(request)


def _powers_of_two(limit: int, smallest: int = MIN_PREFILL_BUCKET) -> list[int]:
    return [1 << k for k in range(smallest.bit_length() - 1, limit.bit_length())]


@functools.lru_cache(maxsize=8)
def _programs(cfg, num_top):
    """The jitted prefill, decode step and row copy; shared by engines of one config (compiled once)."""
    return _programs_on_mesh(cfg, num_top, None)


def _programs_on_mesh(cfg, num_top, layout):
    """`_programs` whose every output cache keeps the shardings `layout` (None: wherever XLA puts it); the prefill
    and the decode step each with its model of `sampler_configs`."""
    prefill_cfg, step_cfg = sampler_configs(cfg)
    model, step_model = Transformer(prefill_cfg), Transformer(step_cfg)

    def pinned(program, name):
        """`program` (returning (cache, out)) with its cache kept on `layout`."""
        if layout is None:
            return program

        def run(*args):
            cache, out = program(*args)
            return jax.lax.with_sharding_constraint(cache, layout), out
        run.__name__ = name                       # the program's name in profiles and HLO dumps
        return run

    def copy_row(cache, src, dst):
        cache = cache_rows.copy_row(cache, src, dst)
        return cache if layout is None else jax.lax.with_sharding_constraint(cache, layout)

    return (jax.jit(pinned(functools.partial(_prefill, model, num_top), "_prefill"), donate_argnums=1),
            jax.jit(pinned(functools.partial(decode_slots, step_model, num_top), "_decode"), donate_argnums=1),
            jax.jit(copy_row, donate_argnums=0))


def _tokens_from(token_B, logprob_B, top_ids_BK, top_logp_BK) -> list[Token]:
    return [Token(int(t), float(lp), [(int(i), float(v)) for i, v in zip(ids, lps)])
            for t, lp, ids, lps in zip(np.atleast_1d(token_B), np.atleast_1d(logprob_B),
                                       np.atleast_2d(top_ids_BK), np.atleast_2d(top_logp_BK))]


def _prefill(model, num_top, variables, cache, slot, chunk_1T, start, n_real, temperature, top_p, top_k, key_data,
             index, targets_1T=None):
    """Run a slot's prompt chunk at positions start.. and sample from the last real token's logits.

    With ``targets_1T`` (the token after each chunk position) the outputs are (sample, scores): scores are
    (log-prob of each target [T], top ids [T, num_top], top log-probs [T, num_top]) under the model's
    untempered distribution at each position.
    """
    T = chunk_1T.shape[1]
    positions = start + jnp.arange(T, dtype=jnp.int32)[None]
    segments = (jnp.arange(T)[None] < n_real).astype(jnp.int32)
    last_index = jnp.reshape(n_real - 1, (1, 1)).astype(jnp.int32)
    logits_at = last_index if targets_1T is None else jnp.arange(T, dtype=jnp.int32)[None]
    row = cache_rows.restart_recurrent(cache_rows.read_row(cache, slot), start == 0)
    logits, row = decode_logits(model, variables, chunk_1T, positions, segments, row, logits_at=logits_at)
    cache = cache_rows.write_row(cache, row, slot)
    last = jnp.take(logits[0], last_index[0], axis=0) if targets_1T is not None else logits[0]  # [1, V]
    out = sample_rows(last, temperature[None], top_p[None], top_k[None], key_data[None], index[None], num_top)
    if targets_1T is None:
        return cache, out
    logp_TV = jax.nn.log_softmax(logits[0].astype(jnp.float32))
    target_logp = jnp.take_along_axis(logp_TV, targets_1T[0][:, None], axis=1)[:, 0]
    top_logp, top_ids = jax.lax.top_k(logp_TV, num_top)
    return cache, (out, (targets_1T[0], target_logp, top_ids.astype(jnp.int32), top_logp))
