"""The weights-only policy handoff (docs/rl.md#weights-only-policy-handoff): what one version weighs at 744B,
and how fast one is written and restored here.

    python bench/handoff.py --out=bench/results/handoff.json

1. Bytes per version of configs/glm5_744b.py, from the parameter shapes only (`jax.eval_shape`, nothing
   allocated): the learner's old version (fp32 variables + Adam's two fp32 moments), bf16 weights, and bf16
   with the routed experts INT4-packed. Per host (4 chips a host): what a host holds of a version on the
   2048-chip learner mesh (the 744B training mesh) and on the sampling mesh `--sampler_mesh` (SAMPLING_RULES)
   — what a generator host reads per version — and the learner's write per host if spread evenly
   (version bytes / hosts; orbax writes each unique shard once).
2. Measured on this machine's CPU devices for a small MoE model: `PolicyWriter.publish` + `wait` from a
   fsdp 2 x expert 2 mesh on 4 devices, and `PolicyReader.restore_variables` onto an expert-2 sampling mesh
   on 2 other devices, in MB/s of bytes on disk (median of --repeats).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")   # 4 learner + 2 sampler devices

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flax.core import meta  # noqa: E402

from glm5_jax.checkpoint.handoff import (PolicyReader, PolicyWriter, sampler_abstract_variables,  # noqa: E402
                                         sampler_variables)
from glm5_jax.model.transformer import Transformer  # noqa: E402
from glm5_jax.parallel.mesh import DEFAULT_RULES, MESH_AXES, MeshConfig, build_mesh, logical_shardings  # noqa: E402
from glm5_jax.parallel.sampling import SAMPLING_RULES, parse_mesh_spec  # noqa: E402
from glm5_jax.rl.policy import Policy, rl_model_config  # noqa: E402

CHIPS_PER_HOST = 4
GB = 1e9


def boxed_abstract(cfg):
    """The boxed abstract variables {"params", "moe_bias"} of `cfg` (shapes, dtypes, logical axes)."""
    model = Transformer(cfg)
    boxed = jax.eval_shape(lambda r: model.init(r, jnp.zeros((1, 8), jnp.int32)), jax.ShapeDtypeStruct((2,), jnp.uint32))
    return {k: boxed[k] for k in ("params", "moe_bias") if k in boxed}


def chip_bytes(boxed, mesh_cfg, rules, dtype):
    """(version bytes, bytes one chip holds) of the sampler form of `boxed` in `dtype`, on an abstract mesh."""
    sizes = {a: getattr(mesh_cfg, a) for a in MESH_AXES}
    assert min(sizes.values()) >= 1, f"name every axis size: {sizes}"
    mesh = jax.sharding.AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)
    shardings = meta.unbox(logical_shardings(boxed, mesh, rules))
    abstract = sampler_abstract_variables(meta.unbox(boxed), dtype) if dtype is not None else meta.unbox(boxed)
    total = per_chip = 0
    for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        total += int(np.prod(a.shape)) * a.dtype.itemsize
        per_chip += int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
    return total, per_chip, int(np.prod(list(sizes.values())))


def sizes_744b(sampler_mesh: str):
    sys.path.insert(0, "configs")
    import glm5_744b

    exp = glm5_744b.get_config()
    cfg = rl_model_config(glm5_744b.model_config())     # the model without the training step's runtime
    learner_mesh, sampler = exp.mesh, parse_mesh_spec(sampler_mesh)
    # copies written per version: the old version held the fp32 variables and Adam's mu and nu (its generators
    # read the variables only); a sampler form is written and read once
    forms = {"old: fp32 variables + Adam mu, nu": (cfg, None, 3),
             "bf16 weights": (cfg, jnp.bfloat16, 1),
             "bf16, routed experts INT4": (cfg.replace(quant="int4"), jnp.bfloat16, 1)}
    rows = []
    for name, (model_cfg, dtype, copies) in forms.items():
        boxed = boxed_abstract(model_cfg)
        total, learner_chip, learner_chips = chip_bytes(boxed, learner_mesh, learner_mesh.rules, dtype)
        _, sampler_chip, sampler_chips = chip_bytes(boxed, sampler, SAMPLING_RULES, dtype)
        rows.append({"form": name, "version_GB": copies * total / GB,
                     "learner_host_holds_GB": copies * learner_chip * CHIPS_PER_HOST / GB,
                     "learner_host_writes_GB": copies * total / (learner_chips // CHIPS_PER_HOST) / GB,
                     "sampler_host_reads_GB": sampler_chip * CHIPS_PER_HOST / GB,
                     "learner_chips": learner_chips, "sampler_chips": sampler_chips})
    return rows


def measured(repeats: int, workdir: str):
    """Write / restore MB/s of a small MoE model's version, fp32 / bf16 / bf16 + INT4 experts."""
    from glm5_jax.model.config import ModelConfig

    cfg = rl_model_config(ModelConfig(
        vocab_size=4096, hidden_size=512, num_hidden_layers=4, first_k_dense_replace=1, intermediate_size=1024,
        num_attention_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, index_n_heads=2, index_head_dim=32, index_topk=64, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=512, num_nextn_predict_layers=0,
        mtp_depth=0, max_position_embeddings=256, quant_group_size=32))
    devices = jax.devices()
    learner = Policy(cfg, build_mesh(MeshConfig(fsdp=2, expert=2), devices[:4]), DEFAULT_RULES)
    leaves, tree = jax.tree.flatten(learner.abstract_variables)
    keys = jax.random.split(jax.random.PRNGKey(0), len(leaves))
    variables = jax.device_put(jax.tree.unflatten(tree, [0.02 * jax.random.normal(k, a.shape, a.dtype)
                                                         for k, a in zip(keys, leaves)]), learner.shardings)
    sampler_mesh = build_mesh(MeshConfig(fsdp=1, expert=2), devices[4:6])
    rows = []
    for name, dtype, int4 in (("fp32", jnp.float32, False), ("bf16", jnp.bfloat16, False),
                              ("bf16 + INT4 experts", jnp.bfloat16, True)):
        weights = jax.block_until_ready(sampler_variables(variables, dtype, cfg if int4 else None))
        target = sampler_abstract_variables(
            Policy(cfg.replace(quant="int4") if int4 else cfg, sampler_mesh, SAMPLING_RULES).abstract_variables, dtype)
        writes, reads, nbytes = [], [], 0
        for r in range(repeats):
            root = tempfile.mkdtemp(dir=workdir)
            writer, t0 = PolicyWriter(root, max_to_keep=2), time.perf_counter()
            writer.publish(0, weights, {"version": 0})
            writer.wait()
            writes.append(time.perf_counter() - t0)
            writer.close()
            nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(root, "policy", "0"))
                         for f in fs)
            t0 = time.perf_counter()
            jax.block_until_ready(PolicyReader(root).restore_variables(0, target))
            reads.append(time.perf_counter() - t0)
            shutil.rmtree(root)
        rows.append({"form": name, "MB_on_disk": nbytes / 1e6, "write_s": statistics.median(writes),
                     "restore_s": statistics.median(reads), "write_MBps": nbytes / 1e6 / statistics.median(writes),
                     "restore_MBps": nbytes / 1e6 / statistics.median(reads)})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sampler_mesh", default="expert:32,tensor:4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default=tempfile.gettempdir())
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    result = {"sampler_mesh": args.sampler_mesh, "chips_per_host": CHIPS_PER_HOST,
              "glm5_744b": sizes_744b(args.sampler_mesh), "measured_cpu": measured(args.repeats, args.workdir)}
    print(f"744B, per version (GB); {CHIPS_PER_HOST} chips a host; sampling mesh {args.sampler_mesh}")
    print("| form | version | learner host holds | learner host writes (even) | sampler host reads |")
    print("|---|---:|---:|---:|---:|")
    for r in result["glm5_744b"]:
        print(f"| {r['form']} | {r['version_GB']:.1f} | {r['learner_host_holds_GB']:.2f} | "
              f"{r['learner_host_writes_GB']:.2f} | {r['sampler_host_reads_GB']:.2f} |")
    print("\nmeasured here (small MoE model, learner fsdp2 x expert2 on 4 CPU devices -> sampler expert2 on 2)")
    print("| form | MB on disk | write s | write MB/s | restore s | restore MB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in result["measured_cpu"]:
        print(f"| {r['form']} | {r['MB_on_disk']:.1f} | {r['write_s']:.2f} | {r['write_MBps']:.0f} | "
              f"{r['restore_s']:.2f} | {r['restore_MBps']:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
