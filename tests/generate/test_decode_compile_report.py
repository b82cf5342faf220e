"""The decode compile report (glm5_jax.generate.compile_report) for a tiny GLM-5 on v5p:2x2x1 (4 chips): the
multi-step decode program compiles with libtpu, and the record's fields agree with hand counts."""
import importlib.util
import json

import pytest

from glm5_jax.generate import compile_report
from glm5_jax.model.config import ModelConfig, RuntimeConfig

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not importable (pip install -r requirements-tpu.txt)")

# INT4-packable widths: hidden and expert width multiples of 8 x quant_group_size (and half the expert width,
# its share on tensor:2)
TINY = ModelConfig(vocab_size=4096, hidden_size=128, num_hidden_layers=3, first_k_dense_replace=1,
                   intermediate_size=384, num_attention_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
                   qk_rope_head_dim=16, v_head_dim=32, index_n_heads=4, index_head_dim=32, index_topk=64,
                   n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, quant_group_size=8,
                   max_position_embeddings=4096, eos_token_id=(1,), pad_token_id=0, runtime=RuntimeConfig())
BATCH, CONTEXT, STEPS = 4, 256, 2


@pytest.fixture(scope="module")
def record():
    return compile_report.compile_point(TINY, "v5p:2x2x1", "expert:2,tensor:2", BATCH, CONTEXT, "int4", STEPS)


def test_record_fields(record):
    assert record["chips"] == 4 and record["mesh"] == {"expert": 2, "tensor": 2}
    assert record["fits"] and 0 < record["memory_gib"] < record["hbm_limit_gib"]
    assert record["loop_trip_counts"].count(STEPS) >= 1          # the decode loop, read from the HLO
    assert not record["uncounted_custom_calls"]                  # the INT4 kernel declares its cost
    step = record["estimated_step_seconds"]
    assert step >= record["roofline_seconds"] > 0
    assert step == pytest.approx(record["roofline_seconds"] + record["exposed_communication_seconds"])
    assert record["tokens_per_second_per_chip"] == pytest.approx(BATCH / 4 / step)
    assert record["top_categories"] and record["communication_seconds"] > 0     # gathers, all-reduces
    json.dumps(record)                                            # the report is plain JSON


def test_hbm_roofline_bytes_by_hand(record):
    reads = record["hbm_roofline_bytes"]
    # cache, per chip: 2 rows (batch 4 over expert:2, replicated over tensor), 3 layers x 64 selected latent rows
    # of 64 + 16 bf16 values, and every one of the 256 slots' 32-wide index keys on the 3 full-indexer layers
    assert reads["cache"] == 2 * 2 * (3 * 64 * 80 + 3 * 256 * 32)
    # routed INT4 experts: per MoE layer (2 of them) gate / up / down each [8, 128, 128] as int32 words of 8
    # values (8 x 16 x 128 x 4 B) and bf16 scales per 8 inputs (8 x 16 x 128 x 2 B); a chip holds a quarter
    # (4 experts of expert:2, half their width over tensor:2) and a given expert is chosen by one of the 4
    # tokens it sees (its expert group's) with probability 1 - (1 - 2/8)^4
    per_chip = 2 * 3 * (8 * 16 * 128 * (4 + 2)) // 4
    assert reads["routed_experts"] == int(per_chip * (1 - 0.75 ** 4))
    assert reads["embedding"] == 2 * 128 * 2                      # the 2 rows' embedding rows, bf16
    assert reads["total"] == sum(reads[k] for k in ("weights", "routed_experts", "embedding", "cache"))
    assert record["hbm_roofline_seconds"] == pytest.approx(reads["total"] / (2765e9 * 0.85))   # v5p, achievable


def test_table_has_one_row_per_record(record):
    text = compile_report.table([record, record])
    assert text.count("| v5p:2x2x1 | expert:2,tensor:2 | 4 | 256 | int4 | slice | gather | True |") == 2


