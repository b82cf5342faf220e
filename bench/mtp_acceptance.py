"""MTP speculative decoding on a trained checkpoint: how many draft tokens the verifier accepts on held-out text.

    python bench/mtp_acceptance.py --checkpoint=/tmp/glm5_tiny --config=configs/tiny.py \\
        --out=bench/results/mtp_acceptance.json [--prompts=32] [--prompt_len=64] [--max_new_tokens=64]

Prompts are windows of the config's held-out documents (the eval split train.py never trains on), encoded with
the checkpoint's tokenizer, each `--prompt_len` tokens from a seeded offset. Both decoders run greedy over the
same batch: plain decoding and `speculative=True` (the MTP module drafts `mtp_depth` tokens, the model verifies
them in one forward pass; glm5_jax/generate/decoding.py). Reported, per run:

- `identical`: speculative output equals plain greedy output token for token (what verification guarantees);
- `acceptance_rate`: accepted / drafted tokens;
- `tokens_per_step`: tokens emitted per verify step of a live row, (accepted + verify steps) / verify steps
  (at most 1 + mtp_depth), the decode-step saving speculation buys before its extra work;
- `distinct_2`: distinct token bigrams / bigrams of the greedy outputs, how repetitive the text being drafted
  is (repetitive text is easy to draft, so a high rate on a low distinct_2 says little);
- `held_out_acceptance`: the same accept test on real text instead of the model's own continuation. One
  forward over the held-out windows with the MTP module: at each position t the draft for token t + 2 (MTP
  depth 1, fed the real token t + 1) is accepted when it equals the model's greedy prediction at t + 1, which
  is what the verifier checks; averaged over all positions of the windows;
- CPU seconds per call of each decoder (compiled beforehand): a regression check of this host, not a TPU figure.

Prints a table and writes --out (JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def held_out_prompts(config_path: str, tokenizer, n: int, length: int, seed: int) -> np.ndarray:
    """[n, length] int32: windows of the config's eval documents, one per document in turn, at seeded offsets."""
    from glm5_jax.data import DocumentReader
    from glm5_jax.data.pipeline import load_documents
    from glm5_jax.train.experiment import load_config_file

    data = load_config_file(config_path).data
    _, eval_docs = load_documents(data)
    reader = DocumentReader(data.text_field)
    rng = np.random.default_rng(seed)
    encoded = [tokenizer.encode(t) for t in reader.texts(eval_docs)]
    long_enough = [e for e in encoded if len(e) > length]
    if not long_enough:
        raise SystemExit(f"no held-out document of the config is longer than --prompt_len={length} tokens")
    rows = []
    for i in range(n):
        ids = long_enough[i % len(long_enough)]
        start = int(rng.integers(0, len(ids) - length))
        rows.append(ids[start:start + length])
    return np.asarray(rows, np.int32)


def distinct_bigrams(tokens: np.ndarray, lengths: np.ndarray) -> float:
    pairs = [(int(r[i]), int(r[i + 1])) for r, n in zip(tokens, lengths) for i in range(int(n) - 1)]
    return len(set(pairs)) / max(len(pairs), 1)


def held_out_acceptance(cfg, variables, windows: np.ndarray) -> float:
    """Share of positions t of `windows` [n, L] where MTP depth 1's draft of token t + 2 (given the real token
    t + 1) equals the main model's greedy prediction at t + 1."""
    import jax.numpy as jnp

    from glm5_jax.model.transformer import Transformer

    out = Transformer(cfg).apply(variables, jnp.asarray(windows), with_mtp=True)
    greedy = np.asarray(jnp.argmax(out.logits, axis=-1))                  # [n, L]: prediction of token t + 1
    draft = np.asarray(jnp.argmax(out.mtp_logits[0], axis=-1))            # [n, L]: prediction of token t + 2
    return float(np.mean(draft[:, :-2] == greedy[:, 1:-1]))


def run(cfg, variables, prompts, max_new_tokens: int, speculative: bool, eos_ids, repeats: int):
    from glm5_jax.generate.decoding import prepare_generate

    lengths = np.full((prompts.shape[0],), prompts.shape[1], np.int32)
    fn, args = prepare_generate(cfg, variables, prompts, lengths, max_new_tokens=max_new_tokens, temperature=0.0,
                                eos_ids=eos_ids, speculative=speculative)
    result = fn(*args)         # the first call compiles; it is the result reported, later calls are timed
    result.tokens.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn(*args).tokens.block_until_ready()
    return result, (time.perf_counter() - t0) / repeats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="train.py workdir (or its checkpoints/ dir)")
    ap.add_argument("--config", required=True, help="the config the checkpoint was trained with (its eval split)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt_len", type=int, default=64)
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="timed calls per decoder")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from glm5_jax.checkpoint.inference import load_model_and_tokenizer

    model = load_model_and_tokenizer(args.checkpoint)
    cfg, variables, tokenizer = model.cfg, model.variables, model.tokenizer
    if not (cfg.num_nextn_predict_layers and cfg.mtp_depth >= 1):
        raise SystemExit(f"{args.checkpoint}: the model has no MTP module to draft with")
    prompts = held_out_prompts(args.config, tokenizer, args.prompts, args.prompt_len, args.seed)
    eos_ids = tuple(sorted(set(cfg.eos_token_id) | {tokenizer.eos_id}))
    plain, plain_s = run(cfg, variables, prompts, args.max_new_tokens, False, eos_ids, args.repeats)
    spec, spec_s = run(cfg, variables, prompts, args.max_new_tokens, True, eos_ids, args.repeats)
    drafted, accepted = int(spec.drafted), int(spec.accepted)
    verify_steps = drafted / cfg.mtp_depth
    tokens, lengths = np.asarray(plain.tokens), np.asarray(plain.lengths)
    row = {"step": int(model.step), "mtp_depth": cfg.mtp_depth, "prompts": args.prompts,
           "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens,
           "identical": bool(np.array_equal(tokens, np.asarray(spec.tokens))
                             and np.array_equal(lengths, np.asarray(spec.lengths))),
           "drafted": drafted, "accepted": accepted, "acceptance_rate": accepted / max(drafted, 1),
           "tokens_per_step": (accepted + verify_steps) / max(verify_steps, 1),
           "distinct_2": distinct_bigrams(tokens, lengths),
           "held_out_acceptance": held_out_acceptance(cfg, variables, prompts),
           "cpu_seconds_plain": plain_s, "cpu_seconds_speculative": spec_s}
    result = {"checkpoint": args.checkpoint, "config": args.config, "seed": args.seed, "runs": [row]}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    cols = ("step", "prompts", "identical", "acceptance_rate", "tokens_per_step", "distinct_2", "held_out_acceptance",
            "cpu_seconds_plain", "cpu_seconds_speculative")
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    print("| " + " | ".join(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in cols) + " |")
    return result


if __name__ == "__main__":
    main()
