"""python -m glm5_jax.generate --checkpoint=DIR [--tokenizer=PATH] --prompt="..." [--prompt=...]
                              [--mesh=data:2,expert:2,tensor:2 [--host_devices=8]] [--sampler_kernels=pallas]

Loads an orbax checkpoint (a train.py workdir, its checkpoints/ folder, or a converter output), encodes
the prompts with the tokenizer (default: the BPE a train.py workdir cached under tokenizer/), generates
and prints each continuation, then one line with tokens/s (compile time reported separately). With
--mesh the weights are restored straight onto that sampling mesh and the prompts split over its batch
axes (docs/inference.md#sampling-on-a-mesh); any number of prompts works. --sampler_kernels decodes through the
decode program's Pallas kernels (docs/inference.md#the-samplers-decode-kernels).
"""
from __future__ import annotations

import sys
import time

from absl import app, flags

from glm5_jax.generate.mesh_flags import define_mesh_flags, with_sampler_flags
from glm5_jax.platforms import simulate_host_devices, skip_absent_tpu

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "train.py workdir, its checkpoints/ dir, or a converter output dir.",
                    required=True)
flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
flags.DEFINE_string("tokenizer", None, "tokenizer.json or a directory holding one (default: the workdir's BPE).")
flags.DEFINE_multi_string("prompt", [], "Prompt text; repeat for a batch.")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per prompt.")
flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1 = off).")
flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = off).")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_bool("speculative", False, "Greedy MTP speculative decoding (needs an MTP module).")
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Compute dtype override (weights cast once).")
flags.DEFINE_integer("prefill_chunk", 4096, "Prompt tokens per prefill step (0 = the whole prompt at once).")
define_mesh_flags()


def main(argv):
    simulate_host_devices(FLAGS.host_devices)
    skip_absent_tpu()
    del argv
    from absl import logging as absl_logging

    from glm5_jax.checkpoint.errors import USER_ERRORS

    absl_logging.set_verbosity(absl_logging.WARNING)          # orbax INFO chatter
    if not FLAGS.prompt:
        raise app.UsageError("give at least one --prompt")
    try:
        _generate()
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _generate():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from glm5_jax.checkpoint.inference import load_model_and_tokenizer
    from glm5_jax.generate.on_mesh import prepare_generate_on_mesh, real_rows
    from glm5_jax.parallel.mesh import mesh_and_rules
    from glm5_jax.parallel.sampling import SAMPLING_RULES, sampling_mesh

    mesh = sampling_mesh(FLAGS.mesh)
    model = load_model_and_tokenizer(FLAGS.checkpoint, FLAGS.step, FLAGS.tokenizer, FLAGS.dtype, mesh=mesh)
    cfg, variables, step, tokenizer = with_sampler_flags(model.cfg), model.variables, model.step, model.tokenizer
    encoded = [tokenizer.encode(p) for p in FLAGS.prompt]
    if any(len(e) == 0 for e in encoded):
        raise app.UsageError("a prompt encodes to no tokens")
    lengths = np.array([len(e) for e in encoded], np.int32)
    batch = np.zeros((len(encoded), lengths.max()), np.int32)
    for i, e in enumerate(encoded):
        batch[i, :len(e)] = e
    eos_ids = tuple(sorted(set(cfg.eos_token_id) | {tokenizer.eos_id}))
    fn, args, rows = prepare_generate_on_mesh(
        cfg, variables, batch, lengths, mesh, max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
        top_p=FLAGS.top_p, top_k=FLAGS.top_k, rng=jax.random.key(FLAGS.seed), eos_ids=eos_ids,
        speculative=FLAGS.speculative, prefill_chunk=FLAGS.prefill_chunk)
    t0 = time.perf_counter()
    with mesh_and_rules(mesh, SAMPLING_RULES):
        compiled = fn.lower(*args).compile()
    t1 = time.perf_counter()
    result = real_rows(jax.block_until_ready(compiled(*args)), rows)
    t2 = time.perf_counter()
    for i, prompt in enumerate(FLAGS.prompt):
        n = int(result.lengths[i])
        print(f"--- [{i}] {prompt!r} ->")
        print(prompt + tokenizer.decode(np.asarray(result.tokens[i, :n])))
    total = int(jnp.sum(result.lengths))
    on_mesh = f", mesh {FLAGS.mesh}" if mesh.size > 1 else ""
    line = (f"checkpoint step {step}: {total} new tokens in {t2 - t1:.2f} s = {total / (t2 - t1):.1f} tokens/s "
            f"(batch {len(encoded)}{on_mesh}, prefill included; compile {t1 - t0:.1f} s)")
    if FLAGS.speculative:
        line += f"; MTP draft acceptance {result.acceptance_rate:.2f}"
    print(line)


def run():
    app.run(main)


if __name__ == "__main__":
    run()
