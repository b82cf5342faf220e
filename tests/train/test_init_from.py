"""train.init_from: a new run starts from a train.py run (another DSA stage), a converter output or a
Hugging Face directory; mismatches are named; an existing workdir resumes instead."""
import dataclasses
import logging
import os

import jax
import numpy as np
import pytest

from glm5_jax.checkpoint.inference import load_for_inference
from glm5_jax.data import Batch
from glm5_jax.hf.config import config_from_hf
from glm5_jax.parallel.mesh import MeshConfig, build_mesh
from glm5_jax.train.experiment import apply_overrides, load_config_file
from glm5_jax.train.init_from import ArchitectureMismatch, initial_state
from glm5_jax.train.step import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "tests", "train", "small_run_config.py")


def small(*overrides):
    return apply_overrides(load_config_file(CONFIG), ["train.async_checkpointing=False", "data.batch_size=8", *overrides])


def _flat(tree):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    from glm5_jax.train.loop import run_training

    workdir = str(tmp_path_factory.mktemp("dense"))
    run_training(small("train.stage=dense", "train.steps=2"), workdir)
    return workdir


def test_warmup_run_starts_from_dense_run_weights(dense_run, tmp_path, caplog):
    from glm5_jax.train.loop import run_training

    _, dense_vars, _ = load_for_inference(dense_run)
    cfg = small("train.stage=warmup", "train.steps=1", f"train.init_from={dense_run}")
    trainer = Trainer(cfg, build_mesh(cfg.mesh))
    state, start = initial_state(trainer, dense_run, seed=0)
    assert start == 0 and int(state.step) == 0
    got, want = _flat(state.params), _flat(dense_vars["params"])
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state.moe_bias), jax.tree.leaves(dense_vars["moe_bias"])))
    assert all(not np.any(x) for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0)   # fresh Adam moments

    workdir = str(tmp_path / "warmup")
    with caplog.at_level(logging.INFO, logger="glm5_jax"):
        run_training(cfg, workdir)
    assert "initialised from train.py run" in caplog.text and "stage dense, step 2" in caplog.text
    assert os.listdir(os.path.join(workdir, "tokenizer")) == os.listdir(os.path.join(dense_run, "tokenizer"))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="glm5_jax"):                 # the workdir now has its own step
        run_training(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=2)), workdir)
    assert "resumed from step 1 (train.init_from=" in caplog.text and "is not used" in caplog.text


def test_keep_step_and_optimizer_within_a_stage(dense_run):
    cfg = small("train.stage=dense", f"train.init_from={dense_run}", "train.init_keep_step=True",
                "train.init_keep_optimizer=True")
    trainer = Trainer(cfg, build_mesh(cfg.mesh))
    state, start = initial_state(trainer, dense_run, keep_optimizer=True, keep_step=True)
    assert start == 2
    assert any(np.any(x) for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0)   # trained moments

    warm = small("train.stage=warmup")
    with pytest.raises(ValueError, match=r"optimizer state of train.py run .* does not match this run's "
                                         r"\(stage warmup"):
        initial_state(Trainer(warm, build_mesh(warm.mesh)), dense_run, keep_optimizer=True)


def test_architecture_mismatch_names_the_first_parameter(dense_run):
    cfg = small("model.q_lora_rank=24")
    trainer = Trainer(cfg, build_mesh(cfg.mesh))
    with pytest.raises(ArchitectureMismatch, match=r"params/decoder/segment_0/layer_0/attention/indexer/wq_b "
                                                   r"has shape \[1, 16, 2, 16\] in the checkpoint but "
                                                   r"\[1, 24, 2, 16\] in this run's model"):
        initial_state(trainer, dense_run)
    no_mtp = small("model.mtp_depth=0", "model.num_nextn_predict_layers=0")
    trainer = Trainer(no_mtp, build_mesh(no_mtp.mesh))
    with pytest.raises(ArchitectureMismatch, match=r"the checkpoint has (moe_bias|params)/mtp/.* which this run.s model lacks \(and \d+ more\)"):
        initial_state(trainer, dense_run)


def test_missing_source_and_keep_without_init_from_are_errors(tmp_path):
    cfg = small()
    with pytest.raises(FileNotFoundError, match="train.init_from=.*nowhere: no such directory"):
        initial_state(Trainer(cfg, build_mesh(cfg.mesh)), str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="need train.init_from"):
        small("train.init_keep_step=True").validate()


