"""--api_key: every endpoint but /health needs the bearer key; the router forwards it; RL clients send it."""
import httpx2
import openai
import pytest

from glm5_jax.rl.env import ServerPolicy
from glm5_jax.serve.api import create_app
from glm5_jax.serve.auth import API_KEY_ENV, resolve_api_key
from glm5_jax.serve.router import create_router
from glm5_jax.serve.threaded import ThreadedServer
from tests.serve.conftest import greedy_reference, tokenizer

KEY = "s3cret-key"
PROMPT = "def add(x, y):"


@pytest.fixture(scope="module")
def keyed(served):
    engine, open_url = served
    server = ThreadedServer(create_app(engine, tokenizer(), "tiny", api_key=KEY))
    router = ThreadedServer(create_router([server.url], health_interval_s=0.2, api_key=KEY))
    yield open_url, server.url, router.url
    router.close()
    server.close()


def _client(url, key):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_a_key_is_required_and_forwarded(keyed):
    open_url, server_url, router_url = keyed
    (want, _), = greedy_reference([tokenizer().encode(PROMPT).tolist()], 4)
    for url in (server_url, router_url):
        with pytest.raises(openai.AuthenticationError, match="invalid API key"):
            _client(url, "wrong").completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
        out = _client(url, KEY).completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
        assert out.choices[0].text == tokenizer().decode(want)
        with pytest.raises(openai.AuthenticationError):
            _client(url, KEY + "x").models.list()
        assert [m.id for m in _client(url, KEY).models.list().data] == ["tiny"]
    with httpx2.Client(timeout=60) as http:
        assert http.get(server_url + "/health").status_code == 200           # health stays open
        r = http.post(server_url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]
        assert http.get(server_url + "/metrics").status_code == 401
        # no key configured: open as before
        assert http.post(open_url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).status_code == 200


def test_rl_server_policy_sends_the_key(keyed, monkeypatch):
    _, server_url, router_url = keyed
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert resolve_api_key() == KEY and resolve_api_key("flag") == "flag"
    ids = tokenizer().encode(PROMPT).tolist()
    (want, _), = greedy_reference([ids], 3)
    for url in (server_url, router_url):
        policy = ServerPolicy(url, temperature=0.0)           # the key from GLM5_API_KEY
        assert policy(ids, 3, []).token_ids == want
        policy.close()
    with pytest.raises(RuntimeError, match="401"):
        ServerPolicy(server_url, temperature=0.0, api_key="wrong")(ids, 3, [])
