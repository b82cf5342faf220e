"""Multi-turn environments, run token in / token out against a policy (e.g. `glm5_jax.serve` over HTTP).

    env.reset(seed) -> observation token ids
    env.step(action token ids) -> StepResult(observation ids, reward, done)

`run_episode` alternates policy and environment: each turn the policy continues the whole episode so far
(initial observation, then every action exactly as sampled and every observation), so no text round trip
can change a token, and a server with a prefix cache prefills only the newest observation. The episode
becomes one RL sample: prompt = the first observation, completion = the rest, loss mask 1 on the
policy's tokens and 0 on the environment's, behaviour logprobs as the sampler reported them
(`episodes_to_batch` gives the learner's `RolloutBatch`).

`ToolLatency` wraps an environment so each step takes a fixed time, standing for a real tool call
(a sandbox, a search engine): the wait that asynchronous RL overlaps with training.
"""
from __future__ import annotations

import abc
import dataclasses
import time
from typing import Callable

import numpy as np

from glm5_jax.model import routing_replay
from glm5_jax.rl.rollouts import RolloutBatch, routing_fields
from glm5_jax.serve.protocol import decode_routing


@dataclasses.dataclass
class StepResult:
    observation: list[int]
    reward: float
    done: bool


class Environment(abc.ABC):
    @abc.abstractmethod
    def reset(self, seed: int) -> list[int]:
        """Start an episode; the first observation (non-empty)."""

    @abc.abstractmethod
    def step(self, action: list[int]) -> StepResult:
        """Apply the policy's action (its sampled ids, including a final stop id)."""


@dataclasses.dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[float]
    weights_version: int | None = None          # the version the turn was admitted with
    cached_tokens: int = 0
    token_versions: list[int] | None = None     # per token, the version that sampled it (None: weights_version)
    # what the model chose at each position it ran ({name: [positions, L, X]}, glm5_jax/model/routing_replay.py)
    routing: dict | None = None


# policy(context_ids, max_tokens, stop_token_ids) -> Sampled
Policy = Callable[[list[int], int, list[int]], Sampled]


@dataclasses.dataclass
class Episode:
    prompt: list[int]                                   # the first observation
    completion: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)     # 0 on environment tokens
    loss_mask: list[float] = dataclasses.field(default_factory=list)    # 1 on policy tokens
    reward: float = 0.0
    turns: int = 0
    weights_versions: list[int] = dataclasses.field(default_factory=list)
    token_versions: list[int] = dataclasses.field(default_factory=list)  # per completion token, -1 on env's
    cached_tokens: list[int] = dataclasses.field(default_factory=list)  # per turn, as the server reported
    context_lengths: list[int] = dataclasses.field(default_factory=list)  # per turn: tokens the policy saw
    action_lengths: list[int] = dataclasses.field(default_factory=list)
    # per position of prompt + completion, the routing the policy recorded when it first ran that position
    # ({name: [positions, L, X]}; None when the policy returns none)
    routing: dict | None = None


def run_episode(policy: Policy, env: Environment, seed: int, *, max_turns: int, max_action_tokens: int,
                stop_token_ids=()) -> Episode:
    """Play one episode; rewards add up over turns. Ends when the environment says so or after max_turns."""
    episode = Episode(prompt=list(env.reset(seed)))
    if not episode.prompt:
        raise ValueError(f"{type(env).__name__}.reset returned an empty observation")
    while episode.turns < max_turns:
        context = episode.prompt + episode.completion
        out = policy(context, max_action_tokens, list(stop_token_ids))
        episode.turns += 1
        episode.context_lengths.append(len(context))
        episode.action_lengths.append(len(out.token_ids))
        episode.completion += out.token_ids
        episode.logprobs += out.logprobs
        episode.loss_mask += [1.0] * len(out.token_ids)
        turn_version = -1 if out.weights_version is None else out.weights_version
        episode.weights_versions.append(turn_version)
        episode.token_versions += (list(out.token_versions) if out.token_versions is not None
                                   else [turn_version] * len(out.token_ids))
        episode.cached_tokens.append(out.cached_tokens)
        if out.routing is not None:
            episode.routing = _first_runs(episode.routing, out.routing)
        result = env.step(list(out.token_ids))
        episode.reward += result.reward
        if result.done:
            break
        episode.completion += result.observation
        episode.logprobs += [0.0] * len(result.observation)
        episode.loss_mask += [0.0] * len(result.observation)
        episode.token_versions += [-1] * len(result.observation)
    return episode


def _first_runs(known: dict | None, turn: dict) -> dict:
    """Each position's routing from the turn that first ran it: ``known`` extended by ``turn``'s later rows
    (a turn's answer covers the whole context it continued, most of it reused from the server's cache)."""
    if known is None:
        return {name: np.array(a) for name, a in turn.items()}
    return {name: np.concatenate([known[name], turn[name][len(known[name]):]]) for name in known}


class ToolLatency(Environment):
    """`env` whose every step first sleeps `seconds` (a stand-in for a real tool's latency)."""

    def __init__(self, env: Environment, seconds: float):
        self.env, self.seconds = env, seconds

    def reset(self, seed: int) -> list[int]:
        return self.env.reset(seed)

    def step(self, action: list[int]) -> StepResult:
        if self.seconds > 0:
            time.sleep(self.seconds)
        return self.env.step(action)


class PolicyUnavailable(RuntimeError):
    """The policy server did not answer within the retry deadline."""


