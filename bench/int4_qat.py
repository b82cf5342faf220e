"""INT4 recipe demo: post-training INT4 vs a short QAT phase, on the sort task or on the default corpus.

    python bench/int4_qat.py --workdir=/tmp/glm5_int4_qat --out=bench/results/int4_qat.json
    python bench/int4_qat.py --task=lm --workdir=/tmp/glm5_int4_lm --out=bench/results/int4_qat_lm.json

1. Train a model (`--steps`, full precision: float32 on CPU): ``--task=sort`` the sort SFT model
   (configs/sort_sft.py); ``--task=lm`` configs/int4_lm.py, a language model on the embedded corpus (the
   Python standard library's source) whose every FFN is a routed MoE.
2. From that checkpoint, continue `--qat_steps` more steps twice: plainly (the control) and with
   ``model.quant=int4_qat`` (fake-quantised routed experts, straight-through gradients).
3. Evaluate each checkpoint in full precision and as an INT4 model (`quantize_params`, packed experts).
   sort: answer loss (mean NLL of the correct sorted answer + EOS on `--eval_prompts` held-out prompts)
   and greedy exact match. lm: the trainer's eval loss (`glm5_jax.train.losses.lm_losses`, next-token NLL over
   `--eval_batches` batches of the held-out documents).

Runs in-process with one model size; timings are not measured. Numbers from this 2-core shared machine
are what they are (loss and accuracy do not depend on the load).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from configs import int4_lm, sort_sft  # noqa: E402
from glm5_jax.checkpoint.inference import load_for_inference  # noqa: E402
from glm5_jax.data import build_data_pipeline, sort_task  # noqa: E402
from glm5_jax.generate.decoding import generate  # noqa: E402
from glm5_jax.model.moe.int4_weights import quantize_params  # noqa: E402
from glm5_jax.model.transformer import Transformer  # noqa: E402
from glm5_jax.train.experiment import apply_overrides  # noqa: E402
from glm5_jax.train.loop import run_training  # noqa: E402
from glm5_jax.train.stage import stage_spec  # noqa: E402
from glm5_jax.train.step import batch_losses  # noqa: E402

TASKS = {"sort": sort_sft.get_config, "lm": int4_lm.get_config}


def experiment(task, overrides=()):
    return apply_overrides(TASKS[task](), list(overrides))


def train(exp, workdir, steps, quant="none", group_size=16, start_from=None):
    cfg = dataclasses.replace(exp, model=exp.model.replace(quant=quant, quant_group_size=group_size),
                              train=dataclasses.replace(exp.train, steps=steps, checkpoint_every=steps,
                                                        eval_every=steps))
    if start_from and not os.path.exists(workdir):
        shutil.copytree(start_from, workdir)
    run_training(cfg, workdir)
    return workdir


def eval_set(n):
    digits = [sort_task.digits_of(0, "eval", i) for i in range(n)]
    prompts = np.stack([sort_task.prompt_ids(d) for d in digits])
    answers = np.stack([sort_task.correct_answer_ids(d) for d in digits])
    return prompts, answers


def evaluate(cfg, variables, prompts, answers):
    tokens = jnp.asarray(np.concatenate([prompts, answers], axis=1))
    logits = jax.jit(lambda v, t: Transformer(cfg).apply(v, t).logits)(variables, tokens)
    P = prompts.shape[1]
    logp = jax.nn.log_softmax(logits[:, P - 1:-1].astype(jnp.float32), axis=-1)   # predicts answer tokens
    nll = -jnp.take_along_axis(logp, jnp.asarray(answers)[..., None], axis=-1)[..., 0]
    out = generate(cfg, variables, jnp.asarray(prompts), jnp.full((len(prompts),), P, jnp.int32),
                   max_new_tokens=answers.shape[1], temperature=0.0, rng=jax.random.key(0),
                   eos_ids=cfg.eos_token_id)
    exact = np.all(np.asarray(out.tokens) == answers, axis=1)
    return {"answer_loss": float(nll.mean()), "exact_match": float(exact.mean())}


def lm_eval_batches(exp, workdir, n):
    """The first ``n`` held-out batches of the run's own pipeline (its tokenizer lives in ``workdir``)."""
    pipeline = build_data_pipeline(exp.data, workdir, show_progress=False)
    return [jax.tree.map(jnp.asarray, batch) for batch in itertools.islice(pipeline.eval_dataset(), n)]


