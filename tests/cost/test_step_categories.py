"""glm5_jax.cost.categories on op_names taken from a compiled GLM-5 train step, and the model FLOPs per
category of glm5_jax.cost.flops against the whole-step count."""
import os

import pytest

from glm5_jax.cost.categories import CATEGORIES, categorize, expert_pass
from glm5_jax.cost.flops import train_flops_by_category, train_flops_per_token
from glm5_jax.cost.hlo_cost import HLO_COMPUTATION_PREFIX
from glm5_jax.train.experiment import apply_overrides, load_config_file
from tests.train.test_compile_report import SMALL
from tests.train.test_train_cli import ROOT

STEP = "jit(_train_step)/"
FWD = STEP + "jvp(Transformer)/Transformer._main/decoder/while/body/closed_call/segment_1/layer_0/"
DECODE = "jit(<lambda>)/while/body/closed_call/Transformer.decode/Transformer._main/decoder/while/body/closed_call/" \
    "segment_1/layer_0/"
BWD = STEP + "transpose(jvp(Transformer))/Transformer._main/decoder/checkpoint/segment_1/layer_0/"


@pytest.mark.parametrize("op_name, category", [
    (FWD + "attention/btd,dq->btq/dot_general", "projections"),
    (BWD + "attention/dbt,btq->dq/dot_general", "projections"),                    # weight gradient
    (BWD + "attention/transpose(jvp(bthv,hvd->btd))/dot_general", "projections"),  # input gradient
    (FWD + "attention/attention._select/indexer/btq,qhd->bthd/dot_general", "projections"),
    (FWD + "attention/attention._select/attention._indexer_topk/btd,bsd->bts/dot_general", "indexer_topk"),
    (FWD + "attention/attention._sparse_core/shard_map/pallas_call", "attention_core"),
    (FWD + "attention/attention._training_sparse_xla/attention._masked_dense/bhts,bhsv->bhtv/dot_general",
     "attention_core"),
    (FWD + "attention/attention._training_sparse_xla/attention._masked_dense/bsc,chk->bshk/dot_general",
     "projections"),                                                                # per-key up-projection
    (FWD + "attention/closed_call/while/body/closed_call/btkd,bthd->btkh/dot_general", "indexer_kl"),
    (FWD + "attention/indexer_kl/btkd,bthd->btkh/dot_general", "indexer_kl"),
    (FWD + "attention/mul", "projections"),
    (FWD + "moe/shard_map/ragged_dot_general/ragged-dot-none", "routed_experts"),
    ("ragged-dot-none", "routed_experts"),
    (FWD + "moe/dot_general", "routed_experts"),                                   # the router
    (FWD + "moe/shared_expert/btd,df->btf/dot_general", "shared_mlp"),
    (STEP + "jvp(Transformer)/Transformer._main/decoder/segment_0/layer_0/mlp/btf,fd->btd/dot_general", "shared_mlp"),
    (STEP + "jvp(Transformer)/Transformer._main/Transformer.head/btd,dv->btv/dot_general", "lm_head_loss"),
    # what else runs inside the layer stack is not the head's: norms, the scan's carries, mHC mixers
    (FWD + "input_norm/mul", "layer_glue"),
    (STEP + "jvp(Transformer)/Transformer._main/decoder/while/body/jit(dynamic_update_index_in_dim)/"
     "dynamic_update_slice", "layer_glue"),
    (FWD + "attn_hc/convert_element_type", "hyper_connections"),
    (BWD + "ffn_hc/dot_general", "hyper_connections"),
    (FWD + "btji,btjd->btid/dot_general", "hyper_connections"),                     # an unscoped merge
    (STEP + "jvp()/reduce_max", "lm_head_loss"),
    (STEP + "jvp(Transformer)/mtp/block/moe/shared_expert/btd,df->btf/dot_general", "mtp"),
    (STEP + "jvp(Transformer)/Transformer.embed/jit(_take)/gather", "other"),
    (STEP + "sqrt/", "optimizer"),
    # a decode program: the layer loop's own while (what metadata-less instructions in its body inherit) is
    # the layer stack's, as in training; a model method's op outside the layer stack is "other", not the
    # optimizer's
    ("jit(<lambda>)/while/body/closed_call/Transformer.decode/Transformer._main/decoder/while", "layer_glue"),
    ("jit(<lambda>)/while/body/closed_call/Transformer.decode/Transformer._main/argmax", "other"),
    (DECODE + "moe/shard_map/convert_element_type", "routed_experts"),
    (HLO_COMPUTATION_PREFIX + "convolution_select_fusion.3", "routed_experts"),
    (HLO_COMPUTATION_PREFIX + "fused_computation.12", "other"),
])
def test_categorize(op_name, category):
    assert categorize(op_name) == category


MOE = "Transformer._main/decoder/while/body/closed_call/checkpoint/segment_1/layer_0/moe/shard_map/cond/branch_0_fun/"


