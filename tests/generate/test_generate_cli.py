"""python -m glm5_jax.generate on a converted checkpoint prints what generate() produces."""
import numpy as np

from glm5_jax import load_hf
from glm5_jax.convert.hf_to_orbax import hf_to_orbax
from glm5_jax.data.tokenizer import train_bpe
from glm5_jax.generate import __main__ as generate_cli
from glm5_jax.generate.decoding import generate
from hf_reference import build_hf_model


def test_cli_prints_the_greedy_continuation(tmp_path, capsys):
    build_hf_model("shared_index").save_pretrained(tmp_path / "hf")
    hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "ckpt"), dtype="float32")
    tokenizer = train_bpe(["def add(x, y):\n    return x + y\n"] * 20, vocab_size=280, show_progress=False)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    prompt = "def add(x"
    generate_cli.FLAGS.unparse_flags()       # absl's flags are process-global: no other test's --prompt
    try:
        generate_cli.FLAGS(["generate", f"--checkpoint={tmp_path / 'ckpt'}",
                            f"--tokenizer={tmp_path / 'tokenizer.json'}", f"--prompt={prompt}", "--max_new_tokens=12"])
        generate_cli.main([])
    finally:
        generate_cli.FLAGS.unparse_flags()
    out = capsys.readouterr().out

    cfg, variables = load_hf(str(tmp_path / "hf"))
    ids = tokenizer.encode(prompt)
    want = generate(cfg, variables, ids[None], [len(ids)], max_new_tokens=12, temperature=0.0,
                    eos_ids=tuple(set(cfg.eos_token_id) | {tokenizer.eos_id}))
    n = int(want.lengths[0])
    assert prompt + tokenizer.decode(np.asarray(want.tokens[0, :n])) in out
    assert f"{n} new tokens in" in out and "tokens/s" in out