def lm_evaluate(exp, cfg, variables, batches):
    """Token-weighted next-token NLL over ``batches``: what the trainer's eval (Trainer._eval_step) computes."""
    @jax.jit
    def parts(variables, batch):
        _, p, _ = batch_losses(Transformer(cfg), variables, batch, exp.train, stage_spec(exp.train.stage))
        return p["lm_loss"] * p["tokens"], p["tokens"]

    sums = [parts(variables, b) for b in batches]
    return {"eval_loss": float(sum(a for a, _ in sums) / sum(t for _, t in sums))}


def rows_for(name, workdir, group_size, evaluate_fn):
    cfg, variables, step = load_for_inference(os.path.join(workdir, "checkpoints"))
    fp_cfg = cfg.replace(quant="none", quant_group_size=group_size)
    int4_cfg = fp_cfg.replace(quant="int4")
    int4_vars = {**variables, "params": quantize_params(variables["params"], int4_cfg)}
    return [{"model": f"{name}, full precision", "step": step, **evaluate_fn(fp_cfg, variables)},
            {"model": f"{name}, INT4", "step": step, **evaluate_fn(int4_cfg, int4_vars)}]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", choices=sorted(TASKS), default="sort")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--steps", type=int, default=None, help="full-precision steps (default: the config's)")
    ap.add_argument("--qat_steps", type=int, default=None, help="default: 60 (sort), 100 (lm)")
    ap.add_argument("--group_size", type=int, default=16, help="input channels per scale (8 x it must divide "
                    "the experts' input widths: hidden_size and moe_intermediate_size)")
    ap.add_argument("--eval_prompts", type=int, default=512, help="sort: held-out prompts")
    ap.add_argument("--eval_batches", type=int, default=16, help="lm: held-out batches")
    ap.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    exp = experiment(args.task, args.set)
    args.steps = args.steps or exp.train.steps
    args.qat_steps = args.qat_steps or (60 if args.task == "sort" else 100)
    base = train(exp, os.path.join(args.workdir, "base"), args.steps)
    total = args.steps + args.qat_steps
    control = train(exp, os.path.join(args.workdir, "control"), total, start_from=base)
    qat = train(exp, os.path.join(args.workdir, "qat"), total, quant="int4_qat", group_size=args.group_size,
                start_from=base)
    if args.task == "sort":
        prompts, answers = eval_set(args.eval_prompts)
        evaluate_fn = lambda cfg, v: evaluate(cfg, v, prompts, answers)   # noqa: E731
        columns, title = ("answer_loss", "exact_match"), f"sort task, {args.eval_prompts} held-out prompts"
    else:
        batches = lm_eval_batches(exp, base, args.eval_batches)
        evaluate_fn = lambda cfg, v: lm_evaluate(exp, cfg, v, batches)   # noqa: E731
        columns = ("eval_loss",)
        title = (f"language model on the embedded corpus, {args.eval_batches} held-out batches of "
                 f"{exp.data.batch_size} x {exp.data.seq_len} tokens")
    rows = (rows_for(f"trained {args.steps} steps", base, args.group_size, evaluate_fn)
            + rows_for(f"+{args.qat_steps} plain steps", control, args.group_size, evaluate_fn)
            + rows_for(f"+{args.qat_steps} QAT steps", qat, args.group_size, evaluate_fn))
    print(f"\n{title}; INT4 routed experts, group {args.group_size}")
    print(f"{'model':<42} {'step':>5} " + " ".join(f"{c:>12}" for c in columns))
    for r in rows:
        print(f"{r['model']:<42} {r['step']:>5} " + " ".join(f"{r[c]:>12.4f}" for c in columns))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
