"""HF hub checkpoint directory -> our orbax checkpoint, streamed leaf by leaf.

Each leaf of ``variables`` (stacked over scanned layers, routed experts stacked) is built with
`jax.make_array_from_callback`: every device's callback reads only the hub rows of its shard with
positional file reads (nothing stays mapped, so RSS does not grow with bytes read; FP8 blocks are
dequantised on the fly), and the leaf is handed to orbax (written in the background in ~64 MiB
batches) while a reader thread builds the next one (one leaf ahead). Everything is validated before
the output directory is created. The source's tokenizer files are copied beside the step.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from glm5_jax.checkpoint.errors import CheckpointError
from glm5_jax.checkpoint.stored_config import config_to_json
from glm5_jax.convert import int4_layout
from glm5_jax.convert.atomic_dir import atomic_output_dir, check_output_dir
from glm5_jax.convert.hub_reader import FP8_DTYPE, HubReader, read_leaf_slice, scale_key
from glm5_jax.convert.mesh import leaf_sharding, parse_mesh
from glm5_jax.convert.orbax_io import STEP, LeafWriter
from glm5_jax.convert.plan import LeafPlan, build_plan
from glm5_jax.convert.progress import Progress, frozen_gc
from glm5_jax.convert.tokenizer_files import copy_tokenizer_files
from glm5_jax.hf.config import config_from_hf, read_config_json
from glm5_jax.hf.flash_checkpoint import open_text_only
from glm5_jax.hf.layout import empty_shared_experts, mtp_copies
from glm5_jax.hf.safetensors_io import SafetensorsCheckpoint
from glm5_jax.model.config import ConfigError, ModelConfig


def read_hf_config(hf_dir: str) -> dict:
    try:
        return read_config_json(hf_dir)
    except ConfigError as e:
        raise CheckpointError(f"{hf_dir}: {e}") from None


def hub_model_config(hf: dict, hf_dir: str, dtype: str) -> ModelConfig:
    try:
        return config_from_hf(hf, dtype=dtype, param_dtype=dtype)
    except (ConfigError, ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{hf_dir}/config.json: invalid model config: {e}") from None


def build_leaf(reader: HubReader, leaf: LeafPlan, dtype, mesh) -> jax.Array:
    """One leaf as a (sharded) jax.Array; each device's callback reads only its slice."""
    sharding = leaf_sharding(mesh, leaf.shape, leaf.logical_axes)
    return jax.make_array_from_callback(leaf.shape, sharding, lambda index: read_leaf_slice(reader, leaf, index, dtype))


def prefetched(items, build, name: str = "convert-prefetch"):
    """``(item, build(item))`` for each item in order, with ``build`` of the next item running in one
    background thread while the caller uses the current result: reading (positional reads) and the
    numpy copies release the GIL, so on a machine with a spare core reading leaf i+1 overlaps handing
    leaf i to orbax. At most one result waits besides the caller's; errors surface in order. Close the
    generator (`contextlib.closing`) so an error in the caller also joins the thread."""
    items = list(items)
    with ThreadPoolExecutor(1, thread_name_prefix=name) as pool:
        pending = pool.submit(build, items[0]) if items else None
        for i, item in enumerate(items):
            result = pending.result()
            pending = pool.submit(build, items[i + 1]) if i + 1 < len(items) else None
            yield item, result
            del result


