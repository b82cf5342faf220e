"""The training loop: data, sharded steps, eval, metrics, checkpoints, resume (what train.py runs)."""
from __future__ import annotations

import json
import logging
import sys
import time

import jax
import numpy as np

from glm5_jax import storage
from glm5_jax.checkpoint.run import RunCheckpoints, config_as_json
from glm5_jax.cost.flops import measure_matmul_peak, train_flops_per_token
from glm5_jax.data import build_data_pipeline, load_documents
from glm5_jax.data.sort_task import SORT
from glm5_jax.model.config import ConfigError
from glm5_jax.parallel.mesh import build_mesh, check_mesh_fits_model
from glm5_jax.telemetry import MetricsWriter, StepProfiler
from glm5_jax.train.init_from import initial_state, reuse_tokenizer
from glm5_jax.train.losses import loss_legend
from glm5_jax.train.resume_check import check_resumable, latest_stored_config
from glm5_jax.train.step import Trainer

log = logging.getLogger("glm5_jax.train")


def _to_python(metrics) -> dict:
    return {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items()}


def evaluate(trainer, state, pipeline, n_batches: int) -> float | None:
    loss_sum = tokens = 0.0
    for i, batch in enumerate(pipeline.eval_dataset()):
        if i >= n_batches:
            break
        out = _to_python(trainer.evaluate(state, trainer.put_batch(batch)))
        loss_sum += out["eval_loss_sum"]
        tokens += out["eval_tokens"]
    return loss_sum / tokens if tokens else None


