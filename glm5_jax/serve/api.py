"""The HTTP API over an `Engine`: OpenAI-compatible completions and chat completions, token in / token out.

    POST /v1/completions         prompt (text or ids, or a list of either), stream, logprobs, stop, max_tokens,
                                 n, seed, echo (with logprobs: the prompt tokens' log-probs, as lm-eval's
                                 loglikelihood requests use with max_tokens=0 or 1), ...
    POST /v1/chat/completions    messages rendered with the tokenizer's chat template
    POST /v1/tokens              prompt_ids -> token ids + per-token logprobs (+ weights version, and per token);
                                 min_weights_version holds the request until those weights are served
    GET  /v1/models, /health, /metrics (Prometheus text)

Errors come back as ``{"error": {"message", "type", "param", "code"}}`` with status 400 for a bad request
(validation messages name the field), 404/405 for a wrong route, 404 for a ``model`` other than the one
served (as vLLM answers; a request without ``model`` is served), 503 once the engine has failed, and 401
without the API key when one is set (`glm5_jax.serve.auth`; /health stays open).
With ``log_requests`` (the serve CLI), every request but the /health and /metrics probes is logged at INFO on
the ``glm5_jax.serve`` logger once its response is sent (a stream: once its last event is): route, model,
prompt and completion tokens, status and latency (`RequestLog`).
A client that disconnects cancels its requests, which frees their slots at the next step.

Each route is a module-level handler reading what it needs (engine, tokenizer, model name, chat template)
from the app's `ServerState`; `create_app` builds that state and registers the routes.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from glm5_jax.serve.auth import require_api_key
from glm5_jax.serve.engine import Engine, Request, RequestError, Token
from glm5_jax.serve.metrics import prometheus_text
from glm5_jax.serve.protocol import ChatRequest, CompletionRequest, TokenRequest, encode_routing
from glm5_jax.serve.text import ChatTemplate, TextStream

log = logging.getLogger("glm5_jax.serve")

DISCONNECT_POLL_S = 0.25
WEIGHTS_WAIT_S = 10.0           # how long /v1/tokens holds a request for min_weights_version


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            parts.append("the request body is not valid JSON")
            continue
        where = ".".join(loc) or "body"
        param = param or where
        parts.append(f"{where}: {err.get('msg')}")
    return "; ".join(dict.fromkeys(parts)) or "invalid request", param


class _Streams:
    """Forward engine callbacks (engine thread) to an asyncio queue: (choice index, Token or None at the end)."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def _put(self, item):
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:        # the event loop is gone (server shutting down)
            pass

    def attach(self, index: int, request: Request) -> Request:
        request.on_token = lambda token: self._put((index, token))
        request.on_finish = lambda _: self._put((index, None))
        return request


class _Unavailable(Exception):
    """The engine stopped, or the weights a request waits for did not come in time: 503."""


class _UnknownModel(Exception):
    """A request names a model this server does not serve: 404, as vLLM and OpenAI answer."""


UNLOGGED_PATHS = frozenset({"/health", "/metrics"})       # probes, polled by routers and monitors


