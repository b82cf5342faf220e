"""Decode reads an attention weight in place from its stacked [layers, ...] array (``RuntimeConfig.
decode_stacked_kv_b``).

The layer scan hands each layer a slice of every stacked parameter; XLA reads a slice in place inside the
one fusion that uses it, but copies it out when two do. The absorbed MLA uses kv_b_proj [R, H, dn + dv] twice
per decode step (its key half for the query, its value half for the output): a copy of the layer's whole
kv_b per layer and step. With the switch the main stack's kv_b_proj leaves the scanned "params" for the
`STACKED_WEIGHTS` collection (`stack_kv_b_variables`), which the scan hands every layer whole with the layer's
index (glm5_jax/model/decoder.py); each half is then read at that index by its own product.
"""
from __future__ import annotations

from glm5_jax.model.moe.int4_weights import DECODER_PARAMS

STACKED_WEIGHTS = "stacked_weights"     # variable collection of the decode's stacked attention weights
KV_B = "kv_b_proj"


def stack_kv_b_variables(variables):
    """``variables`` with every main-stack layer's attention kv_b_proj moved from "params" to `STACKED_WEIGHTS`
    (same paths under the stack's key)."""
    def split(tree, key):
        kept, moved = {}, {}
        for k, v in tree.items():
            if isinstance(v, dict):
                kept[k], sub = split(v, k)
                if sub:
                    moved[k] = sub
            elif key == "attention" and k == KV_B:
                moved[k] = v
            else:
                kept[k] = v
        return kept, moved

    params = dict(variables["params"])
    params[DECODER_PARAMS], moved = split(params[DECODER_PARAMS], DECODER_PARAMS)
    return {**variables, "params": params, STACKED_WEIGHTS: {DECODER_PARAMS: moved}}
