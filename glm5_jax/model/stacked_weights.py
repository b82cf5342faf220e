"""Decode reads an attention weight in place from its stacked [layers, ...] array (``RuntimeConfig.
decode_stacked_kv_b``).

The layer scan hands each layer a slice of every stacked parameter; XLA reads a slice in place inside the
one fusion that uses it, but copies it out when two do. The absorbed MLA uses kv_b_proj [R, H, dn + dv] twice
per decode step (its key half for the query, its value half for the output): a copy of the layer's whole
kv_b per layer and step. With the switch the main stack's kv_b_proj leaves the scanned "params" for the
`STACKED_WEIGHTS` collection (`stack_kv_b_variables`), which the scan hands every layer whole with the layer's
index (glm5_jax/model/decoder.py); each half is then read at that index by its own product.
With ``decode_kv_b_heads_major`` the moved kv_b_proj [layers, R, H, dn + dv] is split once into its halves stored
heads-major (`heads_major_kv_b`): W_UK [layers, H, R, dn] and W_UV [layers, H, dv, R]. A one-token product then
reduces each head's minor axis and writes its [H, R] / [H, dv] result row-major, the layout the attention core
and the output projection read; from [R, H, .] XLA writes the absorbed query [R, H] and reads the attention
output as [R, H], each a layout copy per layer and step.
`move_stack_leaves` also moves the packed experts of ``decode_stacked_experts``
(glm5_jax/model/moe/int4_weights.py).
"""
from __future__ import annotations

DECODER_PARAMS = "decoder"              # the main (scanned) stack's key in "params"
STACKED_WEIGHTS = "stacked_weights"     # variable collection of the decode's stacked attention weights
KV_B = "kv_b_proj"
# ``decode_kv_b_heads_major``: kv_b_proj's halves, heads-major (`heads_major_kv_b`)
KV_B_UK, KV_B_UV = "kv_b_uk", "kv_b_uv"


def move_stack_leaves(variables, collection: str, takes):
    """``variables`` with the main stack's parameters for which ``takes(module name, parameter name)`` moved from
    "params" to ``collection`` (same paths under the stack's key)."""
    def split(tree, key):
        kept, moved = {}, {}
        for k, v in tree.items():
            if isinstance(v, dict):
                kept[k], sub = split(v, k)
                if sub:
                    moved[k] = sub
            elif takes(key, k):
                moved[k] = v
            else:
                kept[k] = v
        return kept, moved

    params = dict(variables["params"])
    params[DECODER_PARAMS], moved = split(params[DECODER_PARAMS], DECODER_PARAMS)
    return {**variables, "params": params, collection: {DECODER_PARAMS: moved}}


def stack_kv_b_variables(variables):
    """``variables`` with every main-stack layer's attention kv_b_proj moved from "params" to `STACKED_WEIGHTS`."""
    return move_stack_leaves(variables, STACKED_WEIGHTS, lambda module, name: module == "attention" and name == KV_B)


def heads_major_kv_b(variables, dn: int):
    """``variables`` after `stack_kv_b_variables` with every stacked kv_b_proj [layers, R, H, dn + dv] replaced by its
    halves heads-major: `KV_B_UK` [layers, H, R, dn] and `KV_B_UV` [layers, H, dv, R] (the same values)."""
    def split(tree):
        out = {}
        for k, v in tree.items():
            if isinstance(v, dict):
                out[k] = split(v)
            elif k == KV_B:
                out[KV_B_UK] = v[..., :dn].transpose(0, 2, 1, 3)
                out[KV_B_UV] = v[..., dn:].transpose(0, 2, 3, 1)
            else:
                out[k] = v
        return out
    return {**variables, STACKED_WEIGHTS: split(variables[STACKED_WEIGHTS])}
