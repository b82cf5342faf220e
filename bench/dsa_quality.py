"""What sparse attention costs in quality: dense-only training vs the DSA adoption chain (dense -> indexer
warm-up -> sparse) at equal total training tokens, on configs/dsa_adoption.py (T = 4 x index_topk).

Measured on held-out rows of the embedded corpus:
* eval LM loss of each arm in its own attention mode (dense-only: dense; chain: sparse), plus the chain's
  weights under dense attention and the dense-stage weights under sparse attention with the untrained
  indexer (what skipping the warm-up would give);
* a long-range retrieval probe: a random span of `span` tokens is written into a held-out row and again
  `distance` tokens later; NLL / top-1 accuracy of the 2nd..last tokens of the second copy (predictable
  only by looking back `distance` tokens) for several distances, dense-only vs chain (sparse);
* the indexer's recall of the dense attention's top-k keys (head-summed attention probabilities, per
  query with more than index_topk visible keys) and the share of dense attention mass on the indexer's
  top-k, along the chain.

    python bench/dsa_quality.py --out=bench/results/dsa_quality.json      # full: 400 steps per arm
    python bench/dsa_quality.py --tiny --out=/tmp/dsa_quality.json         # plumbing check (compiles dominate)

`--steps_scale=2` doubles every stage. Each history record carries the seconds since its stage began
(compile included).

Steps of each arm: the stage schedule of configs/dsa_adoption.py (dense-only runs their sum); sized for
~10-15 min on 2 quiet cores, which was not measured (this machine ran at load ~20). Timings
on a loaded machine do not matter here: the losses do not depend on machine load.
"""
import argparse
import dataclasses
import json
import os
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from glm5_jax.data import build_data_pipeline  # noqa: E402
from glm5_jax.model.moe.layer import BIAS_COLLECTION  # noqa: E402
from glm5_jax.model.transformer import Transformer  # noqa: E402
from glm5_jax.parallel.mesh import build_mesh  # noqa: E402
from glm5_jax.train.experiment import apply_overrides, load_config_file  # noqa: E402
from glm5_jax.train.stage import STAGES, stage_spec  # noqa: E402
from glm5_jax.train.step import Trainer  # noqa: E402
from pallas_kernels.indexer_kl import ops as indexer_kl_ops  # noqa: E402
from pallas_kernels.indexer_kl.reference import head_summed_target  # noqa: E402
from pallas_kernels.lightning_indexer.reference import index_scores  # noqa: E402
from pallas_kernels.masking import visible_mask  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "dsa_adoption.py")
DISTANCES = (8, 24, 48, 96, 112)
TINY_STEPS = {"dense": 4, "warmup": 3, "sparse": 3}


# ------------------------------------------------------------------------------------------ evaluation
def make_token_nll(model_cfg):
    """jit(params, moe_bias, tokens) -> (NLL [B, T-1] of token t+1 given <= t, argmax hit [B, T-1])."""
    model = Transformer(model_cfg)

    def nll(params, moe_bias, tokens_BT):
        B, T = tokens_BT.shape
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        logits = model.apply({"params": params, BIAS_COLLECTION: moe_bias}, tokens_BT, positions=positions,
                             segment_ids=jnp.ones((B, T), jnp.int32)).logits.astype(jnp.float32)[:, :-1]
        logp = jax.nn.log_softmax(logits, axis=-1)
        target = tokens_BT[:, 1:]
        return -jnp.take_along_axis(logp, target[..., None], -1)[..., 0], jnp.argmax(logits, -1) == target
    return jax.jit(nll)


