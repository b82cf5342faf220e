"""CLI: ``python -m glm5_jax.convert {hf-to-orbax|orbax-to-hf} --flags`` (see the package docstring)."""
from __future__ import annotations

import sys

from absl import app, flags, logging

from glm5_jax.checkpoint.errors import USER_ERRORS
from glm5_jax.platforms import skip_absent_tpu

COMMANDS = ("hf-to-orbax", "orbax-to-hf")
flags.DEFINE_string("hf_dir", None, "hf-to-orbax: HF checkpoint directory (config.json + safetensors)")
flags.DEFINE_string("ckpt_dir", None, "orbax-to-hf: any orbax checkpoint this project writes: an hf-to-orbax "
                                     "output, a train.py workdir or its checkpoints/, an RL workdir or its policy/")
flags.DEFINE_integer("step", None, "orbax-to-hf: training step / policy version to export (default: the newest)")
flags.DEFINE_string("out_dir", None, "output directory (written atomically)")
flags.DEFINE_string("dtype", None, "hf-to-orbax: parameter dtype (default bfloat16); "
                                   "orbax-to-hf: force this dtype (default: the source checkpoint's dtypes)")
flags.DEFINE_string("mesh", None, "hf-to-orbax: shard leaves over a mesh, e.g. fsdp:4,expert:2")
flags.DEFINE_string("shard_size", "5GB", "orbax-to-hf: maximum safetensors shard size")
flags.DEFINE_bool("fp8", False, "orbax-to-hf: write the block-FP8 layout (float8_e4m3fn + weight_scale_inv)")
flags.DEFINE_bool("int4", False, "orbax-to-hf: routed experts as compressed-tensors pack-quantized INT4 "
                                  "(group size and scale dtype from the checkpoint's model config)")
flags.DEFINE_integer("int4_group_size", None, "orbax-to-hf --int4: input channels per scale (default: the "
                                               "checkpoint's quant_group_size)")
flags.DEFINE_string("tokenizer", None, "orbax-to-hf: tokenizer.json, or a directory of HF tokenizer files, for the "
                                       "export to carry (default: the checkpoint's own, e.g. a train.py run's BPE)")
flags.DEFINE_bool("overwrite", False, "replace an existing output directory")
FLAGS = flags.FLAGS


def main(argv):
    skip_absent_tpu()
    if len(argv) != 2 or argv[1] not in COMMANDS:
        raise app.UsageError(f"usage: python -m glm5_jax.convert {{{'|'.join(COMMANDS)}}} --flags")
    logging.set_verbosity(logging.WARNING)     # orbax logs every leaf at INFO
    import glm5_jax.convert as convert

    def need(name):
        if not getattr(FLAGS, name):
            raise app.UsageError(f"{argv[1]} needs --{name}")
        return getattr(FLAGS, name)

    try:
        if argv[1] == "hf-to-orbax":
            convert.hf_to_orbax(need("hf_dir"), need("out_dir"), dtype=FLAGS.dtype or "bfloat16",
                                mesh=FLAGS.mesh, overwrite=FLAGS.overwrite)
        else:
            convert.orbax_to_hf(need("ckpt_dir"), need("out_dir"), shard_size=FLAGS.shard_size, fp8=FLAGS.fp8,
                                dtype=FLAGS.dtype, overwrite=FLAGS.overwrite, int4=FLAGS.int4,
                                int4_group_size=FLAGS.int4_group_size, step=FLAGS.step,
                                tokenizer=FLAGS.tokenizer)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    app.run(main)
