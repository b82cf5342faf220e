"""`load_hf`: an HF GLM-5-family checkpoint directory -> (ModelConfig, variables) for `Transformer`.

Reads ``config.json`` and the safetensors (single file or sharded) in the hub layout of
docs/architecture.md#checkpoint-layout-hf-keys
through the `hf.layout` table, layer by layer, stacking each scanned segment's layers. Every tensor is
checked against the shapes the model expects; missing or unexpected tensors are errors naming them.
(The streaming, mesh-sharded, two-way converter is `glm5_jax.convert`.)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta

from glm5_jax.checkpoint.errors import CheckpointError
from glm5_jax.hf.config import config_from_hf, read_config_json
from glm5_jax.hf.flash_checkpoint import open_text_only
from glm5_jax.hf.layout import (GLOBAL_TENSORS, empty_shared_experts, heads_for, layer_slots, layer_tensor_maps,
                                mtp_copies, mtp_extra_tensors, to_hf, to_ours)
from glm5_jax.hf.safetensors_io import SafetensorsCheckpoint
from glm5_jax.model.moe.layer import BIAS_COLLECTION
from glm5_jax.model.param_count import abstract_variables

# kept fp32 whatever the dtype (docs/architecture.md#routing-bias-is-a-buffer-fp32)
FP32_LEAVES = {("moe", "router"), ("moe", "e_score_correction_bias"),
               # GLM-5.3-Flash (transformers' _keep_in_fp32_modules_strict): KDA conv taps and gates, mHC mixers
               ("attention", "q_conv"), ("attention", "k_conv"), ("attention", "v_conv"), ("attention", "dt_bias"),
               ("attention", "A_log"), ("attn_hc", "base"), ("attn_hc", "scale"), ("ffn_hc", "base"),
               ("ffn_hc", "scale")}


def _block_size(hf_dir):
    quant = read_config_json(hf_dir).get("quantization_config") or {}
    return tuple(quant.get("weight_block_size", (128, 128)))


def _has_mtp_weights(ckpt, cfg) -> bool:
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    return any(k.startswith(prefix) for k in ckpt.keys())


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _read_checked(ckpt, key, want_hf_shape, block_size):
    """The tensor `key`, after checking its shape against what config.json implies."""
    if tuple(ckpt.shape(key)) != tuple(want_hf_shape):
        raise CheckpointError(f"{key}: shape {list(ckpt.shape(key))} in the checkpoint, "
                              f"config.json implies {list(want_hf_shape)}")
    return np.asarray(ckpt.get(key, block_size))


def read_tensor(ckpt, cfg, key, tmap_layout, heads, want_ours_shape, block_size, n_experts=0):
    """One tensor (or the per-expert keys of one stacked tensor) in our layout, shape-checked."""
    if tmap_layout != "experts":
        want_hf = to_hf(np.empty(want_ours_shape, np.int8), tmap_layout).shape
        return to_ours(_read_checked(ckpt, key, want_hf, block_size), tmap_layout, heads)
    want_hf = tuple(reversed(want_ours_shape[1:]))
    return np.stack([_read_checked(ckpt, key.format(e=e), want_hf, block_size).T for e in range(n_experts)])


def _set(tree, path, value):
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def read_variables(ckpt, cfg, block_size=(128, 128)) -> tuple[dict, set]:
    """All variables as numpy (our layout, stacked per segment) and the set of keys consumed."""
    expected = meta.unbox(abstract_variables(cfg))
    variables: dict = {"params": {}, BIAS_COLLECTION: {}}
    stacks: dict = {}
    consumed = set()
    for path, key, layout in GLOBAL_TENSORS + (mtp_extra_tensors(cfg) if cfg.num_nextn_predict_layers else ()):
        want = _get(expected["params"], path).shape
        _set(variables["params"], path, read_tensor(ckpt, cfg, key, layout, None, want, block_size))
        consumed.add(key)
    for slot in layer_slots(cfg):
        for tmap in layer_tensor_maps(cfg, slot.kind):
            path = (tmap.collection,) + slot.prefix + tmap.ours
            want = _get(expected, path).shape
            if slot.stack_index is not None:
                want = want[1:]
            key = f"model.layers.{slot.hf_layer}.{tmap.hf}"
            value = read_tensor(ckpt, cfg, key, tmap.layout, heads_for(tmap, cfg), want, block_size,
                                cfg.n_routed_experts)
            consumed |= ({key.format(e=e) for e in range(cfg.n_routed_experts)} if tmap.layout == "experts"
                         else {key})
            if slot.stack_index is None:
                _set(variables[tmap.collection], path[1:], value)
            else:
                stacks.setdefault(path, []).append(value)
    for path, values in stacks.items():
        _set(variables[path[0]], path[1:], np.stack(values))
    return variables, consumed


COPY_CHUNK_ROWS = 4096


def check_mtp_copy(copy: str, main: str, shape_of, read_rows) -> None:
    """A DeepSeek-V3.x MTP layer's own embedding / head must equal the main one, which our MTP shares
    (DeepSeek-V3 technical report, arXiv:2412.19437, section 2.2); compared in row chunks
    (``read_rows(key, slice)`` gives float rows)."""
    if tuple(shape_of(copy)) != tuple(shape_of(main)):
        raise CheckpointError(f"{copy}: shape {list(shape_of(copy))}, but {main} (which the MTP layer shares) "
                              f"has {list(shape_of(main))}")
    n = shape_of(main)[0]
    for start in range(0, n, COPY_CHUNK_ROWS):
        rows = slice(start, min(n, start + COPY_CHUNK_ROWS))
        a, b = np.asarray(read_rows(copy, rows), np.float32), np.asarray(read_rows(main, rows), np.float32)
        if not np.array_equal(a, b):
            raise CheckpointError(
                f"{copy} differs from {main} (max |difference| {float(np.max(np.abs(a - b))):.3g} in rows "
                f"{rows.start}..{rows.stop - 1}): this model's MTP layer shares the main embedding and output "
                f"head (DeepSeek-V3 technical report, arXiv:2412.19437, section 2.2), so a checkpoint whose MTP "
                f"copy differs cannot be loaded")


def check_side_tensors(ckpt, cfg, block_size) -> set:
    """Hub tensors that carry no parameter of ours, checked, as a set of keys: the 0-size shared-expert
    tensors of ``n_shared_experts=0`` and a DeepSeek-V3.x MTP layer's copies of the embedding and head."""
    seen = set()
    for key, shape in empty_shared_experts(cfg):
        if key in ckpt:
            if tuple(ckpt.shape(key)) != shape:
                raise CheckpointError(f"{key}: shape {list(ckpt.shape(key))}, but n_shared_experts=0 implies "
                                      f"{list(shape)}")
            seen.add(key)
    for copy, main in mtp_copies(cfg):
        if copy in ckpt:
            check_mtp_copy(copy, main, ckpt.shape, lambda key, rows: ckpt.get(key, block_size)[rows])
            seen.add(copy)
    return seen


def check_against_model(variables, cfg):
    """Every leaf present with the shape `Transformer(cfg)` expects, and nothing extra."""
    expected = meta.unbox(abstract_variables(cfg))
    exp_leaves = {jax.tree_util.keystr(p): leaf.shape for p, leaf in jax.tree_util.tree_leaves_with_path(expected)}
    got_leaves = {jax.tree_util.keystr(p): leaf.shape for p, leaf in jax.tree_util.tree_leaves_with_path(variables)}
    missing = sorted(set(exp_leaves) - set(got_leaves))
    extra = sorted(set(got_leaves) - set(exp_leaves))
    if missing or extra:
        raise CheckpointError(f"variables do not match the model: missing {missing[:10]}, unexpected {extra[:10]}")
    for name, shape in exp_leaves.items():
        if tuple(got_leaves[name]) != tuple(shape):
            raise CheckpointError(f"{name}: checkpoint gives shape {list(got_leaves[name])}, "
                                  f"config.json implies {list(shape)}")


def _cast(variables, dtype):
    def cast(path, x):
        names = tuple(getattr(k, "key", None) for k in path)
        keep32 = any(names[-2:] == leaf for leaf in FP32_LEAVES)
        return jnp.asarray(x, jnp.float32 if keep32 else dtype)

    return jax.tree_util.tree_map_with_path(cast, variables)


def load_hf(hf_dir: str, dtype: str = "float32", **config_overrides):
    """Load an HF checkpoint directory. Returns (cfg, variables) with ``variables`` ready for
    ``Transformer(cfg).apply``. ``dtype`` sets both parameter and compute dtype (router and correction
    bias stay fp32). A checkpoint without MTP weights loads with ``num_nextn_predict_layers=0``."""
    cfg = config_from_hf(hf_dir, dtype=dtype, param_dtype=dtype, **config_overrides)
    # GLM-5.3-Flash: the language model only (the vision tower and the MTP layer are skipped, and logged)
    ckpt = open_text_only(SafetensorsCheckpoint(hf_dir), cfg, read_config_json(hf_dir).get("model_type"))
    if cfg.num_nextn_predict_layers and not _has_mtp_weights(ckpt, cfg):
        cfg = cfg.replace(num_nextn_predict_layers=0, mtp_depth=0)
    block_size = _block_size(hf_dir)
    variables, consumed = read_variables(ckpt, cfg, block_size)
    consumed |= check_side_tensors(ckpt, cfg, block_size)
    consumed |= {k[: -len("weight")] + "weight_scale_inv" for k in consumed if k.endswith(".weight")}
    unexpected = sorted(set(ckpt.keys()) - consumed)
    if unexpected:
        raise CheckpointError(f"{hf_dir}: {len(unexpected)} unexpected tensors, e.g. {unexpected[:5]}")
    check_against_model(variables, cfg)
    return cfg, _cast(variables, jnp.dtype(dtype))