def indexer_vs_dense(metric, k):
    """A stand-in for the warm-up KL (same arguments) returning, per layer, the indexer's `metric`
    against the dense attention target: "recall" of its top-k keys or "mass" of it on the indexer's top-k."""
    def fn(q_BTHC, kv_BSC, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, *, scale, **_):
        visible = visible_mask(q_pos, kv_pos, q_seg, kv_seg)
        logits = jnp.einsum("bthc,bsc->bths", q_BTHC, kv_BSC, preferred_element_type=jnp.float32) * scale
        p_BTS = head_summed_target(logits, visible)
        top_idx = jax.lax.top_k(index_scores(iq, ik, iw, visible), k)[1]
        rows = jnp.sum(visible, -1) > k                      # queries where the top-k drops keys
        if metric == "recall":
            top_dense = jax.lax.top_k(jnp.where(visible, p_BTS, -1.0), k)[1]
            value = jnp.mean(jnp.any(top_dense[..., :, None] == top_idx[..., None, :], -1), -1)
        else:
            value = jnp.sum(jnp.take_along_axis(p_BTS, top_idx, -1), -1)
        return jnp.sum(jnp.where(rows, value, 0.0)) / jnp.maximum(jnp.sum(rows), 1)
    return fn


def make_indexer_metrics(model_cfg, abstract_args):
    """(params, moe_bias, tokens) -> {"recall", "mass"} averaged over the indexer layers: the model runs
    with dense attention and the warm-up KL hook, whose result is replaced by the metric."""
    model = Transformer(stage_spec("warmup").model_config(model_cfg))
    fns = {}
    for metric in ("recall", "mass"):
        def run(params, moe_bias, tokens_BT):
            B, T = tokens_BT.shape
            stats = model.apply({"params": params, BIAS_COLLECTION: moe_bias}, tokens_BT,
                                positions=jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
                                segment_ids=jnp.ones((B, T), jnp.int32)).stats
            has = stats.has_indexer_kl
            return jnp.sum(jnp.where(has, stats.indexer_kl, 0.0)) / jnp.maximum(jnp.sum(has), 1)
        with mock.patch.object(indexer_kl_ops, "indexer_kl_loss", indexer_vs_dense(metric, model_cfg.index_topk)):
            fns[metric] = jax.jit(run).lower(*abstract_args).compile()     # traced while patched
    return lambda params, moe_bias, tokens: {m: float(f(params, moe_bias, tokens)) for m, f in fns.items()}


def probe_rows(rows_BT, distance, span, vocab, rng):
    """Rows with a random span at [T - span - distance, T - distance) and again at [T - span, T)."""
    B, T = rows_BT.shape
    if distance + span > T:
        raise ValueError(f"distance {distance} + span {span} exceeds T={T}")
    rows = rows_BT.copy()
    tokens = rng.integers(16, vocab, (B, span))
    rows[:, T - span - distance:T - distance] = tokens
    rows[:, T - span:] = tokens
    return rows


def retrieval_probe(nll_fn, params, moe_bias, rows_BT, span, vocab):
    out = {}
    T = rows_BT.shape[1]
    for d in DISTANCES:
        rows = probe_rows(rows_BT, d, span, vocab, np.random.default_rng(d))
        nll, hit = jax.device_get(nll_fn(params, moe_bias, jnp.asarray(rows)))
        # prediction of token T - span + j + 1 is made at position T - span + j (j = 0 .. span - 2)
        second = slice(T - span, T - 1)
        first = slice(T - span - d, T - d - 1)                   # same tokens, nothing to look back to
        out[d] = {"nll": float(nll[:, second].mean()), "accuracy": float(hit[:, second].mean()),
                  "nll_first_copy": float(nll[:, first].mean())}
    return out


# ------------------------------------------------------------------------------------------ training
def stage_config(base, stage, steps):
    from configs.dsa_adoption import stage_overrides

    cfg = apply_overrides(base, stage_overrides(stage))
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))


