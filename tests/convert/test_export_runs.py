"""orbax-to-hf exports what train.py and the RL learner write: a 4-step tiny train.py run and a QAT run
(model.quant=int4_qat) load in transformers and give the project's own logits on the same checkpoint;
the QAT run's --int4 export decompresses (compressed-tensors) to exactly the project's INT4 rounding of
the run's master weights; an RL policy version exports to the same tensors as the run it started from."""
import json
import os
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from convert_helpers import assert_same_tensors

from glm5_jax import Transformer
from glm5_jax.checkpoint.errors import CheckpointError
from glm5_jax.checkpoint.inference import checkpoint_tokenizer, load_for_inference
from glm5_jax.convert import hf_to_orbax, load_model_config, orbax_to_hf
from glm5_jax.data.tokenizer import load_tokenizer
from glm5_jax.hf.safetensors_io import SafetensorsCheckpoint
from glm5_jax.quant import int4

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "tests", "train", "small_run_config.py")
GROUP = 8            # INT4 packs 8 groups per chunk: 8 x 8 divides the expert input widths (64)
# tests/train/small_run_config.py with expert input widths INT4 can pack, and 16 indexer heads (with 2, a key
# whose heads are all ReLU-zero scores exactly 0 and torch / XLA break such top-k ties differently)
RUN = ["train.async_checkpointing=False", "data.batch_size=8", "train.steps=4", "train.checkpoint_every=2",
       "train.eval_every=4",
       "model.hidden_size=64", "model.moe_intermediate_size=64", "model.index_n_heads=16"]
# the scales in fp32: compressed-tensors dequantises in the scale dtype, and q * scale is exact in fp32; the
# dense DSA stage (no indexer KL) compiles faster, and the export does not depend on the stage
QAT = [f"model.quant_group_size={GROUP}", "model.quant_scale_dtype=float32", "model.quant=int4_qat",
       "train.stage=dense"]


def _train(workdir, overrides):
    from glm5_jax.train.experiment import apply_overrides, load_config_file
    from glm5_jax.train.loop import run_training

    run_training(apply_overrides(load_config_file(CONFIG), RUN + overrides), str(workdir))
    return str(workdir)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("plain"), [])


@pytest.fixture(scope="module")
def plain_export(plain_run, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("export") / "hf")
    summary = orbax_to_hf(plain_run, out)              # the workdir: its latest step (4)
    assert summary["tensors"] > 0
    return out


@pytest.fixture(scope="module")
def qat_run(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("qat"), QAT)


def _tokens(cfg):
    return np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24))    # 24 > index_topk: DSA selects


