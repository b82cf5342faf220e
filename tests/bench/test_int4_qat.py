"""bench/int4_qat.py --task=lm: its eval loss is the trainer's own eval, and its INT4 row is the packed model,
which computes the same loss as the fake-quantised (int4_qat) forward of the master weights."""
import json
import os

import numpy as np

from bench.int4_qat import experiment, lm_eval_batches, lm_evaluate, rows_for, train
from glm5_jax.checkpoint.inference import load_for_inference

# configs/int4_lm.py at the size of tests/train/small_run_config.py: a few steps in seconds
SMALL = ["model.vocab_size=512", "data.vocab_size=512", "data.max_corpus_bytes=150000", "data.min_eval_docs=2",
         "data.seq_len=32", "data.batch_size=8", "model.hidden_size=64", "model.num_attention_heads=2",
         "model.q_lora_rank=16", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8",
         "model.v_head_dim=8", "model.index_n_heads=2", "model.index_head_dim=16", "model.index_topk=8",
         "model.num_hidden_layers=2", "model.moe_intermediate_size=64", "train.eval_batches=2",
         "train.warmup_steps=2"]
GROUP = 8                                   # 8 x 8 divides both expert input widths (64)


def test_lm_eval_is_the_trainers_and_int4_is_the_fake_quantised_model(tmp_path):
    exp = experiment("lm", SMALL)
    assert exp.model.first_k_dense_replace == 0 and exp.model.n_shared_experts == 0   # every FFN is routed
    workdir = train(exp, str(tmp_path / "base"), steps=3)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        logged = [r["eval_loss"] for r in map(json.loads, f) if "eval_loss" in r]
    batches = lm_eval_batches(exp, workdir, exp.train.eval_batches)
    evaluate_fn = lambda cfg, v: lm_evaluate(exp, cfg, v, batches)   # noqa: E731
    full, int4 = rows_for("base", workdir, GROUP, evaluate_fn)
    assert full["step"] == int4["step"] == 3
    np.testing.assert_allclose(full["eval_loss"], logged[-1], rtol=1e-6)
    cfg, variables, _ = load_for_inference(os.path.join(workdir, "checkpoints"))
    qat = lm_evaluate(exp, cfg.replace(quant="int4_qat", quant_group_size=GROUP), variables, batches)
    assert int4["eval_loss"] == qat["eval_loss"]                          # bitwise in fp32
    assert int4["eval_loss"] != full["eval_loss"]                         # INT4 did change the weights
