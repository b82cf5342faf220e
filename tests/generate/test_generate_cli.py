"""python -m glm5_jax.generate on a converted checkpoint prints what generate() produces."""
import numpy as np

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


def test_cli_prints_the_greedy_continuation(tmp_path, capsys):
    build_hf_model("shared_index").save_pretrained(tmp_path / "hf")
    hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "ckpt"), dtype="float32")
    tokenizer = train_bpe(["def add(x, y):\n    return x + y\n"] * 20, vocab_size=280, show_progress=False)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
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