def open_hub(hf_dir: str, dtype: str):
    """(config.json dict, ModelConfig, HubReader, leaf plan) of a hub checkpoint directory; a checkpoint
    without MTP weights (HF save_pretrained drops them) plans no MTP module."""
    hf = read_hf_config(hf_dir)
    cfg = hub_model_config(hf, hf_dir, dtype)
    # GLM-5.3-Flash: the language model under text-only keys (vision tower and MTP layer skipped, and logged)
    ckpt = open_text_only(SafetensorsCheckpoint(hf_dir), cfg, hf.get("model_type"))
    qc = hf.get("quantization_config") or {}
    if qc.get("quant_method") == "compressed-tensors":      # INT4 experts: read as their dequantised values
        group = int4_layout.check_config(qc)
        ckpt = int4_layout.DecompressedView(ckpt)
        cfg = cfg.replace(quant="int4_qat", quant_group_size=group,
                          quant_scale_dtype=_scale_dtype_name(ckpt.ckpt, ckpt.packed))
    mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
    if cfg.num_nextn_predict_layers and not any(k.startswith(mtp_prefix) for k in ckpt.keys()):
        cfg = cfg.replace(num_nextn_predict_layers=0, mtp_depth=0)
    block = tuple((hf.get("quantization_config") or {}).get("weight_block_size", (128, 128)))
    return hf, cfg, HubReader(ckpt, block, empty_shared_experts(cfg), mtp_copies(cfg)), build_plan(cfg)


def hf_to_orbax(hf_dir: str, out_dir: str, dtype: str = "bfloat16", mesh: str | None = None,
                overwrite: bool = False, stream=None) -> dict:
    """Convert; returns the summary (tensors, bytes read, seconds, bytes/s, peak RSS)."""
    check_output_dir(out_dir, overwrite)
    hf, cfg, reader, plan = open_hub(hf_dir, dtype)
    ckpt = reader.ckpt
    reader.check(plan)
    device_mesh = parse_mesh(mesh)

    def hub_bytes(key):
        keys = (key, scale_key(key)) if reader.is_fp8(key) else (key,)
        return sum(int(np.prod(ckpt.shape(k))) * reader.dtype(k).itemsize for k in keys)

    hf_dtypes = {}
    for leaf in plan:
        dtypes = {reader.dtype(k) for k in leaf.hub_keys()}
        if len(dtypes) == 1 and FP8_DTYPE not in dtypes:
            hf_dtypes[leaf.name] = dtypes.pop().name
    leaf_bytes = {leaf.name: sum(hub_bytes(k) for k in leaf.hub_keys()) for leaf in plan}
    progress = Progress("hf-to-orbax", sum(leaf_bytes.values()), stream)

    def leaf_dtype(leaf):
        return np.dtype(np.float32) if leaf.keep_fp32 else np.dtype(cfg.jnp_param_dtype)

    # orbax's partial save (LeafWriter) cannot finalise on object storage: a gs:// output is staged locally,
    # then published with the commit markers orbax requires there (step and item), step marker last
    with atomic_output_dir(out_dir, overwrite, commit_file=f"{STEP}/commit_success.txt", stage_locally=True,
                           extra_commit_files=(f"{STEP}/state/commit_success.txt",)) as tmp, frozen_gc():
        writer = LeafWriter(tmp, {"hf_config": hf, "model_config": config_to_json(cfg), "hf_dtypes": hf_dtypes})
        with contextlib.closing(prefetched(plan, lambda leaf: build_leaf(reader, leaf, leaf_dtype(leaf),
                                                                         device_mesh))) as leaves:
            for leaf, array in leaves:
                writer.add(leaf.collection, leaf.path, array)
                del array
                progress.advance(leaf_bytes[leaf.name], len(leaf.hub_keys()))
        writer.finalize()
        copy_tokenizer_files(hf_dir, tmp)                 # beside the steps: generate and serve find it there
    return progress.summary()


def _scale_dtype_name(ckpt, packed_weights) -> str:
    """The (single) dtype of the INT4 scales, as a ModelConfig.quant_scale_dtype name."""
    names = {ckpt.dtype(int4_layout.sibling(w, "weight_scale")).name for w in packed_weights}
    if len(names) != 1 or not names <= set(int4_layout.SCALE_NUMPY):
        raise CheckpointError(f"INT4 weight_scale dtypes {sorted(names)}: expected one of "
                              f"{sorted(int4_layout.SCALE_NUMPY)}")
    return names.pop()
