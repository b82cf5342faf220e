"""Request bodies of the HTTP API (OpenAI's completions / chat completions, and the token-level endpoint).

Fields follow the OpenAI API reference; ``top_k`` is an extension (0 = off). Token ids are strict
integers (``"5"`` is refused, not converted). Unknown fields are ignored, as OpenAI-compatible servers do.
"""
from __future__ import annotations

import base64
from typing import Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

MAX_N = 16
MAX_STOP = 4


class Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = None
    stream: bool = False


class TextSampling(Sampling):
    stop: StrictStr | list[StrictStr] | None = None
    stream_options: dict | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(TextSampling):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    max_tokens: int | None = Field(16, ge=0)          # null: 16, as OpenAI; 0 only with echo
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False                                # the prompt comes back before the completion

    @property
    def completion_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens

    @property
    def scores_prompt(self) -> bool:
        """The prompt's tokens are scored: echo with logprobs (or with nothing to generate)."""
        return self.echo and (self.logprobs is not None or self.completion_tokens == 0)

    def prompts(self) -> list:
        """The prompts as a list, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        return list(p)


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(TextSampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenRequest(Sampling):
    """Token in, token out: the prompt and the completion are token ids; logprobs always come back."""
    prompt_ids: list[StrictInt] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    stop_token_ids: list[StrictInt] = []
    ignore_eos: bool = False
    top_logprobs: int = Field(0, ge=0, le=20)
    # answer only with weights at least this new: the request waits until the server has loaded them
    # (503 after WEIGHTS_WAIT_S); an RL generator's staleness bound and lockstep rely on it
    min_weights_version: int | None = None
    # also return what the model chose at each position it ran (the prompt and the completion but its last
    # token): the experts per MoE layer and the DSA top-k per full-indexer layer, for routing replay; needs a
    # server whose model records them (RuntimeConfig.capture_routing: an RL policy server with rl.replay_*)
    return_routing: bool = False


def encode_routing(routing: dict) -> dict:
    """/v1/tokens' ``routing`` field: each array ({name: [positions, L, X]} int, `engine.Request.routing`) as
    {"shape", "dtype": "int16", "data": base64 of its little-endian bytes} (expert ids and slots below 32768)."""
    out = {}
    for name, a in routing.items():
        a = np.asarray(a)
        if a.size and a.max() > np.iinfo(np.int16).max:
            raise ValueError(f"routing {name}: a value past int16 ({a.max()})")
        out[name] = {"shape": list(a.shape), "dtype": "int16",
                     "data": base64.b64encode(a.astype("<i2").tobytes()).decode()}
    return out


def decode_routing(payload: dict) -> dict:
    """`encode_routing`'s inverse: {name: int32 array}."""
    return {name: np.frombuffer(base64.b64decode(v["data"]), "<i2").astype(np.int32).reshape(v["shape"])
            for name, v in payload.items()}
