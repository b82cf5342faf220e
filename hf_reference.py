"""Tiny random HF GLM-MoE-DSA models, saved with save_pretrained: the numerical ground truth.

Shared by tests/ and bench/ (both put the repository root on sys.path), so it lives at the root: neither
imports the other, and this torch code stays out of the installed packages (glm5_jax, pallas_kernels)."""
import numpy as np
import torch
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

# The reference script's tiny shapes (spec/verify_glm_moe_dsa_reference.py), with 16 indexer heads:
# a key whose every indexer head is ReLU-zero scores exactly 0, and torch.topk and lax.top_k break
# such exact ties differently. With 16 heads that happens for ~1 key in 65k, so selections are
# comparable; `assert_no_boundary_ties` checks it for every compared row.
BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
            qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20, index_n_heads=16, index_head_dim=32,
            max_position_embeddings=512, rope_parameters={"rope_theta": 1_000_000.0, "rope_type": "default"},
            attn_implementation="eager", experts_implementation="eager")

CONFIGS = {
    # dense + MoE layers, n_group 2 / topk_group 1, shared indexer layers (index_topk_freq 2)
    "shared_index": dict(num_hidden_layers=5, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                         n_group=2, topk_group=1, index_topk=8, index_topk_freq=2),
    # more groups, two shared experts, every layer full
    "grouped": dict(num_hidden_layers=4, first_k_dense_replace=2, n_routed_experts=16, num_experts_per_tok=4,
                    n_group=4, topk_group=2, n_shared_experts=2, index_topk=12),
}


def build_hf_model(name: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    cfg = GlmMoeDsaConfig(**{**BASE, **CONFIGS[name], **overrides})
    return perturbed(GlmMoeDsaForCausalLM(cfg))


def perturbed(model, layers=None, also=()):
    """`model` in eval mode with its norms, biases and routing bias moved off their initial values (the
    matrices are random already); ``also``: name parts of matrices initialised to constants, moved too.
    ``layers``: the decoder layers (default ``model.model.layers``)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or any(part in name for part in also):
                p.add_(0.1 * torch.randn_like(p))
        for layer in model.model.layers if layers is None else layers:
            if hasattr(layer.mlp, "gate"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(0.05 * torch.randn_like(bias))
    return model.eval()


def hf_logits(model, ids, attention_mask=None):
    with torch.no_grad():
        out = model(torch.as_tensor(ids), attention_mask=None if attention_mask is None else torch.as_tensor(attention_mask))
    return out.logits.numpy()


def assert_no_boundary_ties(model, ids):
    """Every full indexer's k-th and (k+1)-th visible scores differ (else top-k order is arbitrary)."""
    captured = []
    hooks = [layer.self_attn.indexer.register_forward_hook(
        lambda mod, args, out: captured.append((mod, args))) for layer in model.model.layers
        if layer.self_attn.indexer is not None]
    real_topk = torch.Tensor.topk
    scores_seen = []

    def spy_topk(self, k, dim=-1, *a, **kw):
        scores_seen.append((self.detach().clone(), k))
        return real_topk(self, k, dim, *a, **kw)

    torch.Tensor.topk = spy_topk
    try:
        hf_logits(model, ids)
    finally:
        torch.Tensor.topk = real_topk
        for h in hooks:
            h.remove()
    checked = 0
    for scores, k in scores_seen:
        if scores.shape[-1] <= k or scores.dtype != torch.float32 or scores.dim() != 3:
            continue   # router top-k or a short sequence: no selection boundary
        s = np.sort(scores.numpy(), axis=-1)[..., ::-1]
        kth, next_ = s[..., k - 1], s[..., k]
        visible = np.isfinite(next_) & (next_ > -1e30)
        assert not np.any((kth == next_) & visible), "exact top-k tie at the selection boundary"
        checked += 1
    assert checked > 0
