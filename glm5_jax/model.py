"""`Transformer`: the GLM-5 causal LM (spec §3) with its multi-token-prediction module (spec §6).

    variables = Transformer(cfg).init(rng, tokens)
    logits = Transformer(cfg).apply(variables, tokens, positions=None, segment_ids=None)
    logits, aux = Transformer(cfg).apply(variables, tokens, return_aux=True)

``segment_ids`` > 0 name packed documents, 0 marks padding; attention and the indexer never cross
segments. Missing ``positions`` restart at 0 at each segment start. ``aux`` holds

* ``mtp_logits`` [depth, B, T, V]: depth k at position t predicts token t + k + 1;
* ``expert_load`` [MoE layers, E]: routed assignments of non-padding tokens, in layer order (MTP last);
* ``balance_loss`` [MoE layers]: the sequence-wise balance term Σ f_i P_i (spec §5.3);
* ``indexer_kl`` [full-indexer layers] when ``cfg.indexer_loss`` is set (MTP last);
* ``moe_dropped`` [MoE layers]: assignments over expert capacity (expert-parallel ``cfg.moe_ep`` only);
* ``layers``: the same per-layer quantities as a tree mirroring the parameter tree
  (``decoder/<segment>/layer_i/...`` stacked over repeats, ``mtp/block/...`` summed over depths),
  which is what the routing-bias update walks.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.decoder import DecoderLayer, DecoderStack, flatten_in_layer_order
from glm5_jax.layer_plan import LayerKind
from glm5_jax.layers import ACT_BTD, RMSNorm, constrain, einsum, logical_param, normal_init


def positions_from_segments(segment_ids_BT):
    """0-based position of each token inside its segment (segments are contiguous runs)."""
    T = segment_ids_BT.shape[1]
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    starts = jnp.concatenate([jnp.ones_like(segment_ids_BT[:, :1], bool),
                              segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    start_index = jax.lax.cummax(jnp.where(starts, t, 0), axis=1)
    return (t - start_index).astype(jnp.int32)


def empty_selection(cfg, B, T, num_keys=None):
    """Top-k carry before the first full layer: (idx, valid) [B, T, min(index_topk, keys)]."""
    k = min(cfg.index_topk, T if num_keys is None else num_keys) if cfg.use_indexer else 1
    return jnp.zeros((B, T, k), jnp.int32), jnp.zeros((B, T, k), bool)


def shift_left(tokens_BT, k):
    """tokens[:, t + k] at position t; the last k positions get token 0 (their targets are masked)."""
    return jnp.pad(tokens_BT[:, k:], ((0, 0), (0, min(k, tokens_BT.shape[1]))))


class MTPModule(nn.Module):
    """One MTP depth (§6.1): u = [enorm(emb(t_{i+k})), hnorm(h_i)] @ eh_proj; h' = DecoderBlock(u).

    Returns (h', shared_head_norm(h'), aux, cache); ``cache`` is this depth's decode cache or None.
    """
    cfg: object

    @nn.compact
    def __call__(self, h_prev_BTD, e_next_BTD, positions_BT, segment_ids_BT, cache=None):
        cfg, pdt, dt = self.cfg, self.cfg.jnp_param_dtype, self.cfg.jnp_dtype
        d = cfg.hidden_size
        e = RMSNorm(cfg.rms_norm_eps, "embed", pdt, name="enorm")(e_next_BTD)
        g = RMSNorm(cfg.rms_norm_eps, "embed", pdt, name="hnorm")(h_prev_BTD)
        w_eh = logical_param(self, "eh_proj", (2 * d, d), ("mtp_concat", "embed"), normal_init(cfg), pdt)
        u = einsum("btc,cd->btd", jnp.concatenate([e, g], axis=-1), w_eh, dt)   # embedding half first (P16)
        kind = LayerKind("moe", "full" if cfg.use_indexer else "none")
        B, T, _ = u.shape
        num_keys = T if cache is None else cache["latent"].shape[1]
        h, _, aux, cache = DecoderLayer(cfg, kind, name="block")(u, positions_BT, segment_ids_BT,
                                                                 empty_selection(cfg, B, T, num_keys), cache)
        return h, RMSNorm(cfg.rms_norm_eps, "embed", pdt, name="shared_head_norm")(h), aux, cache


class Transformer(nn.Module):
    """The causal LM. ``__call__`` is the training/scoring forward; ``decode`` and ``mtp_decode`` are the
    same computation over a decode cache (`glm5_jax.kv_cache`), used by `glm5_jax.generate`."""
    cfg: object

    def setup(self):
        cfg, pdt = self.cfg, self.cfg.jnp_param_dtype
        self.embedding = logical_param(self, "embed", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                                       normal_init(cfg), pdt)
        self.lm_head = logical_param(self, "lm_head", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                                     normal_init(cfg), pdt)
        self.decoder = DecoderStack(cfg)
        self.final_norm = RMSNorm(cfg.rms_norm_eps, "embed", pdt)
        if cfg.num_nextn_predict_layers:
            self.mtp = MTPModule(cfg)

    def embed(self, tokens_BT):
        return constrain(jnp.take(self.embedding, tokens_BT, axis=0).astype(self.cfg.jnp_dtype), ACT_BTD)

    def head(self, h_BTD):
        return constrain(einsum("btd,dv->btv", h_BTD, self.lm_head, self.cfg.jnp_dtype, jnp.float32),
                         ("batch", "seq", "act_vocab"))

    def _main(self, tokens_BT, positions, segment_ids, cache):
        """(logits, final hidden h, normed h, decoder aux, cache) of the main stack."""
        B, T = tokens_BT.shape
        num_keys = T if cache is None else _cache_len(cache)
        h, stack_aux, cache = self.decoder(self.embed(tokens_BT), positions, segment_ids,
                                           empty_selection(self.cfg, B, T, num_keys), cache)
        h_normed = self.final_norm(h)
        return self.head(h_normed), h, h_normed, stack_aux, cache

    def __call__(self, tokens_BT, positions=None, segment_ids=None, return_aux=False):
        cfg = self.cfg
        B, T = tokens_BT.shape
        if segment_ids is None:
            segment_ids = jnp.ones((B, T), jnp.int32)
        if positions is None:
            positions = positions_from_segments(segment_ids)
        logits, h, h_normed, stack_aux, _ = self._main(tokens_BT, positions, segment_ids, None)
        layers_aux = {"decoder": stack_aux}
        mtp_logits = []
        if (return_aux or self.is_initializing()) and cfg.num_nextn_predict_layers:
            h_prev = h_normed if cfg.mtp_use_normed_hidden else h
            depth_aux = []
            for depth in range(1, max(cfg.mtp_depth, 1) + 1):   # one shared module applied recursively
                h_prev, h_mtp_normed, aux, _ = self.mtp(h_prev, self.embed(shift_left(tokens_BT, depth)),
                                                        positions, segment_ids)
                mtp_logits.append(self.head(h_mtp_normed))
                depth_aux.append(aux)
            if cfg.mtp_depth > 0:
                # each depth's losses count once; loads add up (they all go through the same router)
                layers_aux["mtp"] = {"block": jax.tree.map(lambda *xs: sum(xs), *depth_aux)}
        if not return_aux:
            return logits
        return logits, collect_aux(cfg, layers_aux, mtp_logits)

    def decode(self, tokens_BT, positions_BT, segment_ids_BT, cache):
        """Main stack over a decode cache: the rows' tokens sit at contiguous positions (slots).

        Returns (logits [B,T,V], the hidden state MTP depth 1 takes [B,T,D], updated cache).
        """
        logits, h, h_normed, _, cache = self._main(tokens_BT, positions_BT, segment_ids_BT, cache)
        return logits, (h_normed if self.cfg.mtp_use_normed_hidden else h), cache

    def mtp_decode(self, h_prev_BTD, next_tokens_BT, positions_BT, segment_ids_BT, cache):
        """One MTP depth over its decode cache: (h for the next depth, logits, updated cache)."""
        h, h_normed, _, cache = self.mtp(h_prev_BTD, self.embed(next_tokens_BT), positions_BT, segment_ids_BT,
                                         cache)
        return h, self.head(h_normed), cache


def _cache_len(cache):
    """Number of slots S of a decoder cache ({segment: {layer_i: {"latent": [repeats, B, S, C], ...}}})."""
    for seg in cache.values():
        for layer in seg.values():
            return layer["latent"].shape[-2]
    raise ValueError("decode cache holds no layers")


def collect_aux(cfg, layers_aux, mtp_logits):
    aux = {"layers": layers_aux}
    mtp_block = layers_aux.get("mtp", {}).get("block", {})
    for name, path in (("expert_load", ("moe", "expert_load")), ("balance_loss", ("moe", "balance_loss")),
                       ("indexer_kl", ("indexer_kl",)), ("moe_dropped", ("moe", "dropped"))):
        parts = [flatten_in_layer_order(cfg, layers_aux["decoder"], path)]
        node = mtp_block
        for k in path:
            node = node.get(k) if isinstance(node, dict) else None
        if node is not None:
            parts.append(node[None])
        parts = [p for p in parts if p is not None]
        if parts:
            aux[name] = jnp.concatenate(parts)
    if mtp_logits:
        aux["mtp_logits"] = jnp.stack(mtp_logits)
    return aux
