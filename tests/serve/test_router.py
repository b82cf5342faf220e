"""The router: session / prefix affinity, least-loaded placement, dead replicas routed around."""
import httpx2
import pytest

from glm5_jax.serve.api import create_app
from glm5_jax.serve.threaded import ThreadedServer
from glm5_jax.serve.router import create_router
from glm5_jax.serve.routing import RoutingTable, prompt_items
from tests.serve.conftest import make_engine, tokenizer


def test_routing_table_policy():
    table = RoutingTable(3)
    table.in_flight = [2, 0, 1]
    assert table.choose([1, 2, 3]) == 1                          # new: least loaded
    table.in_flight, table.routed = [0, 0, 0], [3, 1, 2]
    assert table.choose([1, 2, 3]) == 1                          # a tie: the one given the fewest so far
    table.in_flight = [2, 0, 1]
    table.record(1, [1, 2, 3])
    table.in_flight = [0, 5, 5]
    assert table.choose([1, 2, 3, 9, 4]) == 1                    # an earlier prompt is its prefix
    assert table.choose([1, 2]) == 0                             # a shorter prompt is not a continuation
    table.record(2, ["a"], session="s")
    assert table.choose(["zzz"], session="s") == 2               # the session wins over load
    table.alive[2] = False
    assert table.choose(["zzz"], session="s") == 0               # dead: rerouted to a live one
    table.alive[1] = False
    assert table.choose([1, 2, 3, 7]) == 0
    table.alive[0] = False
    assert table.choose([5]) is None
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    longer = {"messages": chat["messages"] + [{"role": "assistant", "content": "yo"}]}
    round_robin = RoutingTable(2, policy="round_robin")
    round_robin.record(0, [1, 2], session="s")
    assert [round_robin.choose([1, 2, 3], session="s") for _ in range(3)] == [1, 0, 1]
    assert prompt_items("/v1/chat/completions", longer)[:1] == prompt_items("/v1/chat/completions", chat)


@pytest.fixture(scope="module")
def cluster():
    engines = [make_engine().start() for _ in range(2)]
    replicas = [ThreadedServer(create_app(e, tokenizer(), "tiny")) for e in engines]
    router = ThreadedServer(create_router([r.url for r in replicas], health_interval_s=0.2))
    yield engines, replicas, router
    for server in [router] + replicas:
        server.close()
    for e in engines:
        e.stop()


def test_sessions_stick_to_the_replica_holding_their_prefix(cluster):
    engines, replicas, router = cluster
    with httpx2.Client(base_url=router.url, timeout=60) as http:
        placed, prompts = {}, {}
        for s in range(4):
            prompt = [10 + s, 11, 12, 13]
            r = http.post("/v1/tokens", json={"prompt_ids": prompt, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200
            placed[s] = r.headers["x-replica"]
            prompts[s] = prompt + r.json()["choices"][0]["token_ids"] + [7]
        assert sorted(placed.values()) == ["0", "0", "1", "1"]     # idle replicas share new sessions
        for s in range(4):                                       # second turn: prompt + completion + new input
            r = http.post("/v1/tokens", json={"prompt_ids": prompts[s], "max_tokens": 4, "temperature": 0})
            assert r.headers["x-replica"] == placed[s]
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompts[s]) - 2
        metrics = http.get("/metrics").text
        assert "glm5_serve_router_prefix_hits 4" in metrics

        # a dead replica is routed around, its sessions included
        dead = placed[0]
        replicas[int(dead)].close()
        for s in range(4):
            r = http.post("/v1/tokens", json={"prompt_ids": prompts[s], "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200 and r.headers["x-replica"] != dead
        assert http.get("/health").json()["replicas"][replicas[int(dead)].url] is False