def test_stacked_cache_read_compiles_with_the_row_gather_kernel(tmp_path):
    """cache_read="pallas": the decode program compiles for v5p with the row-gather kernel reading the stacked
    cache (one call per attention layer of the scan), and the record names the read and counts the kernel."""
    import gzip

    path = str(tmp_path / "decode.hlo.gz")
    r = compile_report.compile_point(TINY, "v5p:2x2x1", "expert:2,tensor:2", BATCH, CONTEXT, "int4", STEPS,
                                     cache_read="pallas", hlo_path=path)
    assert r["fits"] and r["cache_read"] == "pallas" and not r["uncounted_custom_calls"]
    text = gzip.open(path, "rt").read()
    assert "stacked_row_gather" in text and "tpu_custom_call" in text


def test_a2a_decode_dispatch_compiles_with_all_to_alls(tmp_path):
    """moe_ep="a2a_decode": the decode program compiles for v5p with the MoE's rows sent by all-to-alls (the
    rows, their local experts, the results: three per MoE layer of the scan body) and the record names it."""
    import gzip
    import re

    path = str(tmp_path / "decode.hlo.gz")
    r = compile_report.compile_point(TINY, "v5p:2x2x1", "expert:2,tensor:2", BATCH, CONTEXT, "int4", STEPS,
                                     moe_ep="a2a_decode", hlo_path=path)
    assert r["fits"] and r["moe_ep"] == "a2a_decode" and not r["uncounted_custom_calls"]
    text = gzip.open(path, "rt").read()
    assert len(re.findall(r"= \S+ all-to-all(?:-start)?\(", text)) >= 3


def test_slot_split_cache_compiles_without_gathering_the_cache(tmp_path):
    """cache_read="pallas" over `context:2,tensor:2` (the cache's slots split): each shard selects, gathers and
    attends over its own slots and writes the new rows that fall in them (glm5_jax/model/decode_context.py,
    kv_cache.write_stacked_rows), so no collective of the compiled v5p program moves a layer's slots: every
    all-gather is smaller than one layer's index keys of the batch on one shard (a write at a run-time slot of
    the sharded axis, left to the sharding propagation, all-gathers the whole stacked cache)."""
    import gzip
    import re

    from glm5_jax.cost.hlo_cost.parsing import arrays_of, dense_bytes

    path = str(tmp_path / "decode.hlo.gz")
    r = compile_report.compile_point(TINY, "v5p:2x2x1", "context:2,tensor:2", 1, CONTEXT, "int4", STEPS,
                                     cache_read="pallas", hlo_path=path)
    assert r["fits"] and r["mesh"] == {"context": 2, "tensor": 2} and not r["uncounted_custom_calls"]
    text = gzip.open(path, "rt").read()
    gathered = [dense_bytes(arrays_of(m.group(1))) for m in re.finditer(r"= (\S+) all-gather(?:-start)?\(", text)]
    one_layer_keys = CONTEXT // 2 * TINY.index_head_dim * 2            # 128 slots x 32 bf16 values
    assert gathered and max(gathered) < one_layer_keys
    assert "stacked_row_gather" in text


def test_serve_step_compiles_with_the_decode_kernels(tmp_path):
    """program="serve_step": the server's one-token step (per-row sampling, top log-probs) compiles for v5p with the
    decode kernels, its weights as the step takes them (stacked experts and kv_b_proj); costed per call."""
    import gzip

    path = str(tmp_path / "serve.hlo.gz")
    r = compile_report.compile_point(TINY, "v5p:2x2x1", "expert:2,tensor:2", BATCH, CONTEXT, "int4", STEPS,
                                     cache_read="pallas", attention="pallas", program="serve_step", hlo_path=path)
    assert r["program"] == "serve_step" and r["steps"] == 1 and r["fits"] and not r["uncounted_custom_calls"]
    assert r["tokens_per_second_per_chip"] == pytest.approx(BATCH / 4 / r["estimated_step_seconds"])
    text = gzip.open(path, "rt").read()
    assert "sparse_mla_decode" in text and "int4_decode_moe" in text and "router_topk" in text
    assert " sort(" in text                                      # the rows' top-k / top-p over the vocabulary
    with pytest.raises(ValueError, match="program='steps': choose one of"):
        compile_report.compile_point(TINY, "v5p:2x2x1", "expert:2,tensor:2", BATCH, CONTEXT, "int4", STEPS,
                                     program="steps")