def train_stage(cfg, mesh, weights, batches, log_every, probe=None):
    """Train one stage from `weights` (None: fresh init) on `batches`; returns (weights, history)."""
    trainer = Trainer(cfg, mesh)
    state = (trainer.init_state(cfg.train.seed) if weights is None
             else trainer.state_from_weights(*weights, seed=cfg.train.seed))
    history = []
    t0 = time.perf_counter()
    for i, b in enumerate(batches):
        state, metrics = trainer.step(state, trainer.put_batch(b))
        if (i + 1) % log_every == 0 or i + 1 == len(batches):
            rec = {"step": i + 1, **{k: float(v) for k, v in jax.device_get(metrics).items()
                                     if k in ("lm_loss", "indexer_loss")}, "seconds": time.perf_counter() - t0}
            if probe is not None:
                rec.update(probe(state.params, state.moe_bias))
            history.append(rec)
            print(f"  {cfg.train.stage:6s} step {i + 1:4d}  " + "  ".join(f"{k} {v:.4f}" for k, v in rec.items()
                                                                       if k not in ("step", "seconds")), flush=True)
    return (state.params, state.moe_bias), history


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "dsa_quality.json"))
    ap.add_argument("--workdir", default="/tmp/glm5_dsa_quality", help="tokenizer cache")
    ap.add_argument("--tiny", action="store_true", help="a few steps of each stage: checks the plumbing")
    ap.add_argument("--steps_scale", type=float, default=1.0, help="multiplies every stage's steps")
    ap.add_argument("--eval_batches", type=int, default=8)
    ap.add_argument("--span", type=int, default=8)
    ap.add_argument("--log_every", type=int, default=20)
    args = ap.parse_args()

    from configs.dsa_adoption import STAGE_SCHEDULE

    base = load_config_file(CONFIG)
    steps = TINY_STEPS if args.tiny else {s: max(1, round(STAGE_SCHEDULE[s]["steps"] * args.steps_scale))
                                          for s in STAGES}
    eval_batches = 1 if args.tiny else args.eval_batches
    log_every = 1 if args.tiny else args.log_every
    total = sum(steps.values())
    pipeline = build_data_pipeline(base.data, args.workdir, show_progress=False)
    train_iter = iter(pipeline.train_dataset())
    batches = [next(train_iter) for _ in range(total)]        # both arms see the same tokens
    eval_rows = np.concatenate([b.tokens for _, b in zip(range(eval_batches), pipeline.eval_dataset())])
    eval_segments = np.concatenate([b.segment_ids for _, b in zip(range(eval_batches), pipeline.eval_dataset())])
    mesh = build_mesh(base.mesh, jax.devices()[:1])
    model_cfg = base.model
    vocab = pipeline.tokenizer.vocab_size
    t0 = time.perf_counter()

    abstract = Trainer(stage_config(base, "dense", 1), mesh).abstract_state
    indexer_metrics = make_indexer_metrics(model_cfg, (abstract.params, abstract.moe_bias,
                                                       jax.ShapeDtypeStruct(eval_rows.shape, jnp.int32)))
    probe_tokens = jnp.asarray(eval_rows)

    def recall_probe(params, moe_bias):
        return indexer_metrics(params, moe_bias, probe_tokens)

    nll = {mode: make_token_nll(stage_spec(mode).model_config(model_cfg)) for mode in ("dense", "sparse")}
    # eval rows hold packed documents: score only predictions inside one document
    same_doc = (eval_segments[:, 1:] == eval_segments[:, :-1]) & (eval_segments[:, 1:] > 0)

    def eval_loss(mode, weights):
        token_nll, _ = jax.device_get(nll[mode](*weights, probe_tokens))
        return float(token_nll[same_doc].mean())

    print(f"dense-only arm: {total} dense steps")
    dense_only, dense_only_hist = train_stage(stage_config(base, "dense", total), mesh, None, batches, log_every)
    dense_only = jax.device_get(dense_only)
    print(f"chain arm: {steps['dense']} dense -> {steps['warmup']} warm-up -> {steps['sparse']} sparse")
    chain_hist, weights, offset = {}, None, 0
    after = {}
    for stage in STAGES:
        cfg = stage_config(base, stage, steps[stage])
        weights, chain_hist[stage] = train_stage(cfg, mesh, weights, batches[offset:offset + steps[stage]], log_every,
                                                 probe=recall_probe)
        offset += steps[stage]
        after[stage] = jax.device_get(weights)          # host copies: the next stage's steps donate theirs

    results = {
        "config": "configs/dsa_adoption.py", "steps": steps, "total_steps": total,
        "tokens_per_step": base.data.batch_size * base.data.seq_len, "seq_len": base.data.seq_len,
        "index_topk": model_cfg.index_topk, "eval_rows": int(eval_rows.shape[0]), "span": args.span,
        "eval_loss": {
            "dense_only (dense attention)": eval_loss("dense", dense_only),
            "chain (sparse attention)": eval_loss("sparse", after["sparse"]),
            "chain weights, dense attention": eval_loss("dense", after["sparse"]),
            "after dense stage, sparse attention, untrained indexer": eval_loss("sparse", after["dense"]),
            "after warm-up, sparse attention": eval_loss("sparse", after["warmup"]),
        },
        "retrieval": {
            "dense_only (dense attention)": retrieval_probe(nll["dense"], *dense_only, eval_rows, args.span, vocab),
            "chain (sparse attention)": retrieval_probe(nll["sparse"], *after["sparse"], eval_rows, args.span, vocab),
        },
        "indexer": {"untrained (after dense stage)": recall_probe(*after["dense"]),
                    "after warm-up": recall_probe(*after["warmup"]),
                    "after sparse": recall_probe(*after["sparse"])},
        "history": {"dense_only": dense_only_hist, **{f"chain_{s}": h for s, h in chain_hist.items()}},
        "seconds": time.perf_counter() - t0, "tiny": args.tiny,
    }
    print_table(results)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}")