@pytest.mark.parametrize("op_name, expert_pass_name", [   # kernel op_names of a 744B step compiled for v5p
    (STEP + "jvp(Transformer)/" + MOE.replace("checkpoint/", "") + "jit(gmm)/pallas_call", "forward"),
    (STEP + "transpose(jvp(Transformer))/" + MOE.replace("checkpoint/", "checkpoint/rematted_computation/")
     + "jit(gmm)/pallas_call", "remat"),
    (STEP + "transpose(jvp(Transformer))/" + MOE + "jit(gmm)/pallas_call", "input_grad"),
    (STEP + "transpose(jvp(Transformer))/" + MOE + "jit(tgmm)/pallas_call", "weight_grad"),
    (STEP + "transpose(jvp(Transformer))/mtp/block/moe/shard_map/cond/branch_0_fun/jit(tgmm)/pallas_call", "not_experts"),
    (HLO_COMPUTATION_PREFIX + "convolution_select_fusion.3", "weight_grad"),       # ragged_dot's TPU expansion
    (FWD + "moe/shared_expert/btd,df->btf/dot_general", "not_experts"),
    (FWD + "attention/indexer_kl/btkd,bthd->btkh/dot_general", "not_experts"),
])
def test_expert_pass(op_name, expert_pass_name):
    assert expert_pass(op_name) == expert_pass_name


def test_model_flops_by_category_add_up_to_the_step_count():
    cfg = apply_overrides(load_config_file(os.path.join(ROOT, "configs", "glm5_744b.py")), SMALL).model
    T = 128
    by_cat = train_flops_by_category(cfg, T)
    total = train_flops_per_token(cfg, T)
    assert set(by_cat) == set(CATEGORIES)
    head = 6 * cfg.vocab_size * cfg.hidden_size
    assert by_cat["lm_head_loss"] == 2 * head                           # main + the MTP's second use
    # without MTP: the step total less the norm weights it counts (3 layers x 4 norms + final + indexer
    # k_norm scale and bias, all of width D or a LoRA rank: well under 1%)
    main = sum(v for k, v in by_cat.items() if k != "mtp") - head
    assert 0.99 * total["total"] < main <= total["total"]
    assert by_cat["attention_core"] == total["attention"]
    assert by_cat["indexer_topk"] + by_cat["indexer_kl"] == pytest.approx(total["indexer"])
    # routed: 8 of 8 experts active here, 3 matrices D x F per expert, 2 MoE layers, + the router D x E
    assert by_cat["routed_experts"] == 6 * 2 * (8 * 3 * cfg.hidden_size * cfg.moe_intermediate_size
                                                 + cfg.hidden_size * cfg.n_routed_experts)


def test_model_flops_of_each_stage_count_only_the_indexer_work_it_runs():
    """Per full-indexer layer, H_I x d_I MACs per scored key: the dense stage runs no indexer, the warm-up
    scores every visible key and back-propagates its KL (3 x), the sparse stage scores every visible key
    for the top-k (forward) and back-propagates the KL over the selected k (2 x)."""
    from glm5_jax.cost.flops import mean_visible_keys

    cfg = apply_overrides(load_config_file(os.path.join(ROOT, "configs", "glm5_744b.py")), SMALL).model
    T = 128
    per_key = 2 * cfg.index_n_heads * cfg.index_head_dim * sum(t == "full" for t in cfg.layer_indexer_types)
    every, selected = mean_visible_keys(T, None), mean_visible_keys(T, cfg.index_topk)
    dense = train_flops_per_token(cfg, T, sparse=False, indexer_loss="none")
    warmup = train_flops_per_token(cfg, T, sparse=False, indexer_loss="warmup")
    sparse = train_flops_per_token(cfg, T, sparse=True, indexer_loss="sparse")
    assert dense["indexer"] == 0 and dense["total"] == dense["matmul"] + dense["attention"]
    assert warmup["indexer"] == pytest.approx(3 * per_key * every)
    # the indexer's projections per layer (q from the query latent, k and the head weights from the hidden
    # state): the dense stage runs none of them, the warm-up their forward and weight gradient (inputs
    # detached), the sparse stage all three passes
    D = cfg.hidden_size
    indexer_weights = cfg.num_hidden_layers * (cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim
                                               + D * cfg.index_head_dim + D * cfg.index_n_heads)
    assert sparse["matmul"] - dense["matmul"] == 6 * indexer_weights
    # the warm-up trains only the indexer: the rest of the model runs forward only
    assert warmup["matmul"] == dense["matmul"] / 3 + 4 * indexer_weights
    assert warmup["attention"] == dense["attention"] / 3
    assert sparse["indexer"] == pytest.approx(per_key * every + 2 * per_key * selected)
    dense_cat = train_flops_by_category(cfg, T, sparse=False, indexer_loss="none")
    sparse_cat = train_flops_by_category(cfg, T, sparse=True, indexer_loss="sparse")
    assert sparse_cat["projections"] - dense_cat["projections"] == 6 * indexer_weights
    assert train_flops_by_category(cfg, T, sparse=False, indexer_loss="none")["indexer_kl"] == 0