def _transformers_logits(hf_dir, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


def _our_logits(checkpoint, tokens):
    cfg, variables, _ = load_for_inference(checkpoint)
    return np.asarray(jax.jit(lambda v, t: Transformer(cfg).apply(v, t).logits)(variables, jnp.asarray(tokens)))


def test_train_run_exports_to_transformers(plain_run, plain_export, tmp_path):
    cfg = load_model_config(plain_run)
    assert cfg.runtime.param_dtype == "float32" and cfg.runtime.attention_mode == "sparse"
    out = plain_export
    hf = json.load(open(os.path.join(out, "config.json")))
    assert hf["model_type"] == "glm_moe_dsa" and hf["dtype"] == "float32"
    tokens = _tokens(cfg)
    np.testing.assert_allclose(_transformers_logits(out, tokens), _our_logits(plain_run, tokens), atol=1e-5, rtol=0)

    # --step picks an older step (2); its checkpoints/ directory names the same run
    older = str(tmp_path / "hf_step2")
    orbax_to_hf(os.path.join(plain_run, "checkpoints"), older, step=2)
    a, b = SafetensorsCheckpoint(out), SafetensorsCheckpoint(older)
    assert set(a.keys()) == set(b.keys())
    assert not np.array_equal(a.raw("lm_head.weight"), b.raw("lm_head.weight"))   # two more steps of training
    with pytest.raises(CheckpointError, match=r"no step 3; committed steps are \[2, 4\]"):
        orbax_to_hf(plain_run, str(tmp_path / "none"), step=3)


def test_qat_run_int4_export(qat_run, tmp_path):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    cfg, variables, _ = load_for_inference(qat_run)
    assert cfg.quant == "int4_qat" and cfg.quant_group_size == GROUP
    out = str(tmp_path / "int4")
    orbax_to_hf(qat_run, out, int4=True)
    qc = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    scheme = QuantizationConfig.model_validate(qc).config_groups["group_0"]
    exported = SafetensorsCheckpoint(out)
    # routed experts of the one MoE layer (layer 1: scanned, [1, E, in, out]) and of the MTP layer (2: [E, in, out])
    checked = 0
    for hf_layer, moe, index in ((1, variables["params"]["decoder"]["segment_1"]["layer_0"]["moe"], 0),
                                 (2, variables["params"]["mtp"]["block"]["moe"], ...)):
        for name in ("gate_proj", "up_proj", "down_proj"):
            master_EKN = np.asarray(moe[name])[index]
            ours_EKN = np.asarray(int4.fake_quantize(jnp.asarray(master_EKN), GROUP, "float32"))
            for e in range(cfg.n_routed_experts):
                base = f"model.layers.{hf_layer}.mlp.experts.{e}.{name}."
                state = {s: torch.from_numpy(np.array(exported.raw(base + s)))
                         for s in ("weight_packed", "weight_scale", "weight_shape")}
                theirs_OI = PackedQuantizationCompressor.decompress(state, scheme)["weight"].numpy()
                np.testing.assert_array_equal(theirs_OI, ours_EKN[e].T, err_msg=base)
                checked += 1
    assert checked == 2 * 3 * cfg.n_routed_experts
    assert not np.array_equal(ours_EKN, master_EKN)                        # the rounding did change weights
    # transformers runs the INT4 export (compressed-tensors, fp32 scales) as the run's QAT forward
    tokens = _tokens(cfg)
    np.testing.assert_allclose(_transformers_logits(out, tokens), _our_logits(qat_run, tokens), atol=1e-5, rtol=0)
    with pytest.raises(CheckpointError, match="trained with INT4 QAT at quant_group_size=8"):
        orbax_to_hf(qat_run, str(tmp_path / "other"), int4=True, int4_group_size=16)


def test_rl_policy_exports_like_its_starting_run(plain_run, plain_export, tmp_path):
    """An RL learner's version 0 holds the run's variables: its export is the run's, tensor for tensor."""
    from glm5_jax.rl.config import RLConfig, RLExperiment
    from glm5_jax.rl.learner import Learner
    from glm5_jax.train.experiment import apply_overrides, load_config_file

    sft = apply_overrides(load_config_file(CONFIG), RUN)
    _, variables, _ = load_for_inference(plain_run)
    exp = RLExperiment(rl=RLConfig(num_versions=1, prompts_per_batch=2, group_size=2, eval_every=0))
    learner = Learner(exp, str(tmp_path / "rl"), sft, "/unused")
    learner._publish(0, variables, jax.jit(learner.tx.init)(variables["params"]), learner._fresh_meta())
    learner.writer.wait()
    learner.writer.close()
    orbax_to_hf(str(tmp_path / "rl"), str(tmp_path / "from_policy"))
    assert assert_same_tensors(plain_export, str(tmp_path / "from_policy")) > 0
    assert json.load(open(os.path.join(plain_export, "config.json"))) == \
        json.load(open(tmp_path / "from_policy" / "config.json"))


TEXTS = ["def add(x, y):\n    return x + y\n", "The quick brown fox <|endoftext|> jumps", "  tabs\tand ünïcode ✓"]


def test_the_export_carries_the_runs_tokenizer(plain_run, plain_export, tmp_path):
    """AutoTokenizer loads from the export alone and encodes as the run's own tokenizer; its special tokens
    are the exported config's ids; an hf-to-orbax of the export carries the same files on."""
    from transformers import AutoTokenizer

    ours = load_tokenizer(checkpoint_tokenizer(plain_run))
    theirs = AutoTokenizer.from_pretrained(plain_export)
    for text in TEXTS:
        assert theirs.encode(text) == theirs(text)["input_ids"] == ours.encode(text).tolist(), text
        assert theirs.decode(theirs.encode(text)) == text
    hf = json.load(open(os.path.join(plain_export, "config.json")))
    assert (theirs.eos_token_id, theirs.pad_token_id, theirs.bos_token_id) == (hf["eos_token_id"], hf["pad_token_id"],
                                                                               None) == (ours.eos_id, 0, None)
    assert len(theirs) == ours.vocab_size

    converted = str(tmp_path / "converted")
    hf_to_orbax(plain_export, converted, dtype="float32")
    assert checkpoint_tokenizer(converted) == os.path.join(converted, "tokenizer.json")
    orbax_to_hf(converted, str(tmp_path / "again"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert open(tmp_path / "again" / name).read() == open(os.path.join(plain_export, name)).read()


def test_written_files_have_the_modes_open_gives(plain_run, plain_export):
    umask = os.umask(0)
    os.umask(umask)
    shard = sorted(f for f in os.listdir(plain_export) if f.endswith(".safetensors"))[0]
    for path in (os.path.join(plain_export, "config.json"), os.path.join(plain_export, shard),
                 os.path.join(plain_export, "model.safetensors.index.json"),
                 os.path.join(plain_export, "tokenizer_config.json"), os.path.join(plain_run, "config.json")):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask, path
    assert stat.S_IMODE(os.stat(plain_export).st_mode) == 0o777 & ~umask