class RequestLog:
    """ASGI middleware: one INFO line per request once its response has been sent, with what the handler
    noted on ``request.state`` (`ServerState.note_model`, `ServerState.note_requests`)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in UNLOGGED_PATHS:
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500
        state = scope.setdefault("state", {})

        async def send_noting_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            requests = state.get("requests", ())
            log.info("%s %s model=%s prompt_tokens=%d completion_tokens=%d status=%d latency_ms=%.1f",
                     scope["method"], scope["path"], state.get("model", "-"), sum(len(r.prompt) for r in requests),
                     sum(len(r.tokens) for r in requests), status, 1e3 * (time.perf_counter() - start))


@dataclass
class ServerState:
    """What the routes share, kept on ``app.state.server``: the engine, the tokenizer (None serves
    /v1/tokens only), the model name clients see, the chat template, and `on_metrics()` (extra gauges)."""
    engine: Engine
    tokenizer: Any
    model_name: str
    template: ChatTemplate
    on_metrics: Callable[[], dict] | None = None

    def note_model(self, http: HttpRequest, name: str | None):
        """Record the model a request names (the served one when it names none) for the request log; a
        name other than the served one is refused with 404."""
        http.state.model = self.model_name if name is None else name
        if name is not None and name != self.model_name:
            raise _UnknownModel(name)

    @staticmethod
    def note_requests(http: HttpRequest, requests: list[Request]):
        """The engine requests of an HTTP request, whose token counts the request log reports."""
        http.state.requests = requests

    def check_alive(self):
        if self.engine.error is not None:
            raise _Unavailable(f"the engine stopped: {self.engine.error!r}")

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text)]

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def build(self, prompt_ids, body, max_tokens, num_top, stream: TextStream | None, copy: int,
              prompt_logprobs: bool = False) -> Request:
        seed = None if body.seed is None else body.seed + copy
        return Request(prompt_ids, max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                       seed=seed, num_top=num_top, stop_check=stream.stop_check() if stream else None,
                       stop_ids=frozenset(getattr(body, "stop_token_ids", ())),
                       ignore_eos=getattr(body, "ignore_eos", False), prompt_logprobs=prompt_logprobs)

    async def run_all(self, http: HttpRequest, streams: _Streams, requests: list[Request]):
        """Submit, then yield (index, Token | None) until every request finished; cancel on disconnect."""
        for r in requests:
            self.engine.submit(r)
        remaining, last_check = len(requests), time.monotonic()
        try:
            while remaining:
                if time.monotonic() - last_check >= DISCONNECT_POLL_S:
                    if await http.is_disconnected():
                        return
                    self.check_alive()
                    last_check = time.monotonic()
                try:
                    index, token = await asyncio.wait_for(streams.queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    continue
                remaining -= token is None
                yield index, token
        finally:
            for r in requests:
                if not r.done.is_set():
                    r.cancel()

    async def finish_all(self, http: HttpRequest, streams: _Streams, requests: list[Request]):
        """`run_all` to the end, for a response that is not streamed."""
        async for _ in self.run_all(http, streams, requests):
            pass
        self.check_alive()

    async def wait_for_weights(self, version: int):
        """Until the engine serves weights version >= `version` (versions only grow: a reload that lands
        between this check and the request's admission is newer still); 503 after WEIGHTS_WAIT_S."""
        deadline = time.monotonic() + WEIGHTS_WAIT_S
        while (self.engine.weights_version or 0) < version:
            self.check_alive()
            if time.monotonic() > deadline:
                raise _Unavailable(f"weights version {version} is not served yet (serving "
                                   f"{self.engine.weights_version})")
            await asyncio.sleep(0.01)


def _server(http: HttpRequest) -> ServerState:
    return http.app.state.server


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _usage(requests):
    prompt = sum(len(r.prompt) for r in requests)
    completion = sum(len(r.tokens) for r in requests)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in requests)}}


# ---- errors ----

async def _invalid(_, exc):
    message, param = _validation_message(exc)
    return error_response(400, message, param)


async def _http(_, exc):
    return error_response(exc.status_code, str(exc.detail), kind="not_found_error" if exc.status_code == 404
                          else "invalid_request_error")


async def _bad(_, exc):
    return error_response(400, str(exc))


async def _down(_, exc):
    return error_response(503, str(exc), kind="server_error")


async def _unknown_model(_, exc):
    return JSONResponse({"error": {"message": f"The model `{exc}` does not exist.", "type": "NotFoundError",
                                   "param": "model", "code": 404}}, 404)


# ---- /health, /metrics, /v1/models ----

async def health(http: HttpRequest):
    engine = _server(http).engine
    if engine.error is not None:
        return error_response(503, f"the engine stopped: {engine.error!r}", kind="server_error")
    return {"status": "ok", "weights_version": engine.weights_version}


async def metrics(http: HttpRequest):
    server = _server(http)
    extra = server.on_metrics() if server.on_metrics else {}
    return PlainTextResponse(prometheus_text({**server.engine.snapshot(), **extra}))


async def models(http: HttpRequest):
    server = _server(http)
    return {"object": "list", "data": [{"id": server.model_name, "object": "model", "owned_by": "glm5_jax",
                                        "max_model_len": server.engine.max_seq_len}]}


# ---- /v1/completions ----