def test_converter_output_restores_onto_a_sharded_fp32_run(tmp_path):
    from glm5_jax.convert import hf_to_orbax
    from glm5_jax.hf.checkpoint import load_hf
    from tests.convert.convert_helpers import save_hf_model

    hf_dir = save_hf_model(str(tmp_path / "hf"))
    ckpt = str(tmp_path / "orbax")
    hf_to_orbax(hf_dir, ckpt, dtype="bfloat16")
    model = config_from_hf(hf_dir, remat_policy="none")
    cfg = dataclasses.replace(small(), model=model, mesh=MeshConfig(data=2, fsdp=2))
    trainer = Trainer(cfg, build_mesh(cfg.mesh, jax.devices()[:4]))
    state, _ = initial_state(trainer, ckpt)
    _, want = load_hf(hf_dir, dtype="bfloat16")
    got = _flat(state.params)
    for k, w in _flat(want["params"]).items():
        assert got[k].dtype == np.float32, k                       # cast to the run's param dtype
        np.testing.assert_array_equal(got[k], np.asarray(w, np.float32), err_msg=k)
    wq = jax.tree.leaves(state.params)[0]
    assert len(wq.sharding.device_set) == 4                         # placed on the run's mesh


def test_hf_checkpoint_step0_loss_equals_transformers_loss(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from glm5_jax.hf.checkpoint import load_hf
    from tests.convert.convert_helpers import save_hf_model

    hf_dir = save_hf_model(str(tmp_path / "hf"))                   # index_topk 8 < T: real top-k selection
    model_cfg, _ = load_hf(hf_dir)                                 # the architecture (MTP dropped: not saved)
    cfg = dataclasses.replace(small("train.stage=sparse", f"train.init_from={hf_dir}"),
                              model=model_cfg.replace(remat_policy="none"), mesh=MeshConfig(data=1, fsdp=1))
    trainer = Trainer(cfg, build_mesh(cfg.mesh, jax.devices()[:1]))
    state, start = initial_state(trainer, hf_dir)
    B, T = 2, 12
    tokens = np.random.default_rng(0).integers(0, model_cfg.vocab_size, (B, T)).astype(np.int32)
    batch = Batch(tokens=tokens, segment_ids=np.ones((B, T), np.int32),
                  positions=np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy())
    _, metrics = trainer.step(state, trainer.put_batch(batch))

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").float().eval()
    with torch.no_grad():
        want = hf(torch.as_tensor(tokens, dtype=torch.long), labels=torch.as_tensor(tokens, dtype=torch.long)).loss
    assert start == 0
    np.testing.assert_allclose(float(metrics["lm_loss"]), float(want), rtol=1e-4)


def test_rl_policy_starts_from_the_sft_run_through_the_same_reader(dense_run):
    from glm5_jax.rl.policy import Policy, rl_model_config
    from glm5_jax.rl.sft import load_sft_variables

    cfg = small("train.stage=dense", "train.steps=2")
    mesh_cfg = MeshConfig(data=1, fsdp=1)
    policy = Policy(rl_model_config(cfg.model), build_mesh(mesh_cfg, jax.devices()[:1]), mesh_cfg.rules)
    got = _flat(load_sft_variables(cfg, dense_run, policy))
    _, want, _ = load_for_inference(dense_run)
    want = _flat(want)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    with pytest.raises(FileNotFoundError, match="no finished SFT checkpoint \\(step 5\\)"):
        load_sft_variables(small("train.steps=5"), dense_run, policy)


def test_generate_on_a_train_workdir_logs_no_orbax_warnings(dense_run, caplog, capsys):
    """Reading a train.py workdir (state + meta + data items) for inference asks orbax only for the
    params: no "Item 'state' ... could not be restored" or "Metadata file does not exist" warnings."""
    from glm5_jax.generate import __main__ as generate_cli

    caplog.set_level(logging.INFO)
    generate_cli.FLAGS.unparse_flags()       # absl's flags are process-global: no other test's --prompt
    try:
        generate_cli.FLAGS(["generate", f"--checkpoint={dense_run}", "--prompt=The", "--max_new_tokens=3"])
        generate_cli.main([])
    finally:
        generate_cli.FLAGS.unparse_flags()
    assert "checkpoint step 2: " in capsys.readouterr().out
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == []
