"""AOT compile of the real train step for TPU from this CPU host (libtpu) through `train.py --compile_only`
on v5p:2x2x1 (4 chips), checked for a sane compile_report.json.

* `test_compile_only_small_glm5_on_v5p` (CI): the GLM-5 structure (MLA + DSA indexer, 1 dense + 2 MoE
  layers + MTP, a2a expert parallelism, full remat) at configs/tiny.py widths: 60-90 s on one core of the
  shared host, most of it libtpu's compile (fewer layers, no MTP or no remat do not make it faster).
* `test_compile_only_reduced_glm5_on_v5p` (slow): production widths (hidden 6144, 64 heads, MLA/DSA dims,
  154880 vocab, expert width 2048), 1 dense + 1 MoE layer + MTP: 5-8 minutes of libtpu compile on one core
  of the shared 2-core host (a single production-width layer alone takes over 100 s), so not in CI.
"""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from glm5_jax.train.compile_report import TOP_INSTRUCTIONS
from tests.train.test_train_cli import ROOT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not importable (pip install -r requirements-tpu.txt)")

MESH = ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=1", "mesh.context=1"]
SMALL = ["model.vocab_size=4096", "data.vocab_size=4096", "model.hidden_size=128", "model.intermediate_size=384",
         "model.num_attention_heads=4", "model.q_lora_rank=96", "model.kv_lora_rank=64", "model.qk_nope_head_dim=32",
         "model.qk_rope_head_dim=16", "model.v_head_dim=32", "model.index_n_heads=4", "model.index_head_dim=32",
         "model.index_topk=64", "model.n_routed_experts=8", "model.moe_intermediate_size=128",
         "model.eos_token_id=(1,)", "model.pad_token_id=0", "model.first_k_dense_replace=1",
         "model.num_hidden_layers=3", "data.batch_size=4", "data.seq_len=128",
         # expert groups back to back: the hand counts below are over the capacity buffer (aligned to 256-row
         # tiles, each of these 4 experts' 160 slots per chunk would take 256 rows); the config's chunks split
         # tokens, as the hand counts assume (expert chunks: tests/model/test_moe_ep.py)
         "model.moe_group_align=1", "model.moe_a2a_chunk_by=tokens"] + MESH
# production widths; 2 layers (1 dense + 1 MoE) + MTP, 8 experts, short sequences
REDUCED = ["model.first_k_dense_replace=1", "model.num_hidden_layers=2", "model.n_routed_experts=8",
           "model.index_topk=64", "data.batch_size=4", "data.seq_len=128"] + MESH


