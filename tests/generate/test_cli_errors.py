"""`python -m glm5_jax.generate` and `python -m glm5_jax.serve` name a wrong --checkpoint in one line (before
looking for its tokenizer) and exit with status 1, as `python -m glm5_jax.convert` does; no traceback."""
import os
import subprocess
import sys

import pytest

from glm5_jax.generate import __main__ as generate_cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOT_A_CHECKPOINT = ("is not a checkpoint: expected a train.py workdir or its checkpoints/, an hf-to-orbax output, "
                    "or an RL workdir or its policy/ (found no committed orbax step)")


def _generate(flags, capsys):
    """generate's main with these flags parsed (absl's flags are process-global: unparsed after)."""
    generate_cli.FLAGS.unparse_flags()
    try:
        generate_cli.FLAGS(["generate", *flags, "--prompt=x"])
        status = generate_cli.main([])
    finally:
        generate_cli.FLAGS.unparse_flags()
    out = capsys.readouterr()
    assert out.out == ""
    return status, out.err


@pytest.fixture
def not_a_checkpoint(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    return tmp_path / "notes"


def test_generate_names_a_wrong_checkpoint(tmp_path, not_a_checkpoint, capsys):
    missing = tmp_path / "nowhere"
    assert _generate([f"--checkpoint={missing}"], capsys) == (1, f"error: {missing}: no such directory\n")
    assert _generate([f"--checkpoint={not_a_checkpoint}"], capsys) == \
        (1, f"error: {not_a_checkpoint}: {NOT_A_CHECKPOINT}\n")
    file = not_a_checkpoint / "a.txt"
    assert _generate([f"--checkpoint={file}"], capsys) == (1, f"error: {file}: not a directory\n")
    # a Hugging Face directory (what orbax-to-hf writes) is told how to become a checkpoint
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model-00001-of-00001.safetensors").write_bytes(b"")
    assert _generate([f"--checkpoint={hf}"], capsys) == \
        (1, f"error: {hf}: is a Hugging Face checkpoint, not an orbax one; convert it first: "
            f"python -m glm5_jax.convert hf-to-orbax --hf_dir={hf} --out_dir=DIR\n")


def test_serve_names_a_wrong_checkpoint_with_exit_status_1(tmp_path, not_a_checkpoint):
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    for path, problem in ((tmp_path / "nowhere", "no such directory"), (not_a_checkpoint, NOT_A_CHECKPOINT)):
        r = subprocess.run([sys.executable, "-m", "glm5_jax.serve", f"--checkpoint={path}"],
                           env=env, capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout, r.stderr) == (1, "", f"error: {path}: {problem}\n")
