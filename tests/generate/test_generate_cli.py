"""python -m glm5_jax.generate on a converted checkpoint prints what generate() produces."""
import os
import subprocess
import sys

import numpy as np
import pytest

from glm5_jax import load_hf
from glm5_jax.convert.hf_to_orbax import hf_to_orbax
from glm5_jax.data.tokenizer import train_bpe
from glm5_jax.generate import __main__ as generate_cli
from glm5_jax.generate.decoding import generate
from hf_reference import build_hf_model


def _run(flags):
    generate_cli.FLAGS.unparse_flags()       # absl's flags are process-global: no other test's --prompt
    try:
        generate_cli.FLAGS(["generate", *flags])
        return generate_cli.main([])
    finally:
        generate_cli.FLAGS.unparse_flags()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A converted tiny GLM-5 (a dense layer, then MoE layers with a shared indexer layer) and a BPE:
    (directory, tokenizer)."""
    tmp_path = tmp_path_factory.mktemp("cli")
    build_hf_model("shared_index", num_hidden_layers=3).save_pretrained(tmp_path / "hf")
    hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "ckpt"), dtype="float32")
    tokenizer = train_bpe(["def add(x, y):\n    return x + y\n"] * 20, vocab_size=280, show_progress=False)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    return tmp_path, tokenizer


def test_cli_prints_the_greedy_continuation(converted, capsys):
    tmp_path, tokenizer = converted
    prompt = "def add(x"
    assert _run([f"--checkpoint={tmp_path / 'ckpt'}", f"--tokenizer={tmp_path / 'tokenizer.json'}",
                 f"--prompt={prompt}", "--max_new_tokens=12"]) == 0
    out = capsys.readouterr().out

    cfg, variables = load_hf(str(tmp_path / "hf"))
    ids = tokenizer.encode(prompt)
    want = generate(cfg, variables, ids[None], [len(ids)], max_new_tokens=12, temperature=0.0,
                    eos_ids=tuple(set(cfg.eos_token_id) | {tokenizer.eos_id}))
    n = int(want.lengths[0])
    assert prompt + tokenizer.decode(np.asarray(want.tokens[0, :n])) in out
    assert f"{n} new tokens in" in out and "tokens/s" in out

    # a checkpoint without a tokenizer, or a wrong --tokenizer: one line naming it, status 1
    assert _run([f"--checkpoint={tmp_path / 'ckpt'}", "--prompt=x"]) == 1
    assert capsys.readouterr().err == (f"error: --tokenizer is required: found 0 tokenizer.json under "
                                       f"{tmp_path / 'ckpt'} (a train.py workdir keeps its BPE in tokenizer/bpe-*/)\n")
    assert _run([f"--checkpoint={tmp_path / 'ckpt'}", f"--tokenizer={tmp_path / 'none.json'}", "--prompt=x"]) == 1
    assert capsys.readouterr().err == f"error: tokenizer file does not exist: {tmp_path / 'none.json'}\n"


def test_cli_on_a_mesh_prints_the_single_device_text(converted, capsys):
    """--mesh with --host_devices in a fresh process (no device count inherited): three prompts (padded to
    the four batch shards) continue exactly as on one device; so do they with --sampler_kernels."""
    tmp_path, _ = converted
    flags = [f"--checkpoint={tmp_path / 'ckpt'}", f"--tokenizer={tmp_path / 'tokenizer.json'}", "--prompt=def add(x",
             "--prompt=return", "--prompt=def add(x, y):", "--max_new_tokens=10"]
    assert _run(flags) == 0
    single = capsys.readouterr().out.splitlines()
    # the decode steps through the decode program's kernels (interpreted): the same text
    assert _run([*flags, "--sampler_kernels=pallas_interpret"]) == 0
    assert capsys.readouterr().out.splitlines()[:-1] == single[:-1]
    env = {**os.environ, "XLA_FLAGS": "--xla_backend_optimization_level=0", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-m", "glm5_jax.generate", *flags, "--mesh=data:2,expert:2,tensor:2",
                           "--host_devices=8"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    sharded = done.stdout.splitlines()
    assert sharded[:-1] == single[:-1] and sum(line.startswith("--- [") for line in single) == 3
    assert "(batch 3, mesh data:2,expert:2,tensor:2, prefill included" in sharded[-1]

    # a mesh the model cannot split: one line naming it, status 1
    assert _run([*flags[:3], "--mesh=tensor:3"]) == 1
    assert capsys.readouterr().err.startswith("error: the sampling mesh does not fit the model: heads splits 3 "
                                              "ways (tensor:3) but num_attention_heads=4 is not divisible by 3;")