def _completion_logprobs(server: ServerState, tokens: list[Token], offset: int, echoed: list[int] | None = None,
                         echoed_scores: list[Token | None] | None = None) -> dict:
    """OpenAI's legacy logprobs: per token its text, log-prob, top alternatives {text: log-prob} and
    character offset. With `echoed` (prompt ids) those come first; the first prompt token has no
    log-prob (null), and a prompt that was not scored has null log-probs throughout."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    entries = [(i, echoed_scores[k] if echoed_scores else None) for k, i in enumerate(echoed or [])]
    for token_id, t in entries + [(t.id, t) for t in tokens]:
        s = server.token_text(token_id)
        out["tokens"].append(s)
        out["token_logprobs"].append(None if t is None else t.logprob)
        top = None
        if t is not None:
            top = {}
            for i, lp in t.top:              # ids that decode alike keep the best log-prob
                top.setdefault(server.token_text(i), lp)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(s)
    return out


async def _completion_events(server: ServerState, http: HttpRequest, body: CompletionRequest, streams: _Streams,
                             requests: list[Request], texts: list[TextStream], head: dict):
    offsets = [0] * len(requests)
    async for index, token in server.run_all(http, streams, requests):
        r = requests[index]
        ids = [t.id for t in r.tokens]
        delta = texts[index].delta(ids, finished=token is None)
        choice = {"index": index, "text": delta, "logprobs": None, "finish_reason": None}
        if token is not None and body.logprobs is not None:
            choice["logprobs"] = _completion_logprobs(server, [token], offsets[index])
            offsets[index] += len(server.token_text(token.id))
        if token is None:
            choice["finish_reason"] = r.finish_reason
        if delta or token is None or choice["logprobs"]:
            yield _sse({**head, "choices": [choice]})
    if body.include_usage:
        yield _sse({**head, "choices": [], "usage": _usage(requests)})
    yield "data: [DONE]\n\n"


async def completions(body: CompletionRequest, http: HttpRequest):
    server = _server(http)
    server.note_model(http, body.model)
    server.check_alive()
    try:
        prompts = body.prompts()
    except ValueError as e:
        raise RequestError(str(e)) from None
    if body.completion_tokens == 0 and not body.echo:
        raise RequestError("max_tokens=0 generates nothing: it needs echo=true (the prompt's log-probs)")
    if body.echo and body.stream:
        raise RequestError("echo=true is not supported with stream=true")
    prompt_ids = [server.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    streams, requests, texts, echoes = _Streams(), [], [], []
    for prompt, ids in zip(prompts, prompt_ids):
        for copy in range(body.n):
            text = TextStream(server.tokenizer, body.stop)
            request = server.build(ids, body, body.completion_tokens, body.logprobs or 0, text, copy,
                                   prompt_logprobs=body.scores_prompt)
            requests.append(streams.attach(len(requests), request))
            texts.append(text)
            echoes.append(prompt if isinstance(prompt, str) else server.tokenizer.decode(ids))
    for r in requests:
        server.engine.validate(r)
    server.note_requests(http, requests)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": server.model_name}

    if body.stream:
        return StreamingResponse(_completion_events(server, http, body, streams, requests, texts, head),
                                 media_type="text/event-stream")

    await server.finish_all(http, streams, requests)
    choices = []
    for i, (r, text) in enumerate(zip(requests, texts)):
        completion = text.full_text([t.id for t in r.tokens])[0]
        logprobs = None
        if body.logprobs is not None:
            logprobs = (_completion_logprobs(server, r.tokens, 0, r.prompt, r.prompt_scores) if body.echo
                        else _completion_logprobs(server, r.tokens, 0))
        choices.append({"index": i, "text": echoes[i] + completion if body.echo else completion,
                        "logprobs": logprobs, "finish_reason": r.finish_reason})
    return {**head, "choices": choices, "usage": _usage(requests)}


# ---- /v1/chat/completions ----

def _chat_logprobs(server: ServerState, tokens: list[Token]) -> dict:
    def entry(i, lp):
        s = server.token_text(i)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}
    return {"content": [{**entry(t.id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                        for t in tokens]}


async def _chat_events(server: ServerState, http: HttpRequest, body: ChatRequest, streams: _Streams,
                       requests: list[Request], texts: list[TextStream], head: dict):
    for i in range(len(requests)):
        yield _sse({**head, "object": "chat.completion.chunk", "choices": [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}]})
    async for index, token in server.run_all(http, streams, requests):
        r = requests[index]
        delta = texts[index].delta([t.id for t in r.tokens], finished=token is None)
        choice = {"index": index, "delta": {"content": delta} if delta else {},
                  "logprobs": _chat_logprobs(server, [token]) if token is not None and body.logprobs else None,
                  "finish_reason": r.finish_reason if token is None else None}
        if delta or token is None or choice["logprobs"]:
            yield _sse({**head, "object": "chat.completion.chunk", "choices": [choice]})
    if body.include_usage:
        yield _sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": _usage(requests)})
    yield "data: [DONE]\n\n"


async def chat(body: ChatRequest, http: HttpRequest):
    server = _server(http)
    server.note_model(http, body.model)
    server.check_alive()
    if body.top_logprobs and not body.logprobs:
        raise RequestError("top_logprobs needs logprobs=true")
    try:
        prompt = server.template.render([{"role": m.role, "content": m.text()} for m in body.messages])
    except Exception as e:   # a template's raise_exception, or a rendering error
        raise RequestError(f"cannot apply the chat template: {e}") from None
    ids = server.encode(prompt)
    max_tokens = body.token_budget or max(server.engine.max_seq_len - len(ids), 1)
    streams, requests, texts = _Streams(), [], []
    for copy in range(body.n):
        text = TextStream(server.tokenizer, body.stop)
        requests.append(streams.attach(copy, server.build(ids, body, max_tokens, body.top_logprobs or 0, text,
                                                          copy)))
        texts.append(text)
    for r in requests:
        server.engine.validate(r)
    server.note_requests(http, requests)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "created": created, "model": server.model_name}

    if body.stream:
        return StreamingResponse(_chat_events(server, http, body, streams, requests, texts, head),
                                 media_type="text/event-stream")

    await server.finish_all(http, streams, requests)
    choices = [{"index": i,
                "message": {"role": "assistant", "content": text.full_text([t.id for t in r.tokens])[0]},
                "logprobs": _chat_logprobs(server, r.tokens) if body.logprobs else None,
                "finish_reason": r.finish_reason}
               for i, (r, text) in enumerate(zip(requests, texts))]
    return {**head, "object": "chat.completion", "choices": choices, "usage": _usage(requests)}


# ---- /v1/tokens: token in, token out ----

async def tokens(body: TokenRequest, http: HttpRequest):
    server = _server(http)
    server.note_model(http, body.model)
    server.check_alive()
    if body.stream:
        raise RequestError("/v1/tokens does not stream")
    if body.return_routing and not server.engine.cfg.runtime.capture_routing:
        raise RequestError("return_routing: this server's model does not record routing (an RL policy server "
                           "records it with rl.replay_experts / rl.replay_topk)")
    if body.min_weights_version is not None:
        await server.wait_for_weights(body.min_weights_version)
    streams = _Streams()
    requests = [streams.attach(i, server.build(list(body.prompt_ids), body, body.max_tokens, body.top_logprobs,
                                               None, i))
                for i in range(body.n)]
    for r in requests:
        server.engine.validate(r)
    server.note_requests(http, requests)
    await server.finish_all(http, streams, requests)
    choices = [{"index": i, "token_ids": [t.id for t in r.tokens], "logprobs": [t.logprob for t in r.tokens],
                "top_logprobs": [[list(p) for p in t.top] for t in r.tokens] if body.top_logprobs else None,
                "finish_reason": r.finish_reason, "weights_version": r.weights_version,
                "token_weights_versions": [t.weights_version for t in r.tokens],
                **({"routing": encode_routing(r.routing)} if body.return_routing else {})}
               for i, r in enumerate(requests)]
    return {"id": f"tok-{uuid.uuid4().hex}", "object": "tokens", "model": server.model_name,
            "prompt_ids": list(body.prompt_ids), "choices": choices, "usage": _usage(requests)}


def create_app(engine: Engine, tokenizer, model_name: str = "glm5", chat_template: ChatTemplate | None = None,
               on_metrics=None, api_key: str | None = None, log_requests: bool = False) -> FastAPI:
    """The FastAPI app. `on_metrics()` may add extra gauges (dict) to /metrics; with `api_key` every
    endpoint but /health needs ``Authorization: Bearer <api_key>``; with `log_requests` every request is
    logged (`RequestLog`: the serve CLI's; an RL policy server, answering thousands of calls, does not)."""
    app = FastAPI(title="glm5_jax serve")
    require_api_key(app, api_key)
    if log_requests:
        app.add_middleware(RequestLog)             # outermost: it sees the 401s too
    app.state.server = ServerState(engine, tokenizer, model_name, chat_template or ChatTemplate(), on_metrics)
    for error, handler in ((RequestValidationError, _invalid), (HTTPException, _http), (RequestError, _bad),
                           (_Unavailable, _down), (_UnknownModel, _unknown_model)):
        app.add_exception_handler(error, handler)
    app.get("/health")(health)
    app.get("/metrics")(metrics)
    app.get("/v1/models")(models)
    app.post("/v1/completions")(completions)
    app.post("/v1/chat/completions")(chat)
    app.post("/v1/tokens")(tokens)
    return app
