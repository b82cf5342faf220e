"""The routed experts' weights under `ModelConfig.quant`, and the offline quantiser of a parameter tree.

* ``none``: the fp weight.
* ``int4_qat``: the fp master weight fake-quantised (`int4.fake_quantize`: exact INT4 values forward,
  straight-through gradients), so training sees the served weights.
* ``int4``: packed parameters ``{name}_packed`` (int32, eight values a word) and ``{name}_scale``, made
  by `quantize_params`; dequantised for the XLA matmul (``quant_matmul="xla"``: the same numbers as
  ``int4_qat``'s forward) or handed packed to the Pallas dequantise-matmul (`Int4Weight`).

At decode (``RuntimeConfig.decode_stacked_experts``) the main stack's routed experts leave the scanned
"params" for the `STACKED_EXPERTS` collection (`stack_expert_variables`), which the layer scan hands every
layer whole: each layer's `Int4Weight` (packed) or `StackedWeight` (bf16) is the stacked [layers, E, ...] arrays
and its layer index, which the decode kernels read in place (a scanned parameter is a slice, copied before a
custom call can read it).
"""
from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.model.config import ModelConfig
from glm5_jax.model.layers import logical_param
from glm5_jax.model.stacked_weights import move_stack_leaves
from glm5_jax.quant import int4
from pallas_kernels.impls import XLA

EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")   # the routed experts' [E, K, N] weights
MOE_MODULE = "moe"                                       # parameter-tree key of every MoE layer


STACKED_EXPERTS = "stacked_experts"     # variable collection of the decode's stacked packed experts


class Int4Weight(NamedTuple):
    """A packed [E, K, N] weight: int32 words [E, K/8, N] and scales [E, K/G, N]; or, with ``layer`` (int32
    scalar), all layers' [L, E, ...] and the layer to use."""
    packed: jax.Array
    scale: jax.Array
    layer: jax.Array | None = None


class StackedWeight(NamedTuple):
    """An fp [E, K, N] weight of every layer, [L, E, K, N], and the layer to use (int32 scalar)."""
    stack: jax.Array
    layer: jax.Array

    def of_layer(self) -> jax.Array:
        """The layer's [E, K, N] weight (a slice: copied where a custom call reads it)."""
        return self.stack[self.layer]


def expert_weight(module: nn.Module, name: str, shape, axes, init, cfg: ModelConfig, layer=None):
    """Declare routed-expert weight `name` of `shape` [E, K, N] on `module`; return what the grouped
    matmul multiplies by: an array, or an `Int4Weight` for the Pallas INT4 matmul. ``layer``: the scanned
    layer's index, given at decode with ``decode_stacked_experts`` (the stacked weights, module docstring:
    an `Int4Weight` with its layer, or a `StackedWeight`)."""
    group, scale_dtype, pdt = cfg.quant_group_size, cfg.quant_scale_dtype, cfg.jnp_param_dtype
    if layer is not None and not module.is_initializing():
        if cfg.quant == "none":
            return StackedWeight(module.get_variable(STACKED_EXPERTS, name), layer)
        if cfg.quant != "int4":
            raise ValueError(f"decode_stacked_experts reads bf16 or packed INT4 experts, not quant={cfg.quant!r}")
        return Int4Weight(module.get_variable(STACKED_EXPERTS, f"{name}_packed"),
                          module.get_variable(STACKED_EXPERTS, f"{name}_scale"), layer)
    if cfg.quant == "int4":
        packed_shape, scale_shape = int4.packed_shapes(shape, group)
        packed = logical_param(module, f"{name}_packed", packed_shape, axes, nn.initializers.zeros, jnp.int32)
        scale = logical_param(module, f"{name}_scale", scale_shape, axes, nn.initializers.zeros,
                              jnp.dtype(scale_dtype))
        if cfg.runtime.quant_matmul != XLA:
            return Int4Weight(packed, scale)
        return int4.dequantize_packed(packed, scale, group, pdt)
    w = logical_param(module, name, shape, axes, init, pdt)
    return int4.fake_quantize(w, group, scale_dtype) if cfg.quant == "int4_qat" else w


def quantize_params(params, cfg: ModelConfig):
    """The offline quantiser: a ``params`` tree of a ``quant="none"`` or ``"int4_qat"`` model -> the tree
    of the ``quant="int4"`` model (every MoE layer's routed-expert weights packed, nothing else changed).

    Works on plain (unboxed) arrays with any leading axes (scanned layers stack a layer axis)."""
    group, scale_dtype = cfg.quant_group_size, cfg.quant_scale_dtype

    def walk(tree, key):
        if not isinstance(tree, dict):
            return tree
        out = {}
        for k, v in tree.items():
            if key == MOE_MODULE and k in EXPERT_WEIGHTS and not isinstance(v, dict):
                packed, scale = jax.jit(int4.quantize_packed, static_argnums=(1, 2))(v, group, scale_dtype)
                out[f"{k}_packed"], out[f"{k}_scale"] = packed, scale
            else:
                out[k] = walk(v, k)
        return out

    if not any(MOE_MODULE in path for path in _dict_paths(params)):
        raise ValueError(f"quantize_params: no {MOE_MODULE!r} module in the parameter tree (top keys "
                         f"{sorted(params)})")
    return walk(dict(params), None)


def stack_expert_variables(variables):
    """``variables`` with the main stack's routed experts (packed words and scales, or fp weights) moved from
    "params" to `STACKED_EXPERTS` (same paths under the stack's key): what a ``decode_stacked_experts`` model
    reads (module docstring)."""
    def expert(module, name):
        packed = name.endswith(("_packed", "_scale")) and name.rsplit("_", 1)[0] in EXPERT_WEIGHTS
        return module == MOE_MODULE and (packed or name in EXPERT_WEIGHTS)
    return move_stack_leaves(variables, STACKED_EXPERTS, expert)


def _dict_paths(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield prefix + (k,)
            yield from _dict_paths(v, prefix + (k,))
