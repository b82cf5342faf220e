"""Our orbax checkpoint -> HF hub directory (config.json, sharded safetensors, index json, the tokenizer files),
streamed.

Reads every checkpoint this project writes (`glm5_jax.checkpoint.inference.find_checkpoint`): a converter
output, a train.py workdir or its checkpoints/ (latest step or ``step``), an RL workdir or its policy/.
Only the ``params`` and ``moe_bias`` leaves are read; a training run's optimizer state stays on disk.

Leaves are restored in batches of about 64 MiB (a larger leaf alone), the next batch in a background
thread while the current one is written; each layer / expert slice is turned back into a hub
``[out, in]`` tensor, cast (or block-quantised to FP8 with ``--fp8``) and written straight into its
shard, whose header was fixed up front from the full tensor list. Each shard is fsynced once when
it is complete, before the directory is renamed into place.
"""
from __future__ import annotations

import contextlib
import json
import logging
import re

import ml_dtypes
import numpy as np

from glm5_jax import storage
from glm5_jax.checkpoint.errors import CheckpointError
from glm5_jax.checkpoint.inference import COLLECTIONS, find_checkpoint
from glm5_jax.convert import fp8 as fp8_layout, int4_layout, orbax_io
from glm5_jax.convert.atomic_dir import atomic_output_dir, check_output_dir
from glm5_jax.convert.hf_to_orbax import prefetched
from glm5_jax.convert.hub_reader import scale_key, transpose_copy
from glm5_jax.convert.plan import LeafPlan, build_plan
from glm5_jax.convert.progress import Progress, frozen_gc
from glm5_jax.convert.safetensors_writer import ShardedSafetensorsWriter, ShardLayout
from glm5_jax.convert.tokenizer_files import write_export_tokenizer
from glm5_jax.hf.config import config_from_hf, config_to_hf
from glm5_jax.hf.flash_checkpoint import export_key_fn
from glm5_jax.hf.layout import DEEPSEEK_MODEL_TYPES, empty_shared_experts, mtp_copies
from glm5_jax.hf.safetensors_io import DTYPES
from glm5_jax.model.config import ModelConfig

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """"5GB" -> 5e9 bytes; also KB/MB/TB, KiB/MiB/GiB and plain byte counts."""
    m = _SIZE.match(str(text))
    if not m:
        raise CheckpointError(f"--shard_size={text!r}: expected a size like 5GB, 500MB or 1GiB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])


TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


log = logging.getLogger("glm5_jax.convert")


def load_model_config(ckpt_dir: str, step: int | None = None) -> ModelConfig:
    """The ModelConfig of any checkpoint `orbax_to_hf` reads."""
    return find_checkpoint(ckpt_dir, step).cfg


def export_hf_config(cfg: ModelConfig, source_hf: dict | None, dtype_name: str, fp8: bool) -> dict:
    """`config_to_hf`; a model it cannot express (DeepSeek-V3.2's half-split indexer RoPE) keeps
    its source config.json, which must describe the same architecture."""
    try:
        hf = config_to_hf(cfg)
    except ValueError as e:
        if source_hf is None:
            raise CheckpointError(f"cannot write config.json: {e}") from None
        hf = {k: v for k, v in source_hf.items() if k != "quantization_config"}
        same = config_from_hf(hf, dtype=cfg.runtime.dtype, param_dtype=cfg.runtime.param_dtype)
        if cfg.num_nextn_predict_layers == 0:
            hf["num_nextn_predict_layers"] = 0
            same = same.replace(num_nextn_predict_layers=0, mtp_depth=0)
        if same != cfg:
            raise CheckpointError(f"cannot write config.json: {e}; the stored source config does not match") from None
    if source_hf:   # from_hf maps a null token id to ModelConfig's GLM-5 default; keep the source's ids
        hf.update({k: source_hf[k] for k in TOKEN_ID_KEYS if k in source_hf})
    hf["dtype"] = dtype_name
    hf.pop("torch_dtype", None)
    if fp8:
        hf["quantization_config"] = fp8_layout.quantization_config(cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
    return hf


def _out_dtype(leaf: LeafPlan, stored: np.dtype, hf_dtypes: dict, dtype: str | None) -> np.dtype:
    if dtype and not leaf.keep_fp32:
        return np.dtype(dtype)
    if leaf.name in hf_dtypes:
        return DTYPES[{v.name: k for k, v in DTYPES.items()}[hf_dtypes[leaf.name]]]
    return stored


def _hub_tensors(leaf: LeafPlan, array: np.ndarray):
    """(hub key, hub [out, in] tensor) for every hub tensor of the leaf, in `leaf.hub_keys()` order.
    The whole leaf is transposed to hub order once; each tensor is then a contiguous view."""
    perm = tuple(int(a) for a in np.argsort(leaf.hub_to_ours_perm))
    array = np.ascontiguousarray(array)
    hub = array if perm == tuple(range(array.ndim)) else transpose_copy(array, perm)
    elements = list(hub) if leaf.stacked else [hub]
    for src, element in zip(leaf.sources, elements):
        if src.experts:
            for e, key in enumerate(src.keys()):
                yield key, element[e].reshape(leaf.hub_shape)
        else:
            yield src.key, element.reshape(leaf.hub_shape)


RESTORE_BATCH_BYTES = 64 * 2**20


def _restored_leaves(item_dir: str, plan: list[LeafPlan], stored: dict):
    """(leaf, host array) in plan order. Leaves are restored in batches of about `RESTORE_BATCH_BYTES`
    (a larger leaf alone); batch i+1 is read by a background thread while the caller writes batch i,
    so at most two batches (plus the caller's copies) are alive. Errors surface in plan order."""
    batches, batch, size = [], [], 0
    for leaf in plan:
        shape, dtype = stored[(leaf.collection,) + leaf.path]
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if batch and size + nbytes > RESTORE_BATCH_BYTES:
            batches.append(batch)
            batch, size = [], 0
        batch.append(leaf)
        size += nbytes
    if batch:
        batches.append(batch)

    def restore(batch):
        return orbax_io.restore_leaves(item_dir, [((leaf.collection,) + leaf.path, leaf.shape,
                                                   stored[(leaf.collection,) + leaf.path][1]) for leaf in batch])

    with contextlib.closing(prefetched(batches, restore, "orbax-to-hf-restore")) as restored:
        for batch, arrays in restored:
            yield from zip(batch, arrays)
            del arrays


def orbax_to_hf(ckpt_dir: str, out_dir: str, shard_size: str | int = "5GB", fp8: bool = False,
                dtype: str | None = None, overwrite: bool = False, stream=None, int4: bool = False,
                int4_group_size: int | None = None, step: int | None = None, tokenizer: str | None = None) -> dict:
    """Export; returns the summary (tensors, bytes written, seconds, bytes/s, peak RSS).

    ``step``: the training step / policy version to export (default: the newest committed one).
    ``int4``: routed experts in the compressed-tensors pack-quantized INT4 layout (glm5_jax/convert/
    int4_layout.py), quantised with the checkpoint's ``quant_scale_dtype`` and ``quant_group_size`` (or
    ``int4_group_size``); a run trained with ``quant="int4_qat"`` is exported with the rounding it trained
    against. ``tokenizer``: the tokenizer.json (or a directory of HF tokenizer files) the export carries
    (default: the checkpoint's own, as `glm5_jax.convert.tokenizer_files` finds it)."""
    if fp8 and int4:
        raise CheckpointError("--fp8 and --int4 write different quantization_configs; choose one")
    check_output_dir(out_dir, overwrite)
    max_shard = parse_size(shard_size) if isinstance(shard_size, str) else int(shard_size)
    found = find_checkpoint(ckpt_dir, step)
    cfg, metadata = found.cfg, found.custom_metadata
    group = int4_group_size or cfg.quant_group_size
    if cfg.quant == "int4_qat" and group != cfg.quant_group_size:
        raise CheckpointError(f"{ckpt_dir}: trained with INT4 QAT at quant_group_size={cfg.quant_group_size}; "
                              f"--int4_group_size={group} would serve other weights than it trained against")
    if cfg.quant == "int4_qat" and not int4:
        log.warning("%s was trained with INT4 QAT; this export holds its full-precision master weights "
                    "(--int4 writes the INT4 weights it trained against)", ckpt_dir)
    hf_dtypes = metadata.get("hf_dtypes") or {}
    stored = orbax_io.leaf_metadata(found.item_dir, COLLECTIONS)
    plan = build_plan(cfg)
    for leaf in plan:
        key = (leaf.collection,) + leaf.path
        if key not in stored:
            raise CheckpointError(f"{found.item_dir}: leaf {leaf.name} of the model is missing from the checkpoint")
        if stored[key][0] != leaf.shape:
            raise CheckpointError(f"{found.item_dir}: leaf {leaf.name} has shape {list(stored[key][0])}, "
                                  f"model_config implies {list(leaf.shape)}")
    extra = sorted(set(stored) - {(lp.collection,) + lp.path for lp in plan})
    if extra:
        raise CheckpointError(f"{found.item_dir}: unexpected leaves {['/'.join(e) for e in extra[:5]]}")

    out_dtypes = {leaf.name: _out_dtype(leaf, stored[(leaf.collection,) + leaf.path][1], hf_dtypes, dtype)
                  for leaf in plan}
    head_dtype = out_dtypes["params/lm_head"]
    hf = export_hf_config(cfg, metadata.get("hf_config"), "float32" if head_dtype == np.float32 else head_dtype.name,
                          fp8)
    if int4:
        hf["quantization_config"] = int4_layout.quantization_config(group)
    # main key -> the MTP layer's copy, which DeepSeek-V3.x checkpoints carry (written right after the main one)
    rename = export_key_fn(hf)   # GLM-5.3-Flash: model.language_model.* under a nested config.json
    copies = {main: copy for copy, main in mtp_copies(cfg)} if hf["model_type"] in DEEPSEEK_MODEL_TYPES else {}
    empty = [(rename(key), shape) for key, shape in empty_shared_experts(cfg)]   # as transformers saves
    # n_shared_experts=0 (written last)

    tensors = []
    for leaf in plan:
        for key in map(rename, leaf.hub_keys()):
            if int4 and int4_layout.is_packed(key):
                tensors += int4_layout.tensor_specs(key, leaf.hub_shape, group, cfg.quant_scale_dtype)
            elif fp8 and fp8_layout.is_quantised(key):
                tensors.append((key, np.dtype(ml_dtypes.float8_e4m3fn), leaf.hub_shape))
                tensors.append((scale_key(key), np.dtype(np.float32), fp8_layout.scale_shape(leaf.hub_shape)))
            else:
                tensors.append((key, out_dtypes[leaf.name], leaf.hub_shape))
                if key in copies:
                    tensors.append((copies[key], out_dtypes[leaf.name], leaf.hub_shape))
    tensors += [(key, head_dtype, shape) for key, shape in empty]
    layout = ShardLayout(tensors, max_shard)

    progress = Progress("orbax-to-hf", layout.total_size, stream)
    with atomic_output_dir(out_dir, overwrite) as tmp, frozen_gc():
        storage.write_atomically(storage.join(tmp, "config.json"), json.dumps(hf, indent=2).encode())
        write_export_tokenizer(ckpt_dir, tmp, hf, tokenizer)
        writer = ShardedSafetensorsWriter(tmp, layout)
        with contextlib.closing(_restored_leaves(found.item_dir, plan, stored)) as leaves:
            for leaf, array in leaves:
                for key, w in _hub_tensors(leaf, array):
                    key = rename(key)
                    if int4 and int4_layout.is_packed(key):
                        parts = int4_layout.compress(w, group, cfg.quant_scale_dtype)
                        for (part_key, _, _), part in zip(int4_layout.tensor_specs(key, w.shape, 1, "float32"), parts):
                            writer.write(part_key, part)
                            progress.advance(part.nbytes)
                    elif fp8 and fp8_layout.is_quantised(key):
                        w8, scale = fp8_layout.quantise_blocks(np.asarray(w, np.float32))
                        writer.write(key, w8)
                        writer.write(scale_key(key), scale)
                        progress.advance(w8.nbytes + scale.nbytes)
                    else:
                        w = np.asarray(w, out_dtypes[leaf.name])
                        for name in (key, copies[key]) if key in copies else (key,):
                            writer.write(name, w)
                            progress.advance(w.nbytes)
                del array
        for key, shape in empty:
            writer.write(key, np.zeros(shape, head_dtype))
        writer.close()
    return progress.summary()