class ServerPolicy:
    """A `Policy` served by `python -m glm5_jax.serve` (its /v1/tokens endpoint).

    ``min_weights_version``: the server answers only with weights at least this new (it holds the
    request until it has loaded them). Connection errors and 5xx answers are retried with the same
    seed until ``retry_s`` has passed, so a killed and restarted server or router costs time, not the
    episode. ``api_key`` (default: the GLM5_API_KEY environment variable) is sent as a bearer token.
    """

    def __init__(self, url: str, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, session_id: str | None = None, timeout_s: float = 600.0,
                 min_weights_version: int | None = None, retry_s: float = 0.0, client=None,
                 api_key: str | None = None, return_routing: bool = False):
        import httpx2

        from glm5_jax.serve.auth import bearer_headers, resolve_api_key

        self._own_client = client is None
        self.http = client or httpx2.Client(base_url=url, timeout=timeout_s)
        self.url = url.rstrip("/")
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.seed, self.session_id = seed, session_id
        self.min_weights_version, self.retry_s = min_weights_version, retry_s
        self.return_routing = return_routing
        self.calls = self.retries = 0
        self.headers = bearer_headers(resolve_api_key(api_key))

    def _post(self, body: dict):
        import httpx2

        deadline = time.monotonic() + self.retry_s
        while True:
            try:
                r = self.http.post(self.url + "/v1/tokens", json=body, headers=self.headers)
                # 5xx: the router has no live replica (503) or lost one mid-answer (500), or the server
                # has not loaded min_weights_version yet (503)
                if r.status_code < 500:
                    return r
                why = f"{r.status_code}: {r.text[:200]}"
            except httpx2.TransportError as e:
                why = repr(e)
            if time.monotonic() >= deadline:
                raise PolicyUnavailable(f"policy server {self.url}: {why}")
            self.retries += 1
            time.sleep(0.1)

    def __call__(self, context, max_tokens, stop_token_ids) -> Sampled:
        body = {"prompt_ids": list(context), "max_tokens": max_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "stop_token_ids": list(stop_token_ids)}
        if self.seed is not None:
            body["seed"] = self.seed + self.calls          # a fresh stream per turn, reproducible
        if self.session_id is not None:
            body["session_id"] = self.session_id
        if self.min_weights_version is not None:
            body["min_weights_version"] = self.min_weights_version
        if self.return_routing:
            body["return_routing"] = True
        r = self._post(body)
        self.calls += 1
        if r.status_code != 200:
            raise RuntimeError(f"policy server answered {r.status_code}: {r.text}")
        out = r.json()
        choice = out["choices"][0]
        routing = decode_routing(choice["routing"]) if self.return_routing else None
        return Sampled(choice["token_ids"], choice["logprobs"], choice["weights_version"],
                       out["usage"]["prompt_tokens_details"]["cached_tokens"], choice.get("token_weights_versions"),
                       routing)

    def close(self):
        if self._own_client:
            self.http.close()


def episodes_to_batch(episodes: list[Episode], group_ids, meta: dict, *, completion_width: int = 0,
                      turns_width: int = 0, routing_shapes: dict | None = None) -> RolloutBatch:
    """The learner's batch: one row per episode; ``versions`` holds each turn's weights version (-1 pad,
    which the learner's staleness check ignores), ``token_versions`` each token's (-1 on the environment's).
    ``completion_width`` / ``turns_width`` pad to a fixed shape (0: the longest episode), so every batch of a
    run has one shape and the update compiles once. ``routing_shapes`` ({name: (L, X)},
    `routing_replay.record_shapes` of the row width P + C): the record also carries each episode's routing
    in those shapes, -1 where none was recorded."""
    P = max(len(e.prompt) for e in episodes)
    C = max(max(len(e.completion) for e in episodes), completion_width, 1)
    K = max(max(len(e.weights_versions) for e in episodes), turns_width, 1)
    n = len(episodes)
    batch = RolloutBatch(
        prompt_tokens=np.zeros((n, P), np.int32), prompt_lengths=np.array([len(e.prompt) for e in episodes], np.int32),
        completion_tokens=np.zeros((n, C), np.int32),
        completion_lengths=np.array([len(e.completion) for e in episodes], np.int32),
        logprobs=np.zeros((n, C), np.float32), loss_mask=np.zeros((n, C), np.float32),
        rewards=np.array([e.reward for e in episodes], np.float32), group_ids=np.asarray(group_ids, np.int32),
        versions=np.full((n, K), -1, np.int32), meta=meta, token_versions=np.full((n, C), -1, np.int32))
    for i, e in enumerate(episodes):
        batch.prompt_tokens[i, :len(e.prompt)] = e.prompt
        batch.completion_tokens[i, :len(e.completion)] = e.completion
        batch.logprobs[i, :len(e.logprobs)] = e.logprobs
        batch.loss_mask[i, :len(e.loss_mask)] = e.loss_mask
        batch.versions[i, :len(e.weights_versions)] = e.weights_versions
        batch.token_versions[i, :len(e.token_versions)] = e.token_versions
    if routing_shapes:
        fields = {name: np.full((n, P + C, L, X), routing_replay.NOT_RECORDED, np.int32)
                  for name, (L, X) in routing_shapes.items()}
        for i, e in enumerate(episodes):
            for name, a in (e.routing or {}).items():
                if name in fields:
                    a = np.asarray(routing_replay.fit_width(np.asarray(a[:P + C]), fields[name].shape[-1]))
                    fields[name][i, :len(a)] = a
        for name, a in routing_fields(fields, fields).items():
            setattr(batch, name, a)
    return batch.validate()