def compile_only(tmp_path, overrides, remat="full", config="glm5_744b.py"):
    """train.py --compile_only for v5p:2x2x1 (the hand counts below are for full remat; the config's own
    policy is "moe_saveable")."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    overrides = list(overrides) + [f"model.remat_policy={remat}"]
    args = [sys.executable, os.path.join(ROOT, "train.py"), f"--config={os.path.join(ROOT, 'configs', config)}",
            "--compile_only", "--topology=v5p:2x2x1", f"--workdir={tmp_path}"] + [f"--set={s}" for s in overrides]
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.load(open(tmp_path / "compile_report.json"))
    assert report["topology"] == "v5p:2x2x1" and report["num_devices"] == 4
    assert report["mesh"] == {"data": 1, "fsdp": 2, "context": 1, "expert": 2, "tensor": 1}
    assert report["moe_ep"] == "a2a" and report["remat_policy"] == remat
    assert report["hbm_bytes_per_device"] == int(95.74 * 2**30)
    return report


def state_param_count(overrides, config="glm5_744b.py"):
    """Parameters of the model the overrides describe (main stack + MTP), counted here from the config."""
    from glm5_jax.model.param_count import count_params
    from glm5_jax.train.experiment import apply_overrides, load_config_file

    cfg = apply_overrides(load_config_file(os.path.join(ROOT, "configs", config)), overrides).model
    counts = count_params(cfg)
    return counts["total"] + counts["mtp"]


def check_memory_and_flops(report, n_params, trained_share=1.0):
    mem = report["per_device_bytes"]
    # fp32 params + 2 Adam moments: each of the 4 chips holds at least a quarter, at most all of them
    state = 3 * 4 * n_params
    assert state / 4 < mem["argument"] < 1.05 * state
    assert mem["alias"] > 0.9 * mem["argument"]          # the state is donated: outputs reuse it
    assert mem["temp"] > 0
    assert mem["total"] == mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] + mem["generated_code"]
    assert report["fits"] == (mem["total"] <= int(95.74 * 2**30))
    assert report["flops_source"] == "hlo_matmuls_and_kernel_cost_estimates_x_loop_trip_counts"
    assert None not in report["hlo_loop_trip_counts"]   # every loop's trip count was read
    assert report["uncounted_custom_calls"] == []
    assert report["hlo_flops"] == report["flops"] + report["kernel_flops"]
    breakdown = report["breakdown"]
    assert math.isclose(sum(c["hlo_flops"] for c in breakdown.values()), report["hlo_flops"], rel_tol=1e-9)
    assert math.isclose(sum(c["bytes_accessed"] for c in breakdown.values()), report["bytes_accessed"], rel_tol=1e-9)
    # executed matmul FLOPs over all chips vs the analytic model FLOPs (glm5_jax/cost/flops.py): at least the
    # model (x 4/3 for the full-remat recompute of the layers), at most ~4x (MTP layer + head, capacity
    # padding of the expert buffers, recompute)
    assert 1.3 < report["flops_per_model_flop"] < 4.0, report["flops_per_model_flop"]
    assert math.isclose(report["flops_per_model_flop"],
                        report["hlo_flops"] * 4 / report["model_flops_per_step"], rel_tol=1e-9)
    assert report["bytes_accessed"] > mem["argument"]    # the step reads the whole state at least once
    peak, flops_rate = report["peak_flops_per_device"], report["achievable_flops_per_device"]
    bw = report["achievable_hbm_bytes_per_second"]
    comm = report["communication"]
    assert 0 < comm["exposed_seconds"] <= comm["seconds"] and comm["bytes_per_chip"] > 0
    # each op at its own roofline: no less than one roofline for the whole step, no more than both sums +
    # what the conservative rules add (a kernel on one of the two cores at most doubles its time, 0.35 us per
    # grid step, 1 us per top-level instruction)
    model = report["cost_model"]
    assert model == {"kernel_core_split": "busiest of 2 cores by the parallel grid axes", "grid_step_seconds": 0.35e-6,
                     "op_fixed_seconds": 1e-6, "kernel_bytes": "by grid", "collective_hbm_passes": True,
                     "all_to_all_link_model": "busiest_link", "ring_dims": "per_dimension", "sparsecore_rate": 3.0,
                     "expert_load": "busiest", "hbm_limit_gib": 95.74}
    compute, memory = report["hlo_flops"] / flops_rate, report["bytes_accessed"] / bw
    overhead = report["top_level_ops_per_step"] * 1e-6 + report["grid_steps_per_step"] * 0.35e-6
    # XLA's own ragged-dot lowering carries no Pallas grid: charged as declared
    assert report["top_level_ops_per_step"] > 0 and all("ragged-dot" in k for k in report["kernels_without_grid"])
    assert max(compute, memory) <= report["roofline_seconds"] * (1 + 1e-9) <= 2 * (compute + memory) + overhead
    assert math.isclose(sum(c["roofline_seconds"] for c in breakdown.values()), report["roofline_seconds"],
                        rel_tol=1e-9)
    assert math.isclose(report["estimated_step_seconds"], report["roofline_seconds"] + comm["exposed_seconds"])
    # the dearest instructions: dearest first, each no more than the roofline, together no more than it
    top = [t["seconds"] for t in report["top_instructions"]]
    assert 0 < len(top) <= TOP_INSTRUCTIONS and top == sorted(top, reverse=True)
    assert sum(top) <= report["roofline_seconds"] * (1 + 1e-9)
    assert all(t["executions"] >= 1 and t["bytes"] >= 0 for t in report["top_instructions"])
    # XLA's own cost analysis beside ours, both counting each loop body once
    assert report["loop_once"]["flops"] == pytest.approx(report["compiler_flops"], rel=0.1)
    # ZeRO: the AdamW moments (2 x fp32 per param) are split over fsdp (and more) axes
    opt = report["optimizer_state"]
    assert opt["optimizer_bytes_total"] >= trained_share * 2 * 4 * n_params and opt["sharded_over_fsdp"]
    assert opt["optimizer_bytes_per_chip"] <= 0.55 * opt["optimizer_bytes_total"]
    assert math.isclose(report["mfu"], report["model_flops_per_step"] / (4 * peak * report["estimated_step_seconds"]))
    assert 0 < report["mfu"] < 1
    assert report["compiler_flops"] > 0


def test_compile_only_small_glm5_on_v5p(tmp_path):
    # ragged_dot experts: the hand counts below include its masked-convolution weight gradients (the megablox
    # path that `moe_impl="auto"` takes on TPU is checked in tests/pallas_kernels/test_grouped_matmul.py)
    # libtpu's default flags (train.tpu_flags=none): the hand counts are of that program; the collective-
    # overlap flag set (the default) is checked in tests/train/test_tpu_flags.py
    report = compile_only(tmp_path, SMALL + ["model.moe_impl=ragged_dot", "train.tpu_flags=none"])
    assert report["num_hidden_layers"] == 3
    assert report["attention_impl"] == "xla" and report["moe_impl"] == "ragged_dot"
    check_memory_and_flops(report, state_param_count(SMALL))
    check_hand_counted_parts(report, tmp_path / "compiled_step.hlo.gz")
    check_top_ops_add_up(report, tmp_path / "compiled_step.hlo.gz")


def check_top_ops_add_up(report, hlo_path):
    """bench/hlo_top_ops.py files the same instructions under (category, op name): each category's rows
    add up to the report's total for that category, bytes and FLOPs."""
    import gzip

    from bench.hlo_top_ops import top_ops

    with gzip.open(hlo_path, "rt") as f:
        rows = top_ops(f.read(), list(report["breakdown"]), depth=3)
    assert {"routed_experts", "attention_core", "lm_head_loss"} <= set(rows)
    for cat, ops in rows.items():
        total = report["breakdown"][cat]
        assert math.isclose(sum(r[1] for r in ops), total["bytes_accessed"], rel_tol=1e-9), cat
        assert math.isclose(sum(r[2] for r in ops), total["hlo_flops"], rel_tol=1e-9, abs_tol=1.0), cat
    # the LM head's rows are its matmuls and the loss around them, named by their scopes
    assert any("head" in name or "lm_head" in name for name, _, _ in rows["lm_head_loss"])


