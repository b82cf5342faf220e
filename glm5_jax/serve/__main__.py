"""python -m glm5_jax.serve --checkpoint=DIR [--tokenizer=PATH] [--port=8000] [--max_batch=8] [--max_seq_len=2048]
                         [--api_key=KEY] [--mesh=data:2,expert:2,tensor:2 [--host_devices=8]]
                         [--sampler_kernels=pallas [--sampler_dispatch=a2a_decode]]

Serves an orbax checkpoint (a train.py workdir, its checkpoints/ folder or a converter output) over
the HTTP API of `glm5_jax.serve.api`, on loopback by default. With --reload_interval_s > 0, newer
committed steps in the same directory (or, with --policy_workdir, an RL run's policy versions) are loaded
while serving. With --mesh the model, its cache and every step run on that sampling mesh
(docs/inference.md#sampling-on-a-mesh); --max_batch must then be a multiple of its batch shards. --sampler_kernels
runs the decode steps through the decode program's Pallas kernels (docs/inference.md#the-samplers-decode-kernels).
"""
from __future__ import annotations

import logging
import sys

from absl import app, flags

from glm5_jax import storage
from glm5_jax.generate.mesh_flags import define_mesh_flags, with_sampler_flags
from glm5_jax.platforms import simulate_host_devices, skip_absent_tpu

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "train.py workdir, its checkpoints/ dir, or a converter output dir.",
                    required=True)
flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
flags.DEFINE_string("tokenizer", None, "tokenizer.json or a directory holding one (default: the workdir's BPE).")
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
flags.DEFINE_integer("port", 8000, "Port to listen on (0: any free port, printed at start).")
flags.DEFINE_integer("max_batch", 8, "Slots in the running batch (cache rows).")
flags.DEFINE_integer("max_seq_len", 2048, "Context per slot: prompt + completion tokens.")
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Compute dtype override (weights cast once).")
flags.DEFINE_string("model_name", None, "Model id reported by the API (default: the checkpoint folder's name).")
flags.DEFINE_float("reload_interval_s", 0.0, "Poll for newer committed steps this often (0: never).")
flags.DEFINE_string("policy_workdir", None, "Reload from this RL run's policy versions instead of --checkpoint.")
flags.DEFINE_integer("prefill_chunk", 4096, "Prompt tokens per prefill call (0 = a whole prompt per call).")
flags.DEFINE_string("api_key", None, "Require 'Authorization: Bearer <key>' on every endpoint but /health "
                    "(default: the GLM5_API_KEY environment variable; neither: no key).")
flags.DEFINE_integer("profile_start", 10, "First engine step (admit + decode round) of a profiler trace.")
flags.DEFINE_integer("profile_steps", 0, "Trace this many engine steps with jax.profiler (0: no trace).")
flags.DEFINE_string("profile_dir", None, "Where the trace goes (plugins/profile/ under it; TensorBoard's / "
                    "XProf's --logdir). Default: ./serve_profile.")
flags.DEFINE_multi_integer("warmup_prompt_len", [1], "Compile the prefill for these prompt lengths before serving.")
define_mesh_flags()


def main(argv):
    simulate_host_devices(FLAGS.host_devices)
    skip_absent_tpu()
    del argv
    from absl import logging as absl_logging

    from glm5_jax.checkpoint.errors import USER_ERRORS
    from glm5_jax.checkpoint.inference import load_model_and_tokenizer
    from glm5_jax.parallel.sampling import sampling_mesh

    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger("glm5_jax.serve").setLevel(logging.INFO)        # one line per request, reloads
    try:
        mesh = sampling_mesh(FLAGS.mesh)
        model = load_model_and_tokenizer(FLAGS.checkpoint, FLAGS.step, FLAGS.tokenizer, FLAGS.dtype, mesh=mesh)
        engine = _engine(model, mesh)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    _serve(model, engine)
    return 0


def _engine(model, mesh):
    from glm5_jax.serve.engine import Engine
    from glm5_jax.telemetry import StepProfiler

    cfg, tokenizer = with_sampler_flags(model.cfg), model.tokenizer
    return Engine(cfg, model.variables, max_batch=FLAGS.max_batch, max_seq_len=FLAGS.max_seq_len,
                  eos_ids=set(cfg.eos_token_id) | {tokenizer.eos_id}, weights_version=model.step,
                  prefill_chunk=FLAGS.prefill_chunk, mesh=mesh if mesh.size > 1 else None,
                  profiler=StepProfiler(FLAGS.profile_dir or "serve_profile", FLAGS.profile_start,
                                        FLAGS.profile_steps, name="serve_step"))


def _serve(model, engine):
    import socket

    import uvicorn

    from glm5_jax.serve.api import create_app
    from glm5_jax.serve.auth import resolve_api_key
    from glm5_jax.serve.reload import CheckpointSource, PolicySource, WeightsWatcher
    from glm5_jax.serve.text import ChatTemplate

    cfg, variables, step, tokenizer = model.cfg, model.variables, model.step, model.tokenizer
    engine.warmup(FLAGS.warmup_prompt_len)
    engine.start()
    watcher = None
    if FLAGS.reload_interval_s > 0:
        source = (PolicySource(FLAGS.policy_workdir, variables) if FLAGS.policy_workdir
                  else CheckpointSource(FLAGS.checkpoint))
        watcher = WeightsWatcher(engine, source, cfg, -1 if FLAGS.policy_workdir else step,
                                 FLAGS.reload_interval_s).start()
    name = FLAGS.model_name or storage.basename(storage.absolute(FLAGS.checkpoint))
    api = create_app(engine, tokenizer, name, ChatTemplate.for_tokenizer(model.tokenizer_path),
                     on_metrics=watcher.metrics if watcher else None, api_key=resolve_api_key(FLAGS.api_key),
                     log_requests=True)
    sock = socket.socket(socket.AF_INET6 if ":" in FLAGS.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((FLAGS.host, FLAGS.port))
    on_mesh = f", mesh {FLAGS.mesh}" if engine.mesh is not None else ""
    print(f"serving {name} (step {step}{on_mesh}) on http://{FLAGS.host}:{sock.getsockname()[1]}", flush=True)
    try:
        uvicorn.Server(uvicorn.Config(api, log_level="warning")).run(sockets=[sock])
    finally:
        if watcher:
            watcher.stop()
        engine.stop()


if __name__ == "__main__":
    app.run(main)
