"""`Transformer`: the GLM-5 causal LM with its multi-token-prediction (MTP) module.

    variables = Transformer(cfg).init(rng, tokens)
    out = Transformer(cfg).apply(variables, tokens, positions=None, segment_ids=None, with_mtp=False)
    out.logits, out.stats, out.mtp_logits

    # the same on inputs already in the context-parallel layout (what the train step runs):
    laid = lay_out_batch(cfg, batch)              # batch: a natural-order `glm5_jax.data.Batch`
    out = Transformer(cfg).apply(variables, laid, with_mtp=True, method=Transformer.forward_laid_out)

``segment_ids`` > 0 name packed documents, 0 marks padding; attention and the indexer never cross
segments. Missing ``positions`` restart at 0 at each segment start. ``apply`` returns a `ModelOutput`:

* ``logits`` [B, T, V] fp32;
* ``stats``: `LayerStats` [num_hidden_layers + num_nextn_predict_layers, ...] in layer order, the MTP
  block last (summed over MTP depths; zeros with False masks when the MTP block did not run):
  ``expert_load`` [L, E] routed assignments of non-padding tokens, ``balance_loss`` [L] the
  sequence-wise balance term Σ f_i P_i (DeepSeek-V3 report, arXiv:2412.19437, section 2.1.2), ``indexer_kl`` [L]
  (full-indexer layers when ``cfg.indexer_loss`` is set), ``dropped`` [L] assignments over expert
  capacity (expert-parallel ``cfg.moe_ep`` only), and the masks ``has_moe`` / ``has_indexer_kl`` [L];
* ``mtp_logits`` [depth, B, T, V] (depth k at position t predicts token t + k + 1) when ``with_mtp``
  and the model has an MTP module with ``mtp_depth`` > 0; None otherwise.

``forward_laid_out(..., nll_only=True)`` (the train step with ``runtime.loss_chunk_tokens`` > 0) returns no
logits: ``nll`` [B, T] and ``mtp_nll`` [depth, B, T] instead, each position's NLL of its target (the laid-out
batch's ``ahead_tokens``), computed ``loss_chunk_tokens`` positions at a time (glm5_jax/model/lm_head.py).

Under a mesh that splits the logical "seq" axis (context parallelism, glm5_jax/parallel/context.py) the
forward runs in the zig-zag sequence layout: ``__call__`` lays its inputs out with `lay_out_batch` (MTP's
shifted tokens are shifted in natural order first), ``forward_laid_out`` takes them laid out, and
``logits`` / ``mtp_logits`` come out in layout order, position t of the layout being token
``to_layout(arange(T))[t]``; the `LaidOutBatch`'s ``ahead_tokens`` are their targets in the same order.

`decode` and `mtp_decode` (the same computation over a decode cache) return tuples, see their docstrings.
"""
from __future__ import annotations

import functools
import operator
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from glm5_jax.data.batch import Batch
from glm5_jax.model import hyper_connections, routing_replay
from glm5_jax.model.attention import masked_flash_core
from glm5_jax.model.config import ModelConfig
from glm5_jax.model.decoder import ROUTING_BIAS_PATH, DecoderLayer, DecoderStack, routing_bias_rows
from glm5_jax.model.hyper_connections import ACT_BTND
from glm5_jax.model.layer_plan import LayerKind
from glm5_jax.model.layer_stats import LayerStats, concatenate
from glm5_jax.model.layers import ACT_BTD, RMSNorm, constrain, einsum, logical_param, normal_init
from glm5_jax.model.lm_head import chunked_token_nll, head_logits
from glm5_jax.parallel import context as context_parallel
from glm5_jax.parallel.axes import BATCH, EMBED, MTP_CONCAT, SEQ, VOCAB


@struct.dataclass
class ModelOutput:
    logits: jax.Array | None           # [B, T, V] fp32 (None with ``nll_only``)
    stats: LayerStats                  # [num_hidden_layers + num_nextn_predict_layers, ...], MTP last
    mtp_logits: jax.Array | None       # [mtp_depth, B, T, V] fp32, or None when MTP did not run
    nll: jax.Array | None = None       # [B, T] fp32 NLL of each position's target, with ``nll_only``
    mtp_nll: jax.Array | None = None   # [mtp_depth, B, T] the same per MTP depth, with ``nll_only`` and MTP