def run_training(exp_cfg, workdir: str, *, max_steps: int | None = None) -> dict:
    """Train `exp_cfg` in `workdir`, resuming from its latest checkpoint. Returns the last metrics.

    `max_steps` stops early (after that many steps of this invocation) — used by tests."""
    # everything that can refuse the run is checked before anything is written to the workdir
    exp_cfg.validate()
    is_main = jax.process_index() == 0
    mesh = build_mesh(exp_cfg.mesh)
    check_mesh_fits_model(dict(zip(mesh.axis_names, mesh.devices.shape)), exp_cfg.model, exp_cfg.data.batch_size,
                          exp_cfg.data.seq_len)
    documents = None if exp_cfg.data.source == SORT else load_documents(exp_cfg.data)   # sources and eval split
    check_resumable(exp_cfg, workdir)
    storage.makedirs(workdir)
    train = exp_cfg.train
    if train.init_from and latest_stored_config(workdir)[0] is None and exp_cfg.data.tokenizer_path is None \
            and is_main:
        reuse_tokenizer(train.init_from, workdir)
    # progress bars only on a terminal: elsewhere (a log file, a pipe) the logged data: lines say it
    pipeline = build_data_pipeline(exp_cfg.data, workdir, show_progress=is_main and sys.stderr.isatty(),
                                   documents=documents)
    trainer = Trainer(exp_cfg, mesh)
    if pipeline.tokenizer.vocab_size > trainer.model_cfg.vocab_size:
        raise ConfigError(f"tokenizer has {pipeline.tokenizer.vocab_size} tokens but model.vocab_size="
                          f"{trainer.model_cfg.vocab_size}; raise model.vocab_size")
    ckpt = RunCheckpoints(workdir, max_to_keep=train.max_to_keep, async_save=train.async_checkpointing)
    start = ckpt.latest_step()
    if not pipeline.has_eval and is_main:
        log.info("eval is off (data.eval_fraction=0): the metrics have no eval_loss")
    train_iter = iter(pipeline.train_dataset())
    if start is None and train.init_from:
        state, start = initial_state(trainer, train.init_from, keep_optimizer=train.init_keep_optimizer,
                                     keep_step=train.init_keep_step, seed=train.seed)
    elif start is None:
        state, start = trainer.init_state(train.seed), 0
        log.info("initialised a new run in %s", workdir)
    else:
        state, _ = ckpt.restore(start, trainer.abstract_state, train_iter)
        log.info("resumed from step %d%s", start, f" (train.init_from={train.init_from} is not used: {workdir} "
                 f"already holds this run's checkpoints)" if train.init_from else "")
    if is_main:
        storage.write_atomically(storage.join(workdir, "config.json"),
                                 json.dumps(config_as_json(exp_cfg), indent=1).encode())
    writer = MetricsWriter(workdir, start, is_main)
    peak = measure_matmul_peak()
    flops = train_flops_per_token(trainer.model_cfg, exp_cfg.data.seq_len,
                                  sparse=trainer.model_cfg.runtime.attention_mode == "sparse",
                                  params=trainer.abstract_state.params,
                                  indexer_loss=trainer.model_cfg.runtime.indexer_loss)
    tokens_per_step = exp_cfg.data.batch_size * exp_cfg.data.seq_len
    if is_main:
        log.info("matmul peak %.1f GFLOP/s per device x %d devices; %.3g model FLOPs per token",
                 peak / 1e9, jax.device_count(), flops["total"])
        log.info("%s", loss_legend(exp_cfg.train, trainer.model_cfg, trainer.stage))
    last = {}
    end = exp_cfg.train.steps if max_steps is None else min(exp_cfg.train.steps, start + max_steps)
    t_last, steps_since = time.perf_counter(), 0
    profiler = StepProfiler(storage.join(workdir, "tb"), train.profile_start, train.profile_steps,
                            before_stop=ckpt.wait)     # no checkpoint writer threads while the trace stops
    for step in range(start, end):
        batch = trainer.put_batch(next(train_iter))
        if is_main and step == start:
            log.info("compiling the train step...")
        with profiler.step(step):
            state, metrics = trainer.step(state, batch)
        if is_main and step == start:        # jit compiles in the first call, then dispatches the step
            log.info("compiled in %.1f s", time.perf_counter() - t_last)
        profiler.after_step(step, metrics)
        steps_since += 1
        done = step + 1
        if done % exp_cfg.train.log_every == 0 or done == end:
            record = {"step": done, **_to_python(metrics)}
            elapsed = time.perf_counter() - t_last
            record["tokens_per_sec"] = tokens_per_step * steps_since / elapsed
            record["mfu"] = record["tokens_per_sec"] * flops["total"] / (peak * jax.device_count())
            if pipeline.has_eval and (done % exp_cfg.train.eval_every == 0 or done == end):
                eval_loss = evaluate(trainer, state, pipeline, exp_cfg.train.eval_batches)
                if eval_loss is not None:
                    record["eval_loss"] = eval_loss
            writer.write(record)
            if is_main:
                log.info("step %d  loss %.4f  lm %.4f  %s tok/s %.0f  mfu %.3f", done, record["loss"],
                         record["lm_loss"], f"eval {record['eval_loss']:.4f} " if "eval_loss" in record else "",
                         record["tokens_per_sec"], record["mfu"])
            last = record
            t_last, steps_since = time.perf_counter(), 0
        if done % exp_cfg.train.checkpoint_every == 0 or done == end:
            ckpt.save(done, state, train_iter, {"step": done, "config": config_as_json(exp_cfg)})
    profiler.stop()
    ckpt.wait()
    ckpt.close()
    writer.close()
    if is_main and end == exp_cfg.train.steps:
        if exp_cfg.data.source == SORT:     # a fixed vocabulary, no file: saved where generate / serve look
            pipeline.tokenizer.save(storage.join(workdir, "tokenizer.json"))
        log.info("%s", finished_message(workdir, end, exp_cfg.data.source))
    return last


def finished_message(workdir: str, step: int, data_source: str = "") -> str:
    """Where the finished run's checkpoint is and what to run on it next: for a text corpus generation,
    serving and export; for the sort task's SFT (configs/sort_sft.py) the RL run that starts from it and
    a prompt in the task's format."""
    done = f"done: step {step} is checkpointed in {storage.join(workdir, 'checkpoints', str(step))}"
    tensorboard = f"  tensorboard --logdir={storage.join(workdir, 'tb')}    # pip install -r requirements-profile.txt"
    if data_source == SORT:
        return "\n".join([
            done,
            "next:",
            f"  python -m glm5_jax.rl.run --config=configs/rl_sort.py --workdir=RL_DIR --set=sft_workdir={workdir}"
            "    # GRPO from this checkpoint",
            f"  python -m glm5_jax.generate --checkpoint={workdir} --prompt='S314159=' --max_new_tokens=7"
            "    # S, 6 digits, =: it answers them sorted",
            tensorboard,
        ])
    return "\n".join([
        done,
        "next:",
        f"  python -m glm5_jax.generate --checkpoint={workdir} --prompt='def main(' --max_new_tokens=64",
        f"  python -m glm5_jax.serve --checkpoint={workdir} --port=8000    # OpenAI-compatible API",
        f"  python -m glm5_jax.convert orbax-to-hf --ckpt_dir={workdir} --out_dir=HF_DIR    # Hugging Face export",
        tensorboard,
    ])
