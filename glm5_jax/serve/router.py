"""python -m glm5_jax.serve.router --replicas=http://127.0.0.1:8001,http://127.0.0.1:8002 [--port=8000]

A data-parallel front for several `glm5_jax.serve` processes: the same HTTP API, each request forwarded
to one replica chosen by `glm5_jax.serve.routing.RoutingTable` (session / prefix affinity, else the least
loaded). A replica that refuses connections or fails /health is marked dead and skipped until a health
check sees it again; a request whose replica fails before answering is retried on another one.
The replica that served a request is named in the ``x-replica`` response header. With --api_key (or
GLM5_API_KEY) the router asks clients for the key, and it forwards the client's Authorization header
to the replicas, which check the same key.
"""
from __future__ import annotations

import asyncio
import contextlib
import json

import httpx2
from absl import app, flags
from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from glm5_jax.platforms import skip_absent_tpu
from glm5_jax.serve.api import error_response
from glm5_jax.serve.auth import require_api_key, resolve_api_key
from glm5_jax.serve.metrics import prometheus_text
from glm5_jax.serve.routing import RoutingTable, prompt_items

FORWARDED = ("/v1/completions", "/v1/chat/completions", "/v1/tokens")


def create_router(replicas: list[str], health_interval_s: float = 1.0, timeout_s: float = 600.0,
                  policy: str = "affinity", api_key: str | None = None) -> FastAPI:
    replicas = [r.rstrip("/") for r in replicas]
    table = RoutingTable(len(replicas), policy=policy)
    state = {}

    async def check_health():
        client = state["client"]
        for i, url in enumerate(replicas):
            try:
                table.alive[i] = (await client.get(url + "/health", timeout=2.0)).status_code == 200
            except httpx2.HTTPError:
                table.alive[i] = False

    async def health_loop():
        while True:
            await check_health()
            await asyncio.sleep(health_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        state["client"] = httpx2.AsyncClient(timeout=timeout_s)
        await check_health()
        task = asyncio.create_task(health_loop())
        yield
        task.cancel()
        await state["client"].aclose()

    api = FastAPI(title="glm5_jax serve router", lifespan=lifespan)
    require_api_key(api, api_key)

    def auth_header(http: HttpRequest) -> dict:
        """The client's credentials, passed on to a replica."""
        value = http.headers.get("authorization")
        return {"authorization": value} if value else {}

    @api.get("/health")
    async def health():
        live = [url for url, ok in zip(replicas, table.alive) if ok]
        body = {"status": "ok" if live else "no live replica", "replicas": dict(zip(replicas, table.alive))}
        return JSONResponse(body, 200 if live else 503)

    @api.get("/metrics")
    async def metrics():
        values = {f"router_{k}": v for k, v in table.stats.items()}
        values.update({f"replica{i}_alive": int(a) for i, a in enumerate(table.alive)})
        values.update({f"replica{i}_in_flight": n for i, n in enumerate(table.in_flight)})
        return PlainTextResponse(prometheus_text(values))

    @api.get("/v1/models")
    async def models(http: HttpRequest):
        for i in range(len(replicas)):
            if table.alive[i]:
                r = await state["client"].get(replicas[i] + "/v1/models", headers=auth_header(http))
                return Response(r.content, r.status_code, media_type="application/json")
        return error_response(503, "no live replica", kind="server_error")

    async def forward(path: str, http: HttpRequest):
        raw = await http.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        body = body if isinstance(body, dict) else {}
        items = prompt_items(path, body)
        session = http.headers.get("x-session-id") or body.get("session_id") or body.get("user")
        headers = {"content-type": http.headers.get("content-type", "application/json"), **auth_header(http)}
        tried = set()
        while True:
            replica = table.choose(items, session, exclude=tried)
            if replica is None:
                return error_response(503, f"no live replica (tried {len(tried)} of {len(replicas)})",
                                      kind="server_error")
            tried.add(replica)
            table.in_flight[replica] += 1
            client = state["client"]
            try:
                upstream = await client.send(client.build_request("POST", replicas[replica] + path, content=raw,
                                                                  headers=headers), stream=True)
            except httpx2.TransportError:
                table.in_flight[replica] -= 1
                table.alive[replica] = False           # until the next health check says otherwise
                continue
            if upstream.status_code < 400:
                table.record(replica, items, session)
            out_headers = {"x-replica": str(replica)}
            media = upstream.headers.get("content-type")

            async def done(upstream=upstream, replica=replica):
                await upstream.aclose()
                table.in_flight[replica] -= 1

            if media and media.startswith("text/event-stream"):
                return StreamingResponse(upstream.aiter_raw(), upstream.status_code, out_headers, media_type=media,
                                         background=BackgroundTask(done))
            try:
                content = await upstream.aread()
            finally:
                await done()
            return Response(content, upstream.status_code, out_headers, media_type=media)

    def endpoint(path):
        async def route(http: HttpRequest):
            return await forward(path, http)
        return route

    for path in FORWARDED:
        api.add_api_route(path, endpoint(path), methods=["POST"])
    api.state.table = table
    return api


FLAGS = flags.FLAGS
flags.DEFINE_list("replicas", None, "Comma-separated base URLs of glm5_jax.serve processes.")
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
flags.DEFINE_integer("port", 8000, "Port to listen on.")
flags.DEFINE_float("health_interval_s", 1.0, "Seconds between replica health checks.")
flags.DEFINE_enum("policy", "affinity", ["affinity", "round_robin"], "Routing policy (see routing.py).")
flags.DEFINE_string("api_key", None, "Require this key from clients (default: GLM5_API_KEY); it is forwarded.")


def main(argv):
    skip_absent_tpu()
    del argv
    import uvicorn

    if not FLAGS.replicas:
        raise app.UsageError("give --replicas=URL,URL,...")
    router = create_router(FLAGS.replicas, FLAGS.health_interval_s, policy=FLAGS.policy,
                           api_key=resolve_api_key(FLAGS.api_key))
    uvicorn.run(router, host=FLAGS.host, port=FLAGS.port, log_level="warning")


if __name__ == "__main__":
    app.run(main)