class MainOutput(NamedTuple):
    """The main stack's results (`Transformer._main`)."""
    logits: jax.Array                  # [B, T, V] (or [B, X, V] at ``logits_at``)
    h: jax.Array                       # [B, T, D] final hidden state before the final norm
    h_normed: jax.Array                # [B, T, D] after it
    stats: LayerStats                  # [num_hidden_layers, ...]
    cache: Any                         # the updated decode cache, or None


class MTPOutput(NamedTuple):
    """One MTP depth's results."""
    h: jax.Array                       # [B, T, D] the next depth's input
    h_normed: jax.Array                # shared_head_norm(h): what the LM head reads
    stats: LayerStats
    cache: Any                         # this depth's updated decode cache, or None


def positions_from_segments(segment_ids_BT):
    """0-based position of each token inside its segment (segments are contiguous runs)."""
    T = segment_ids_BT.shape[1]
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    starts = jnp.concatenate([jnp.ones_like(segment_ids_BT[:, :1], bool),
                              segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    start_index = jax.lax.cummax(jnp.where(starts, t, 0), axis=1)
    return (t - start_index).astype(jnp.int32)


def empty_selection(cfg: ModelConfig, B, T, num_keys=None, decoding=False):
    """Top-k carry before the first full layer: (idx, valid) [B, T, min(index_topk, keys)], and the
    selection mask [B, T, keys] where the sparse core is the masked flash kernel (`masked_flash_core`)."""
    S = T if num_keys is None else num_keys
    k = routing_replay.selection_width(cfg, S) if cfg.use_indexer else 1
    empty = jnp.zeros((B, T, k), jnp.int32), jnp.zeros((B, T, k), bool)
    return empty + (jnp.zeros((B, T, S), jnp.int8),) if masked_flash_core(cfg, S, decoding) else empty


def lay_out_batch(cfg: ModelConfig, batch: Batch) -> context_parallel.LaidOutBatch:
    """`batch` in the sequence layout with its tokens 1 .. mtp_depth + 1 steps ahead: the MTP depths'
    input tokens (depth k embeds the tokens k ahead) and the targets of the logits and MTP depths."""
    return context_parallel.lay_out(batch, ahead=1 + cfg.mtp_depth)


class MTPModule(nn.Module):
    """One MTP depth: u = [enorm(emb(t_{i+k})), hnorm(h_i)] @ eh_proj; h' = DecoderBlock(u) -> `MTPOutput`."""
    cfg: ModelConfig

    @nn.compact
    def __call__(self, h_prev_BTD, e_next_BTD, positions_BT, segment_ids_BT, cache=None):
        cfg, pdt, dt = self.cfg, self.cfg.jnp_param_dtype, self.cfg.jnp_dtype
        d = cfg.hidden_size
        e = RMSNorm(cfg.rms_norm_eps, EMBED, pdt, name="enorm")(e_next_BTD)
        g = RMSNorm(cfg.rms_norm_eps, EMBED, pdt, name="hnorm")(h_prev_BTD)
        w_eh = logical_param(self, "eh_proj", (2 * d, d), (MTP_CONCAT, EMBED), normal_init(cfg), pdt)
        # embedding half first, as checkpoints expect (vLLM deepseek_mtp.py: eh_proj(cat([embeds, hidden])))
        u = einsum("btc,cd->btd", jnp.concatenate([e, g], axis=-1), w_eh, dt, impl=cfg.runtime.projection_impl,
                   grad_dtype=cfg.runtime.grad_reduce_dtype)
        kind = LayerKind("moe", "full" if cfg.use_indexer else "none")
        B, T, _ = u.shape
        num_keys = T if cache is None else cache["latent"].shape[1]
        out = DecoderLayer(cfg, kind, name="block")(u, positions_BT, segment_ids_BT,
                                                    empty_selection(cfg, B, T, num_keys, cache is not None), cache)
        return MTPOutput(out.h, RMSNorm(cfg.rms_norm_eps, EMBED, pdt, name="shared_head_norm")(out.h), out.stats,
                         out.cache)


class Transformer(nn.Module):
    """The causal LM. ``__call__`` is the training/scoring forward; ``decode`` and ``mtp_decode`` are the
    same computation over a decode cache (`glm5_jax.model.kv_cache`), used by `glm5_jax.generate.decoding`."""
    cfg: ModelConfig

    def setup(self):
        cfg, pdt = self.cfg, self.cfg.jnp_param_dtype
        self.embedding = logical_param(self, "embed", (cfg.vocab_size, cfg.hidden_size), (VOCAB, EMBED),
                                       normal_init(cfg), pdt)
        self.lm_head = logical_param(self, "lm_head", (cfg.hidden_size, cfg.vocab_size), (EMBED, VOCAB),
                                     normal_init(cfg), pdt)
        self.decoder = DecoderStack(cfg)
        self.final_norm = RMSNorm(cfg.rms_norm_eps, EMBED, pdt)
        if cfg.num_nextn_predict_layers:
            self.mtp = MTPModule(cfg)

    def embed(self, tokens_BT):
        return constrain(jnp.take(self.embedding, tokens_BT, axis=0).astype(self.cfg.jnp_dtype), ACT_BTD)

    def head(self, h_BTD):
        rt = self.cfg.runtime
        return head_logits(h_BTD, self.lm_head, self.cfg.jnp_dtype, rt.projection_impl, rt.grad_reduce_dtype)

    def head_nll(self, h_BTD, targets_BT):
        """[B, T] NLL of `targets` under the head's logits of `h`, ``runtime.loss_chunk_tokens`` positions at
        a time (all at once when 0); [B, T, V] logits are never held whole (glm5_jax/model/lm_head.py)."""
        rt = self.cfg.runtime
        return chunked_token_nll(h_BTD, self.lm_head, targets_BT, chunk=rt.loss_chunk_tokens or h_BTD.shape[1],
                                 dtype=self.cfg.jnp_dtype, impl=rt.projection_impl, grad_dtype=rt.grad_reduce_dtype)

    def _main(self, tokens_BT, positions, segment_ids, cache, logits_at=None, logits=True,
              replay=None) -> MainOutput:
        B, T = tokens_BT.shape
        num_keys = T if cache is None else _cache_len(cache)
        h = self.embed(tokens_BT)
        if self.cfg.hc_mult:      # hyper-connections: N copies in, their mean out
            h = constrain(hyper_connections.expand(h, self.cfg.hc_mult), ACT_BTND)
        stack = self.decoder(h, positions, segment_ids, empty_selection(self.cfg, B, T, num_keys, cache is not None),
                             cache, replay)
        h = hyper_connections.hyper_head(stack.h) if self.cfg.hc_mult else stack.h
        h_normed = self.final_norm(h)
        return MainOutput(self.head(_rows_at(h_normed, logits_at)) if logits else None, h, h_normed, stack.stats,
                          stack.cache)

    def __call__(self, tokens_BT, positions=None, segment_ids=None, with_mtp=False, replay=None) -> ModelOutput:
        """The forward over whole sequences; ``with_mtp`` also runs the MTP depths (training). ``replay``:
        routing recorded by a sampler, replayed instead of recomputed (glm5_jax/model/routing_replay.py;
        `routing_replay.to_tree`), in natural sequence order."""
        B, T = tokens_BT.shape
        if segment_ids is None:
            segment_ids = jnp.ones((B, T), jnp.int32)
        if positions is None:
            positions = positions_from_segments(segment_ids)
        batch = Batch(tokens=tokens_BT, segment_ids=segment_ids, positions=positions)
        if replay is not None and context_parallel.layout_shards(T) > 1:
            raise NotImplementedError("routing replay does not run context-parallel (the sequence layout is "
                                      "permuted over the context shards)")
        return self.forward_laid_out(lay_out_batch(self.cfg, batch), with_mtp, replay)

    def forward_laid_out(self, inputs: context_parallel.LaidOutBatch, with_mtp=False, replay=None,
                         nll_only=False) -> ModelOutput:
        """``__call__`` on inputs already in the sequence layout (`lay_out_batch`). ``nll_only``: no logits,
        each head's NLL of its targets (``inputs.ahead_tokens``) instead, by `head_nll`."""
        cfg = self.cfg
        tokens, positions, segment_ids = (constrain(x, (BATCH, SEQ))
                                          for x in (inputs.tokens, inputs.positions, inputs.segment_ids))
        nll_only = nll_only and not self.is_initializing()
        main = self._main(tokens, positions, segment_ids, None, logits=not nll_only, replay=replay)
        logits, h, h_normed, stats = main.logits, main.h, main.h_normed, main.stats
        nll = self.head_nll(h_normed, constrain(inputs.ahead_tokens[0], (BATCH, SEQ))) if nll_only else None
        mtp_logits, mtp_nll, mtp_stats = None, None, []
        if cfg.num_nextn_predict_layers:
            depth_stats, depth_heads = [], []   # per depth: logits, or NLL with nll_only
            if (with_mtp and cfg.mtp_depth > 0) or self.is_initializing():
                h_prev = h_normed if cfg.mtp_use_normed_hidden else h
                for k in range(1, max(cfg.mtp_depth, 1) + 1):   # one shared module applied recursively
                    next_tokens = constrain(inputs.ahead_tokens[k - 1], (BATCH, SEQ))
                    depth = self.mtp(h_prev, self.embed(next_tokens), positions, segment_ids)
                    h_prev = depth.h
                    if nll_only:        # depth k predicts the tokens k + 1 ahead
                        targets = constrain(inputs.ahead_tokens[k], (BATCH, SEQ))
                        depth_heads.append(self.head_nll(depth.h_normed, targets))
                    else:
                        depth_heads.append(self.head(depth.h_normed))
                    depth_stats.append(depth.stats)
            if depth_stats and cfg.mtp_depth > 0:
                # each depth's losses count once; loads add up (they all go through the same router)
                mtp_stats = [jax.tree.map(lambda x: x[None], functools.reduce(operator.add, depth_stats))]
                if with_mtp and nll_only:
                    mtp_nll = jnp.stack(depth_heads)
                elif with_mtp:
                    mtp_logits = jnp.stack(depth_heads)
            else:                                   # the block's row: zeros, masked out
                mtp_stats = [jax.tree.map(lambda x: jnp.zeros_like(x[:1]), stats)]
        return ModelOutput(logits=logits, stats=concatenate([stats] + mtp_stats), mtp_logits=mtp_logits, nll=nll,
                           mtp_nll=mtp_nll)

    def decode(self, tokens_BT, positions_BT, segment_ids_BT, cache, logits_at=None):
        """Main stack over a decode cache: the rows' tokens sit at contiguous positions (slots).

        Returns (logits [B,T,V], the hidden state MTP depth 1 takes [B,T,D], updated cache). With
        ``logits_at`` [B, X] (indices into T) the logits are [B, X, V] at those tokens only: a long
        prefill chunk needs one row's logits, not [B, T, V].
        """
        main = self._main(tokens_BT, positions_BT, segment_ids_BT, cache, logits_at)
        return main.logits, (main.h_normed if self.cfg.mtp_use_normed_hidden else main.h), main.cache

    def mtp_decode(self, h_prev_BTD, next_tokens_BT, positions_BT, segment_ids_BT, cache, logits_at=None):
        """One MTP depth over its decode cache: (h for the next depth, logits, updated cache);
        ``logits_at`` as in `decode`."""
        depth = self.mtp(h_prev_BTD, self.embed(next_tokens_BT), positions_BT, segment_ids_BT, cache)
        return depth.h, self.head(_rows_at(depth.h_normed, logits_at)), depth.cache


def _rows_at(x_BTD, index_BX):
    """x[b, index[b, x]] -> [B, X, D]; all of x when index is None."""
    if index_BX is None:
        return x_BTD
    return jnp.take_along_axis(x_BTD, index_BX[:, :, None], axis=1)


def _cache_len(cache):
    """Number of slots S of a decoder cache ({segment: {layer_i: {"latent": [repeats, B, S, C], ...}}})."""
    for seg in cache.values():
        for layer in seg.values():
            if "latent" in layer:      # KDA layers (GLM-5.3-Flash) keep a state, no slots
                return layer["latent"].shape[-2]
    raise ValueError("decode cache holds no MLA layers")


def routing_bias_rows_of_model(cfg: ModelConfig):
    """`decoder.routing_bias_rows` for the whole model: paths under the BIAS_COLLECTION tree (the
    decoder's stacked leaves, then the MTP block's) and the `ModelOutput.stats` rows they take."""
    rows = [(("decoder",) + path, layers) for path, layers in routing_bias_rows(cfg)]
    if cfg.num_nextn_predict_layers:
        rows.append((("mtp", "block") + ROUTING_BIAS_PATH, np.asarray(cfg.num_hidden_layers)))
    return rows