def print_table(r):
    print(f"\nT={r['seq_len']}  index_topk={r['index_topk']}  steps {r['steps']} (dense-only: {r['total_steps']})")
    print(f"{'eval LM loss':58s}")
    for name, v in r["eval_loss"].items():
        print(f"  {name:56s} {v:.4f}")
    gap = r["eval_loss"]["chain (sparse attention)"] - r["eval_loss"]["dense_only (dense attention)"]
    print(f"  {'gap: chain (sparse) - dense_only':56s} {gap:+.4f}")
    print(f"\nretrieval probe (span {r['span']}): second-copy NLL / top-1 accuracy (first copy NLL)")
    print(f"  {'distance':>8s}  " + "  ".join(f"{n:>34s}" for n in r["retrieval"]))
    for d in DISTANCES:
        cells = [f"{a[d]['nll']:7.3f} / {a[d]['accuracy']:5.3f} ({a[d]['nll_first_copy']:6.3f})"
                 for a in r["retrieval"].values()]
        print(f"  {d:8d}  " + "  ".join(f"{c:>34s}" for c in cells))
    print("\nindexer vs dense attention top-k (recall of keys / dense mass on the indexer's top-k)")
    for name, v in r["indexer"].items():
        print(f"  {name:34s} recall {v['recall']:.3f}  mass {v['mass']:.3f}")


def plot(r, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    tok = r["tokens_per_step"]
    h = r["history"]
    ax[0].plot([e["step"] * tok for e in h["dense_only"]], [e["lm_loss"] for e in h["dense_only"]], label="dense only")
    offset = 0
    for s in STAGES:
        ax[0].plot([(offset + e["step"]) * tok for e in h[f"chain_{s}"]], [e["lm_loss"] for e in h[f"chain_{s}"]],
                   label=f"chain: {s}")
        offset += r["steps"][s]
    ax[0].set(xlabel="training tokens", ylabel="train LM loss", title="LM loss")
    ax[0].legend()
    offset = 0
    for s in STAGES:
        xs = [(offset + e["step"]) * tok for e in h[f"chain_{s}"]]
        ax[1].plot(xs, [e["recall"] for e in h[f"chain_{s}"]], "o-", label=f"recall ({s})")
        ax[1].plot(xs, [e["mass"] for e in h[f"chain_{s}"]], "x--", label=f"mass ({s})")
        offset += r["steps"][s]
    ax[1].set(xlabel="training tokens", ylim=(0, 1), title=f"indexer top-{r['index_topk']} vs dense attention")
    ax[1].legend(fontsize=7)
    for name, res in r["retrieval"].items():
        ax[2].plot(list(map(int, res)), [v["accuracy"] for v in res.values()], "o-", label=name)
    ax[2].axvline(r["index_topk"], color="gray", ls=":", label="index_topk")
    ax[2].set(xlabel="distance (tokens)", ylabel="top-1 accuracy, second copy", title="retrieval probe")
    ax[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
