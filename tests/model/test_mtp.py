"""MTP logits equal a direct computation built from HF modules: per depth k,
h^k = Block(eh_proj([enorm(emb(t_{i+k})), hnorm(h^{k-1})])), logits = head(shared_head.norm(h^k)).

An HF model with L + 1 layers supplies the main stack (layers 0..L-1) and, as layer L, the MTP decoder
block; enorm / hnorm / eh_proj / shared_head.norm are added as the hub checkpoints store them
(model.layers.L.{enorm,hnorm,eh_proj,shared_head.norm}).
"""
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import torch
from safetensors.torch import save_file
from transformers import GlmMoeDsaForCausalLM

from glm5_jax import Transformer, load_hf
from hf_reference import build_hf_model

L = 4


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _make_mtp_checkpoint(tmp_path):
    big = build_hf_model("grouped", num_hidden_layers=L + 1)
    big.save_pretrained(tmp_path / "big")
    d = big.config.hidden_size
    torch.manual_seed(7)
    extras = {f"model.layers.{L}.enorm.weight": 1 + 0.1 * torch.randn(d),
              f"model.layers.{L}.hnorm.weight": 1 + 0.1 * torch.randn(d),
              f"model.layers.{L}.eh_proj.weight": 0.05 * torch.randn(d, 2 * d),
              f"model.layers.{L}.shared_head.norm.weight": 1 + 0.1 * torch.randn(d)}
    out = tmp_path / "with_mtp"
    shutil.copytree(tmp_path / "big", out)
    save_file(extras, out / "mtp_extras.safetensors")
    config = json.loads((out / "config.json").read_text())
    config.update(num_hidden_layers=L, num_nextn_predict_layers=1,
                  mlp_layer_types=config["mlp_layer_types"][:L], indexer_types=config["indexer_types"][:L])
    (out / "config.json").write_text(json.dumps(config))
    return big, extras, out


def _direct_mtp_logits(big, extras, ids, depth):
    cfg = big.config
    main_cfg = type(cfg)(**{**cfg.to_dict(), "num_hidden_layers": L,
                            "mlp_layer_types": cfg.mlp_layer_types[:L], "indexer_types": cfg.indexer_types[:L],
                            "layer_types": cfg.layer_types[:L]})
    main = GlmMoeDsaForCausalLM(main_cfg).eval()
    missing, unexpected = main.load_state_dict(big.state_dict(), strict=False)
    assert not missing and all(k.startswith(f"model.layers.{L}.") for k in unexpected)
    block, eps = big.model.layers[L], cfg.rms_norm_eps
    ids = torch.as_tensor(ids)
    T = ids.shape[1]
    pos = torch.arange(T)[None]
    mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
    out = []
    with torch.no_grad():
        h = main.model(ids).last_hidden_state                      # post-final-norm h^0
        main_logits = main.lm_head(h).numpy()
        for k in range(1, depth + 1):
            shifted = torch.cat([ids[:, k:], torch.zeros_like(ids[:, :k])], dim=1)
            e = _rms(big.model.embed_tokens(shifted), extras[f"model.layers.{L}.enorm.weight"], eps)
            g = _rms(h, extras[f"model.layers.{L}.hnorm.weight"], eps)
            u = torch.cat([e, g], -1) @ extras[f"model.layers.{L}.eh_proj.weight"].T   # [emb, hidden] order
            h, _ = block(u, attention_mask=mask, position_embeddings=big.model.rotary_emb(u, pos), position_ids=pos)
            normed = _rms(h, extras[f"model.layers.{L}.shared_head.norm.weight"], eps)
            out.append(big.lm_head(normed).numpy())
    return main_logits, np.stack(out)


def test_mtp_logits_match_direct_computation(tmp_path):
    big, extras, path = _make_mtp_checkpoint(tmp_path)
    cfg, variables = load_hf(str(path), mtp_depth=2)      # the shared module applied recursively twice
    assert cfg.num_nextn_predict_layers == 1
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 4 * cfg.index_topk))
    out = jax.jit(lambda v, t: Transformer(cfg).apply(v, t, with_mtp=True))(variables, jnp.asarray(ids))
    ref_main, ref_mtp = _direct_mtp_logits(big, extras, ids, depth=2)
    np.testing.assert_allclose(np.asarray(out.logits), ref_main, atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(out.mtp_logits), ref_mtp, atol=1e-4, rtol=0)
