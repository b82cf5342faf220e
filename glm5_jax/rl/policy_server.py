"""A policy server for multi-turn RL: the serving engine and HTTP API (glm5_jax.serve) over an RL run's
newest committed policy version, hot-reloading each newer one.

    python -m glm5_jax.rl.policy_server --config=configs/rl_guess.py --workdir=W --port=8101

It serves the sampler's model (`sampler_model_config`: the RL policy, in rl.sampler_dtype when set) on its
own sampling mesh (rl.sampler_mesh; one device by default; agentic.server_max_batch a multiple of its batch
shards), so the log-probs it returns are the ones the learner recomputes (TITO). It waits for the learner's first
version, then reloads every `agentic.reload_interval_s`; each answer names the version it was sampled
with. Restarted after a crash, it starts from the newest committed version.

A reload lands between two decode steps: running requests go on under the new weights on the cache rows the
old ones wrote, and every token carries the version that sampled it. With rl.inflight_updates the rows of
finished turns stay reusable across versions too (`Engine(keep_stale_prefix=True)`), so the next turn of an
episode prefills only its new observation (docs/rl.md#in-flight-weight-updates).
"""
from __future__ import annotations

import logging
import socket
import time

from glm5_jax.platforms import skip_absent_tpu

log = logging.getLogger("glm5_jax.rl")


def engine_seq_len(agentic, max_position_embeddings: int) -> int:
    """Context per cache row: room for a whole episode, and for a power-of-two prefill chunk after its
    cached prefix (twice the episode, at least 16), below the model's position limit."""
    episode = 1 + agentic.completion_width
    return min(max(16, 2 * (1 << (episode - 1).bit_length())), max_position_embeddings - 1)


def build_engine(exp, sft_cfg, workdir: str):
    """(engine started on the newest committed version, weights watcher started)."""
    from glm5_jax.checkpoint.handoff import PolicyReader
    from glm5_jax.rl.agentic import make_env, stop_token_ids
    from glm5_jax.rl.policy import sampling_policy
    from glm5_jax.serve.engine import Engine
    from glm5_jax.serve.reload import PolicySource, WeightsWatcher

    ag = exp.agentic
    policy = sampling_policy(exp.rl, sft_cfg.model)  # rl.sampler_mesh (default: one device)
    cfg = policy.cfg
    reader = PolicyReader(workdir)
    while (version := reader.latest_version()) is None:
        time.sleep(ag.reload_interval_s)
    variables = reader.restore_variables(version, policy.abstract_variables)
    seq_len = engine_seq_len(ag, cfg.max_position_embeddings)
    engine = Engine(cfg, variables, max_batch=ag.server_max_batch, max_seq_len=seq_len,
                    eos_ids=stop_token_ids(make_env(exp.rl.task, ag)), weights_version=version,
                    prefill_buckets=(16,), mesh=policy.mesh if policy.mesh.size > 1 else None,
                    keep_stale_prefix=exp.rl.inflight_updates)
    engine.warmup((1,))
    engine.start()
    watcher = WeightsWatcher(engine, PolicySource(workdir, variables), cfg, version, ag.reload_interval_s).start()
    log.info("serving version %d (max_batch %d, max_seq_len %d)", version, ag.server_max_batch, seq_len)
    return engine, watcher


def main(argv):
    skip_absent_tpu()
    import uvicorn
    from absl import flags

    from glm5_jax.rl.config import load_rl_config, resolve_sft
    from glm5_jax.rl.logs import setup_logging
    from glm5_jax.serve.api import create_app
    from glm5_jax.serve.auth import resolve_api_key

    FLAGS = flags.FLAGS
    setup_logging(f"server{FLAGS.server_id}")
    exp = load_rl_config(FLAGS.config, FLAGS.set)
    sft_cfg, _ = resolve_sft(exp, FLAGS.workdir)
    engine, watcher = build_engine(exp, sft_cfg, FLAGS.workdir)
    api = create_app(engine, tokenizer=None, model_name=f"policy-{exp.rl.task}", on_metrics=watcher.metrics,
                     api_key=resolve_api_key())
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)      # a restart takes the same port at once
    sock.bind((FLAGS.host, FLAGS.port))
    log.info("listening on http://%s:%d", FLAGS.host, sock.getsockname()[1])
    try:
        uvicorn.Server(uvicorn.Config(api, log_level="warning")).run(sockets=[sock])
    finally:
        watcher.stop()
        engine.stop()


if __name__ == "__main__":
    from absl import app, flags

    from glm5_jax.rl.flags import define_common_flags

    define_common_flags()
    flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
    flags.DEFINE_integer("port", 8100, "Port to listen on.")
    flags.DEFINE_integer("server_id", 0, "This server's index (log prefix only).")
    app.run(main)
