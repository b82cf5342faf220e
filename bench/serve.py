"""Serving: throughput and latency of the HTTP server, batching on vs off, and router prefix affinity.

Everything runs in this process on loopback: engines and uvicorn servers in threads, clients as threads
speaking HTTP to the token-level endpoint (/v1/tokens; random prompt ids, no tokenizer). Weights are
random; ``--model=tiny`` (the default) is a 2-layer GLM-5 with DSA and MoE, small enough for a CPU.

1. ``load``: C concurrent clients (C = 1, 8, 32), each sending requests back to back (prompt 16-48 ids,
   32 new tokens, greedy, EOS ignored), against an engine with max_batch 32 (continuous batching) and with
   max_batch 1 (one request at a time). Reports generated tokens/s over the run and p50 / p99 request
   latency.
2. ``affinity``: a multi-turn workload (S sessions x K turns; each turn's prompt is the previous prompt,
   its completion and 8 new ids) through the router over 2 replicas, with prefix/session affinity and
   with round robin. Reports the prefix hit rate (prompt tokens whose cache rows were reused / all prompt
   tokens) and tokens/s.

Numbers from a loaded shared machine are unreliable; rerun quietly for the record:

    python bench/serve.py --out=bench/results/serve.json
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import httpx2  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax.core import meta  # noqa: E402

from glm5_jax import ModelConfig, RuntimeConfig, Transformer  # noqa: E402
from glm5_jax.serve.api import create_app  # noqa: E402
from glm5_jax.serve.engine import Engine  # noqa: E402
from glm5_jax.serve.router import create_router  # noqa: E402
from glm5_jax.serve.threaded import ThreadedServer  # noqa: E402

TINY = ModelConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, first_k_dense_replace=1,
                   intermediate_size=96, num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32,
                   qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=20, index_n_heads=8, index_head_dim=32,
                   index_topk=8, indexer_types=("full", "shared"), n_routed_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=32, n_group=2, topk_group=1, initializer_range=0.1,
                   num_nextn_predict_layers=0, mtp_depth=0,
                   max_position_embeddings=1024, runtime=RuntimeConfig(remat_policy="none"))
MAX_SEQ_LEN = 512
NEW_TOKENS = 32


def serving(cfg, variables, max_batch):
    engine = Engine(cfg, variables, max_batch=max_batch, max_seq_len=MAX_SEQ_LEN, prefill_buckets=(64,))
    engine.warmup((1, 100))
    return engine.start(), ThreadedServer(create_app(engine, None, "bench"))


def ask(http, prompt, max_tokens=NEW_TOKENS):
    r = http.post("/v1/tokens", json={"prompt_ids": prompt, "max_tokens": max_tokens, "temperature": 0,
                                      "ignore_eos": True})
    r.raise_for_status()
    return r.json()


def run_threads(fn, n) -> float:
    """Run fn(0) .. fn(n - 1) on n threads; wall seconds until all finished."""
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def load_run(url, clients, requests_per_client, seed):
    latencies, tokens = [], [0]
    lock = threading.Lock()

    def client(c):
        rng = np.random.default_rng(seed * 1000 + c)
        with httpx2.Client(base_url=url, timeout=600) as http:
            for _ in range(requests_per_client):
                prompt = rng.integers(2, 500, int(rng.integers(16, 49))).tolist()
                t0 = time.perf_counter()
                out = ask(http, prompt)
                with lock:
                    latencies.append(time.perf_counter() - t0)
                    tokens[0] += out["usage"]["completion_tokens"]

    wall = run_threads(client, clients)
    q = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else latencies * 99
    return {"clients": clients, "requests": len(latencies), "tokens_per_sec": tokens[0] / wall,
            "p50_latency_s": q[49], "p99_latency_s": q[98], "wall_s": wall}


def affinity_run(urls, policy, sessions, turns, seed):
    router = ThreadedServer(create_router(urls, health_interval_s=1.0, policy=policy))
    prompt_tokens, cached, generated = [0], [0], [0]
    lock = threading.Lock()

    def session(s):
        rng = np.random.default_rng(seed * 1000 + s)
        prompt = rng.integers(2, 500, 24).tolist()
        with httpx2.Client(base_url=router.url, timeout=600) as http:
            for _ in range(turns):
                out = ask(http, prompt, 16)
                with lock:
                    prompt_tokens[0] += out["usage"]["prompt_tokens"]
                    cached[0] += out["usage"]["prompt_tokens_details"]["cached_tokens"]
                    generated[0] += out["usage"]["completion_tokens"]
                prompt = prompt + out["choices"][0]["token_ids"] + rng.integers(2, 500, 8).tolist()

    wall = run_threads(session, sessions)
    router.close()
    return {"policy": policy, "sessions": sessions, "turns": turns, "prefix_hit_rate": cached[0] / prompt_tokens[0],
            "tokens_per_sec": generated[0] / wall, "wall_s": wall}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=["tiny"])
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--requests_per_client", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cfg = TINY
    variables = meta.unbox(jax.jit(Transformer(cfg).init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))

    load = []
    for max_batch, mode in ((32, "continuous batching"), (1, "one at a time")):
        engine, server = serving(cfg, variables, max_batch)
        for c in (int(x) for x in args.clients.split(",")):
            row = {"mode": mode, "max_batch": max_batch, **load_run(server.url, c, args.requests_per_client, c)}
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
            load.append(row)
        server.close()
        engine.stop()

    replicas = [serving(cfg, variables, 8) for _ in range(2)]
    urls = [s.url for _, s in replicas]
    affinity = []
    for policy in ("affinity", "round_robin"):
        for engine, _ in replicas:              # start each policy from empty prefix caches
            engine.set_variables(variables, engine.weights_version + 1)
        row = affinity_run(urls, policy, args.sessions, args.turns, seed=1)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        affinity.append(row)
    for engine, server in replicas:
        server.close()
        engine.stop()

    print("\n| mode | clients | requests | tokens/s | p50 latency (s) | p99 latency (s) |\n|---|---|---|---|---|---|")
    for r in load:
        print(f"| {r['mode']} | {r['clients']} | {r['requests']} | {r['tokens_per_sec']:.1f} | "
              f"{r['p50_latency_s']:.3f} | {r['p99_latency_s']:.3f} |")
    print("\n| router policy | sessions x turns | prefix hit rate | tokens/s |\n|---|---|---|---|")
    for r in affinity:
        print(f"| {r['policy']} | {r['sessions']} x {r['turns']} | {r['prefix_hit_rate']:.3f} | "
              f"{r['tokens_per_sec']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "config": dataclasses.asdict(cfg), "max_seq_len": MAX_SEQ_LEN,
                       "new_tokens": NEW_TOKENS, "load": load, "affinity": affinity,
                       "note": "measured on a shared, loaded 2-core machine: unreliable"}, f, indent=1,
                      default=str)


if __name__ == "__main__":
    main()