def check_hand_counted_parts(report, hlo_path):
    """Categories and one collective of the SMALL step counted by hand. Per chip: 4 x 128 tokens over 4
    chips = 128 tokens, hidden D = 128, vocab V = 4096, 4 heads of v = 32, 8 experts top-8 (4 per chip:
    expert = 2) of width F = 128, capacity factor 1.25; segment_0 (1 dense layer) and segment_1 (2 MoE
    layers) are scanned under full remat, the MTP block is not. A length-1 scan's recompute is merged
    with its forward (remat with prevent_cse=False), so a matmul runs 3 times (forward, input gradient,
    weight gradient) in segment_0 and in the MTP, 4 times (+ recompute) in segment_1."""
    import gzip

    from glm5_jax.cost.hlo_cost import hlo_cost

    tokens, D, V, H, v, E, F, K = 128, 128, 4096, 4, 32, 4, 128, 8
    breakdown = report["breakdown"]
    # LM head: main + MTP, 3 matmuls each
    assert breakdown["lm_head_loss"]["hlo_flops"] == 2 * 3 * 2 * tokens * D * V
    assert breakdown["lm_head_loss"]["model_flops"] == 2 * 6 * tokens * D * V
    # routed experts, one grouped product u = 2 C D F over the capacity buffer of C = 128 x 8 x 1.25 rows:
    # 18 ragged-dot kernels in segment_1 (gate, up, down x forward, recompute, input gradient) + the
    # MTP's 3 input-gradient ragged dots (their metadata has no op_name path); the 9 weight gradients
    # (2 layers + MTP) are compiled as masked dense convolutions over all 4 local experts (4 u each);
    # the router [128, D] x [D, 8]: 2 layers x 4
    u, router = 2 * (tokens * K * 5 // 4) * D * F, 2 * tokens * D * 8
    assert breakdown["routed_experts"]["kernel_flops"] == 21 * u
    assert breakdown["routed_experts"]["hlo_flops"] == 21 * u + 9 * E * u + 8 * router
    # the same split by pass: segment_1's 6 products and 2 router matmuls recomputed, every weight gradient
    # (9 masked convolutions), the router's two gradients per layer in "input_grad". XLA's TPU lowering of
    # ragged_dot gives its input-gradient kernels op_names without the transpose, so on this path the 15
    # forward + input-gradient ragged dots all read as "forward" (the megablox kernels, the TPU default, carry
    # exact names: tests/cost/test_step_categories.py)
    passes = {p: c["hlo_flops"] for p, c in report["routed_expert_passes"].items()}
    assert passes == {"forward": 15 * u + 2 * router, "remat": 6 * u + 2 * router, "input_grad": 4 * router,
                      "weight_grad": 9 * E * u}
    # one projection, o_proj [H, v, D]: 3 (segment_0) + 2 x 4 (segment_1) + 3 (MTP) matmuls
    o_proj = ("bthv,hvd->btd", "hvbt,btd->hvd")
    with gzip.open(hlo_path, "rt") as f:
        text = f.read()
    mine = hlo_cost(text, categorize=lambda name: "o_proj" if any(s in name for s in o_proj) else
                    "q_a" if "btd,dq->btq" in name or "dbt,btq->dq" in name else "rest")
    assert mine.by_category["flops"]["o_proj"] == 14 * 2 * tokens * H * v * D
    # q_a_proj [D, 96] bf16 is FSDP-sharded on D: gathered once per forward, recompute and backward of
    # segment_1 (2 x 3), segment_0 (2) and the MTP (2)
    gathers = {op: n for op, n in mine.collectives.items() if op.category == "q_a" and op.kind == "all-gather"}
    assert sum(gathers.values()) == 10
    assert {op.nbytes for op in gathers} == {D * 96 * 2}
    assert {op.groups for op in gathers} == {((0, 2), (1, 3))}      # partition 2 f + e: the fsdp pairs


@pytest.mark.slow   # 5-8 minutes on one core: run with `pytest -m slow`
def test_compile_only_reduced_glm5_on_v5p(tmp_path):
    report = compile_only(tmp_path, REDUCED)
    assert report["num_hidden_layers"] == 2
    n_params = state_param_count(REDUCED)
    # the vocab tables alone: 2 x 154880 x 6144 fp32 params + 2 moments, sharded 4 ways at best
    assert n_params > 2 * 154880 * 6144
    check_memory_and_flops(report, n_params)
    # at production widths the matmuls are nearly all the work: loops here only ever run <= 2 trips, so
    # the loop-aware matmul count cannot be below ~what XLA counts with bodies once
    assert report["flops"] > 0.8 * report["compiler_flops"]


def test_compile_only_dense_stage_on_v5p_runs_the_flash_kernel(tmp_path):
    """The pretraining (dense) step of the GLM-5 structure compiled for v5p:2x2x1 under the config's remat policy
    (moe_saveable): its attention is the flash kernel (Mosaic custom calls in the attention core, counted by their declared cost), no indexer
    runs and the model FLOPs count none, and the report's accounting holds as for the sparse step."""
    import gzip

    report = compile_only(tmp_path, SMALL + ["train.stage=dense", "model.attention_impl=pallas",
                                             "train.tpu_flags=none"], remat="moe_saveable")
    # the dense stage does not train the indexer (a few % of the parameters): no moments for it
    check_memory_and_flops(report, state_param_count(SMALL), trained_share=0.95)
    core = report["breakdown"]["attention_core"]
    assert core["kernel_flops"] > 0 and core["kernel_flops"] == core["hlo_flops"]   # all in the kernels
    # at least the model's 3 x the causal forward (at these widths far more: the kernel pads head dims of
    # 48 / 32 to 128 and a 128-token sequence is one diagonal block; at 744B widths it is 1.69x)
    assert core["hlo_per_model_flop"] >= 1.0
    for cat in ("indexer_topk", "indexer_kl"):
        assert report["breakdown"][cat]["model_flops"] == 0 and report["breakdown"][cat]["hlo_flops"] == 0
    with gzip.open(tmp_path / "compiled_step.hlo.gz", "rt") as f:
        text = f.read()
    assert "flash_attention_fwd" in text and "flash_attention_bwd" in text


# configs/tiny_flash.py cut to one (KDA, KDA, KDA, MLA) group, 128-token rows, one row per chip
TINY_FLASH = ["model.num_hidden_layers=4", "model.layer_types=('kda','kda','kda','mla')", "data.batch_size=4",
              "data.seq_len=128", "model.kda_impl=pallas", "model.moe_ep=a2a", "train.tpu_flags=none"] + MESH


def test_compile_only_tiny_flash_runs_the_kda_kernels_per_shard(tmp_path):
    """GLM-5.3-Flash's step (configs/tiny_flash.py structure) with kda_impl="pallas" compiled for v5p:2x2x1:
    the KDA kernels run per (batch, head) shard under shard_map (each call sees one row of the 4: batch split
    over fsdp x expert), their declared FLOPs are filed under the attention core, and the report adds up."""
    import gzip

    report = compile_only(tmp_path, TINY_FLASH, config="tiny_flash.py")
    assert report["num_hidden_layers"] == 4
    check_memory_and_flops(report, state_param_count(TINY_FLASH, "tiny_flash.py"), trained_share=0.95)
    with gzip.open(tmp_path / "compiled_step.hlo.gz", "rt") as f:
        text = f.read()
    assert "kda_fwd" in text and "kda_bwd" in text
    # one kernel call over a shard: B = 1 row, H = 4 heads, T = 128 tokens (2 chunks of C = 64), K = V = 32
    # padded to 128 lanes; the forward declares one pass of FLOPs (pallas_kernels/kda/kernel.py `_cost`), the
    # backward three. 3 KDA layers, each: forward, remat forward, backward = 1 + 1 + 3 passes.
    B, H, T, C, K, V = 1, 4, 128, 64, 128, 128
    unit = B * H * T * (4 * C * K + 2 * C * C + 2 * C * (K + V) + 6 * K * V)
    core = report["breakdown"]["attention_core"]
    assert core["kernel_flops"] == 3 * (1 + 1 + 3) * unit, core["kernel_flops"] / unit
