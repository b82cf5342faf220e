"""The policy: the SFT run's GLM-5 in its RL form, its variables on a mesh, and token log-probs.

RL keeps DSA in its sparse stage with the indexer frozen (the GLM-5 report: a changing indexer
top-k
destabilised RL) and the MoE routing bias fixed, so sampler and learner select the same keys and
experts. The indexer gets no gradient anyway (top-k is discrete and the indexer KL is off).
"""
from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta

from glm5_jax.checkpoint.placement import abstract_variables
from glm5_jax.generate.decoding import Sampler
from glm5_jax.model import routing_replay
from glm5_jax.model.transformer import Transformer
from glm5_jax.parallel.mesh import logical_shardings, mesh_and_rules
from glm5_jax.parallel.sampling import SAMPLING_RULES, check_sampling_fits, sampling_mesh


def rl_model_config(sft_model_cfg):
    """Sparse DSA attention, no indexer loss, and the sampler's MLA form (`generate.decode_config`:
    absorbed latent attention) so learner and sampler compute the same numbers (TITO ratio = 1 on-policy)."""
    from glm5_jax.generate.decoding import decode_config

    return decode_config(sft_model_cfg).replace(attention_mode="sparse", indexer_loss="none")


def replayed(rl_cfg) -> tuple[str, ...]:
    """The routing a run records and replays (`glm5_jax.model.routing_replay` names), from rl.replay_*."""
    return tuple(name for name, on in ((routing_replay.EXPERTS, rl_cfg.replay_experts),
                                       (routing_replay.SELECTED, rl_cfg.replay_topk)) if on)


def sampler_model_config(sft_model_cfg, sampler_dtype: str = ""):
    """The generator's model: the RL model, computing in `sampler_dtype` when set (same parameters)."""
    cfg = rl_model_config(sft_model_cfg)
    return cfg.replace(dtype=sampler_dtype) if sampler_dtype else cfg


def sampling_policy(rl_cfg, sft_model_cfg) -> "Policy":
    """The sampler's model (`sampler_model_config`; packed INT4 experts when ``rl.handoff_int4_experts``; its
    decode steps by ``rl.sampler_kernels`` / ``sampler_dispatch`` / ``sampler_capacity``) on its own sampling mesh
    (``rl.sampler_mesh``, one device when empty), laid out by SAMPLING_RULES; MeshError when the mesh cannot split
    the model."""
    cfg = sampler_model_config(sft_model_cfg, rl_cfg.sampler_dtype).replace(
        sampler_kernels=rl_cfg.sampler_kernels, sampler_dispatch=rl_cfg.sampler_dispatch,
        sampler_capacity=rl_cfg.sampler_capacity)
    if rl_cfg.handoff_int4_experts:            # versions carry packed INT4 experts: the model that reads them
        cfg = cfg.replace(quant="int4")
    if replayed(rl_cfg):                       # the decode cache records each token's experts / top-k
        if rl_cfg.replay_topk and not cfg.use_indexer:
            raise ValueError("rl.replay_topk: the model has no DSA indexer whose top-k could be replayed")
        cfg = cfg.replace(capture_routing=True)
    mesh = sampling_mesh(rl_cfg.sampler_mesh)
    check_sampling_fits(mesh, cfg)
    return Policy(cfg, mesh, SAMPLING_RULES)


class Policy:
    """Model, abstract variables with this mesh's shardings, and the jitted helpers that need the mesh."""

    def __init__(self, model_cfg, mesh, rules):
        self.cfg = model_cfg
        self.mesh, self.rules = mesh, rules
        self.model = Transformer(model_cfg)
        self.abstract_variables = abstract_variables(model_cfg, mesh, rules)
        self.shardings = jax.tree.map(lambda a: a.sharding, self.abstract_variables)

    def abstract_opt_state(self, tx):
        """tx.init's state tree with target shardings: moments inherit their parameter's logical axes."""
        with self.context():
            boxed = jax.eval_shape(lambda r: tx.init(self.model.init(r, jnp.zeros((1, 8), jnp.int32))["params"]),
                                   jax.ShapeDtypeStruct((2,), jnp.uint32))
            shardings = meta.unbox(logical_shardings(boxed, self.mesh, self.rules))
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), meta.unbox(boxed),
                            shardings)

    def context(self):
        return mesh_and_rules(self.mesh, self.rules)


