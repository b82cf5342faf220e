"""INT4 recipe demo on the sort task (configs/sort_sft.py): post-training INT4 vs a short QAT phase.

    python bench/int4_qat.py --workdir=/tmp/glm5_int4_qat --out=bench/results/int4_qat.json

1. Train the sort SFT model (`--steps`, full precision: float32 on CPU).
2. From that checkpoint, continue `--qat_steps` more steps twice: plainly (the control) and with
   ``model.quant=int4_qat`` (fake-quantised routed experts, straight-through gradients).
3. Evaluate each checkpoint in full precision and as an INT4 model (`quantize_params`, packed experts):
   answer loss (mean NLL of the correct sorted answer + EOS on `--eval_prompts` held-out prompts) and
   greedy exact match.

Runs in-process with one model size; timings are not measured. Numbers from this 2-core shared machine
are what they are (loss and accuracy do not depend on the load).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from configs.sort_sft import get_config  # noqa: E402
from glm5_jax.data import sort_task  # noqa: E402
from glm5_jax.generate import generate  # noqa: E402
from glm5_jax.inference_checkpoint import load_for_inference  # noqa: E402
from glm5_jax.model import Transformer  # noqa: E402
from glm5_jax.quant import quantize_params  # noqa: E402
from glm5_jax.training import run_training  # noqa: E402


def train(workdir, steps, quant="none", group_size=16, start_from=None):
    cfg = get_config()
    cfg = dataclasses.replace(cfg, model=cfg.model.replace(quant=quant, quant_group_size=group_size),
                              train=dataclasses.replace(cfg.train, steps=steps, checkpoint_every=steps,
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


def rows_for(name, workdir, group_size, prompts, answers):
    cfg, variables, step = load_for_inference(os.path.join(workdir, "checkpoints"))
    fp_cfg = cfg.replace(quant="none", quant_group_size=group_size)
    int4_cfg = fp_cfg.replace(quant="int4")
    int4_vars = {**variables, "params": quantize_params(variables["params"], int4_cfg)}
    return [{"model": f"{name}, full precision", "step": step, **evaluate(fp_cfg, variables, prompts, answers)},
            {"model": f"{name}, INT4", "step": step, **evaluate(int4_cfg, int4_vars, prompts, answers)}]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--qat_steps", type=int, default=60)
    ap.add_argument("--group_size", type=int, default=16, help="input channels per scale (8 x it | 128)")
    ap.add_argument("--eval_prompts", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base = train(os.path.join(args.workdir, "base"), args.steps)
    total = args.steps + args.qat_steps
    control = train(os.path.join(args.workdir, "control"), total, start_from=base)
    qat = train(os.path.join(args.workdir, "qat"), total, quant="int4_qat", group_size=args.group_size,
                start_from=base)
    prompts, answers = eval_set(args.eval_prompts)
    rows = (rows_for(f"trained {args.steps} steps", base, args.group_size, prompts, answers)
            + rows_for(f"+{args.qat_steps} plain steps", control, args.group_size, prompts, answers)
            + rows_for(f"+{args.qat_steps} QAT steps", qat, args.group_size, prompts, answers))
    print(f"\nsort task, INT4 routed experts, group {args.group_size}, {args.eval_prompts} held-out prompts")
    print(f"{'model':<42} {'step':>5} {'answer loss':>12} {'exact match':>12}")
    for r in rows:
        print(f"{r['model']:<42} {r['step']:>5} {r['answer_loss']:>12.4f} {r['exact_match']:>12.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
