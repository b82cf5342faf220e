"""Malformed requests get a 4xx naming the problem and the server keeps serving; an unknown model gets vLLM's
404; a client that goes away frees its slot; every request is logged in one line."""
import json
import logging
import re
import time

import httpx2
import pytest

from glm5_jax.serve.api import create_app
from glm5_jax.serve.threaded import ThreadedServer
from tests.serve.conftest import MAX_SEQ_LEN, make_engine, tokenizer

C, CHAT, TOK = "/v1/completions", "/v1/chat/completions", "/v1/tokens"
OK_CHAT = [{"role": "user", "content": "hi"}]
# (method, path, body (dict or raw str), status, words the error message must contain)
CASES = [
    ("POST", C, "{not json", 400, "not valid JSON"),
    ("POST", C, "[1, 2]", 400, "body"),
    ("POST", C, {"max_tokens": 4}, 400, "prompt"),
    ("POST", C, {"prompt": 5}, 400, "prompt"),
    ("POST", C, {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("POST", C, {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("POST", C, {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ("POST", C, {"prompt": "a", "n": 0}, 400, "n"),
    ("POST", C, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("POST", C, {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("POST", C, {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("POST", C, {"prompt": "a", "echo": True, "stream": True}, 400, "echo"),
    ("POST", C, {"prompt": "", "max_tokens": 2}, 400, "empty"),
    ("POST", C, {"prompt": [3, 99999]}, 400, "token ids"),
    ("POST", C, {"prompt": [3] * MAX_SEQ_LEN}, 400, "context"),
    ("POST", C, {"prompt": [3] * 10, "max_tokens": MAX_SEQ_LEN}, 400, "exceeds the context"),
    ("POST", C, {"prompt": ["a", 3]}, 400, "prompt"),
    ("POST", CHAT, {"messages": []}, 400, "messages"),
    ("POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("POST", CHAT, {"messages": OK_CHAT, "top_logprobs": 2}, 400, "logprobs=true"),
    ("POST", TOK, {"prompt_ids": [1, 2]}, 400, "max_tokens"),
    ("POST", TOK, {"prompt_ids": ["1"], "max_tokens": 2}, 400, "prompt_ids"),
    ("POST", TOK, {"prompt_ids": [1], "max_tokens": 2, "stream": True}, 400, "stream"),
    ("GET", C, None, 405, "Method Not Allowed"),
    ("POST", "/v1/nothing", {}, 404, "Not Found"),
]


class SlowDecode:
    """The engine's decode program, 50 ms slower per step (so a request outlives its client here)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        time.sleep(0.05)
        return self.fn(*args)


@pytest.fixture(scope="module")
def server():
    engine = make_engine()
    engine._decode = SlowDecode(engine._decode)
    engine.start()
    live = ThreadedServer(create_app(engine, tokenizer(), "tiny", log_requests=True))
    yield engine, live.url
    live.close()
    engine.stop()


def test_malformed_requests_get_4xx_with_a_message(server):
    engine, url = server
    with httpx2.Client(base_url=url, timeout=30) as http:
        for method, path, body, status, words in CASES:
            content = body if isinstance(body, str) else None if body is None else json.dumps(body)
            r = http.request(method, path, content=content, headers={"content-type": "application/json"})
            assert r.status_code == status, (path, body, r.status_code, r.text)
            message = r.json()["error"]["message"]
            assert words.lower() in message.lower(), (body, message)
        assert http.get("/health").json()["status"] == "ok"
        ok = http.post(C, json={"prompt": "def", "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert engine.snapshot()["requests"] == 1                 # no bad request reached the engine


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_slot(server, stream):
    engine, url = server
    aborted = engine.stats["finished_abort"]
    body = {"prompt_ids": [5], "max_tokens": MAX_SEQ_LEN - 1, "ignore_eos": True}
    with httpx2.Client(base_url=url, timeout=0.5) as http:
        if stream:
            # greedy: a sampled completion could draw an EOS id and finish before the hang-up is seen (the
            # completions API has no ignore_eos; the tiny model's greedy continuation of [5] has no EOS)
            with http.stream("POST", C, json={"prompt": [5], "max_tokens": MAX_SEQ_LEN - 1, "stream": True,
                                              "temperature": 0}) as r:
                next(r.iter_lines())                       # the first token arrived; then hang up
        else:
            with pytest.raises(httpx2.TimeoutException):
                http.post(TOK, json=body)
    deadline = time.monotonic() + 20
    while engine.snapshot()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.snapshot()["running"] == 0
    assert engine.stats["finished_abort"] == aborted + 1
    assert engine.stats["generated_tokens"] < engine.stats["prompt_tokens"] + MAX_SEQ_LEN   # cut short


def test_an_unknown_model_gets_404_as_vllm_answers(server):
    engine, url = server
    requests = engine.snapshot()["requests"]
    with httpx2.Client(base_url=url, timeout=30) as http:
        for path, body in ((C, {"prompt": "def", "max_tokens": 2}), (CHAT, {"messages": OK_CHAT}),
                           (TOK, {"prompt_ids": [5], "max_tokens": 2})):
            r = http.post(path, json={**body, "model": "gpt-4"})
            assert r.status_code == 404
            assert r.json() == {"error": {"message": "The model `gpt-4` does not exist.", "type": "NotFoundError",
                                          "param": "model", "code": 404}}
        assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert http.post(C, json={"prompt": "def", "max_tokens": 2, "model": "tiny"}).status_code == 200
    assert engine.snapshot()["requests"] == requests + 1


def test_each_request_is_logged_once_it_is_answered(server, caplog):
    _, url = server
    caplog.set_level(logging.INFO, logger="glm5_jax.serve")
    with httpx2.Client(base_url=url, timeout=30) as http:
        ok = http.post(C, json={"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "n": 2})
        with http.stream("POST", C, json={"prompt": [5, 6], "max_tokens": 2, "temperature": 0, "stream": True,
                                          "model": "tiny"}) as r:
            list(r.iter_lines())
        http.post(TOK, json={"prompt_ids": [5], "max_tokens": 2, "model": "other"})
        http.post(C, json={"prompt": "a", "top_p": 0})
        http.get("/health")
    assert ok.json()["usage"]["completion_tokens"] == 6
    deadline = time.monotonic() + 5                    # the server thread logs after the response went out
    while len(caplog.records) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    lines = [re.sub(r"latency_ms=\d+\.\d$", "latency_ms=T", r.getMessage()) for r in caplog.records
             if r.name == "glm5_jax.serve"]
    # a stream's line comes once its last event is sent, which may be after the client read it: any order
    assert sorted(lines) == sorted([
        "POST /v1/completions model=tiny prompt_tokens=6 completion_tokens=6 status=200 latency_ms=T",   # n=2
        "POST /v1/completions model=tiny prompt_tokens=2 completion_tokens=2 status=200 latency_ms=T",
        "POST /v1/tokens model=other prompt_tokens=0 completion_tokens=0 status=404 latency_ms=T",
        "POST /v1/completions model=- prompt_tokens=0 completion_tokens=0 status=400 latency_ms=T",   # invalid body
    ])
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "glm5_jax.serve")