def sequence_layout(prompt_BP, prompt_lengths_B, completion_BC, completion_lengths_B):
    """Token rows prompt[:len] + completion[:len] + padding (T = P + C), their segment ids (1 on real
    tokens, 0 on padding) and, per completion token j, the position whose logits predict it."""
    B, P = prompt_BP.shape
    C = completion_BC.shape[1]
    t_T = jnp.arange(P + C)[None, :]
    rel_BT = t_T - prompt_lengths_B[:, None]                     # completion index at position t
    in_prompt = t_T < prompt_lengths_B[:, None]
    in_completion = (rel_BT >= 0) & (rel_BT < completion_lengths_B[:, None])
    prompt_part = jnp.take_along_axis(jnp.pad(prompt_BP, ((0, 0), (0, C))), jnp.broadcast_to(t_T, (B, P + C)), 1)
    completion_part = jnp.take_along_axis(completion_BC, jnp.clip(rel_BT, 0, C - 1), 1)
    tokens_BT = jnp.where(in_prompt, prompt_part, jnp.where(in_completion, completion_part, 0))
    segment_ids_BT = (in_prompt | in_completion).astype(jnp.int32)
    predict_at_BC = prompt_lengths_B[:, None] - 1 + jnp.arange(C)[None, :]
    return tokens_BT.astype(jnp.int32), segment_ids_BT, predict_at_BC


# log-prob of a recorded token that lies outside the learner's own top-k / top-p set: finite, so the
# loss's products stay finite, and low enough that exp(it - logp_rollout) == 0 (ratio 0: masked)
OUTSIDE_SUPPORT_LOGP = -1e9


def completion_logprobs(model, variables, prompt_BP, prompt_lengths_B, completion_BC, completion_lengths_B,
                        sampler: Sampler, replay=None):
    """log π(c_j | prompt, c_<j) under the sampling distribution `sampler` describes: the logits at
    ``sampler.temperature``, restricted and renormalised to its top-k / top-p set (`Sampler.log_probs`,
    the function the generator samples with), float32 [B, C] (garbage after each end: multiply by a
    mask). The learner's recomputation of the sampler's behaviour log-probs: the policy trained is the
    truncated distribution the generator actually samples from, so on-policy π_θ / π_rollout = 1 at any
    top_p / top_k. A token outside the learner's kept set gets OUTSIDE_SUPPORT_LOGP (ratio 0). ``replay``: the
    sampler's recorded routing per position of these rows ({name: [B, P + C, L, X]}, `routing_replay.extract`),
    replayed by the forward instead of recomputed."""
    if sampler.greedy:
        raise ValueError("completion_logprobs needs a sampling temperature > 0 (greedy has no sampling log-probs)")
    tokens, segment_ids, predict_at = sequence_layout(prompt_BP, prompt_lengths_B, completion_BC,
                                                      completion_lengths_B)
    extra = {"replay": routing_replay.to_tree(model.cfg, replay)} if replay else {}
    logits_BTV = model.apply(variables, tokens, segment_ids=segment_ids, **extra).logits
    logits_BCV = jnp.take_along_axis(logits_BTV, predict_at[..., None], axis=1).astype(jnp.float32)
    logp_BCV = sampler.log_probs(logits_BCV)
    logp_BC = jnp.take_along_axis(logp_BCV, completion_BC[..., None], axis=-1)[..., 0]
    return jnp.where(jnp.isfinite(logp_BC), logp_BC, OUTSIDE_SUPPORT_LOGP)


def params_sha256(variables) -> str:
    """sha256 over every leaf's path, dtype, shape and bytes (host copy), in tree order."""
    digest = hashlib.sha256()
    leaves, _ = jax.tree_util.tree_flatten_with_path(variables)
    for path, leaf in leaves:
        a = np.asarray(jax.device_get(leaf))
        digest.update(f"{jax.tree_util.keystr(path)}|{a.dtype}|{a.shape}|".encode())
        digest.update(np.ascontiguousarray(a).tobytes())
    return digest.hexdigest()
