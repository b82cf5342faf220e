"""An API key for the HTTP API: every endpoint except ``/health`` answers 401 without
``Authorization: Bearer <key>`` (the header OpenAI clients, lm-eval and vLLM's ``--api-key`` use).

The key comes from ``--api_key`` or the ``GLM5_API_KEY`` environment variable; with neither, the API is
open (bind it to loopback). Clients of this project (the router, RL generators) send the same key.
"""
from __future__ import annotations

import hmac
import os

from fastapi.responses import JSONResponse

API_KEY_ENV = "GLM5_API_KEY"
OPEN_PATHS = frozenset({"/health"})


def resolve_api_key(flag_value: str | None = None) -> str | None:
    """The key to require or send: the flag's value, else the environment variable's, else None."""
    key = flag_value if flag_value is not None else os.environ.get(API_KEY_ENV)
    return key or None


def bearer_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _authorized(header: str | None, api_key: str) -> bool:
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def require_api_key(app, api_key: str | None) -> None:
    """Make `app` (FastAPI) refuse requests without the key; nothing changes when `api_key` is None."""
    if not api_key:
        return

    @app.middleware("http")
    async def _check(request, call_next):
        if request.url.path in OPEN_PATHS or _authorized(request.headers.get("authorization"), api_key):
            return await call_next(request)
        message = ("missing API key: send 'Authorization: Bearer <key>'" if "authorization" not in request.headers
                   else "invalid API key")
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": "invalid_api_key"}}, 401, headers={"WWW-Authenticate": "Bearer"})
