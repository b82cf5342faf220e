"""glm5_jax/train/losses.py against transformers' causal-LM loss: the next-token loss of a packed row equals
HF's ``labels=`` loss of each segment run alone (token-weighted), and each MTP depth's loss equals HF's
loss function applied to that segment with the labels moved k - 1 further ahead (depth d predicts t + d + 1)."""
import jax.numpy as jnp
import numpy as np
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from glm5_jax.data import Batch
from glm5_jax.model.config import ModelConfig, RuntimeConfig
from glm5_jax.model.transformer import ModelOutput, lay_out_batch, positions_from_segments
from glm5_jax.train.experiment import TrainConfig
from glm5_jax.train.losses import lm_losses
from glm5_jax.train.stage import stage_spec
from hf_reference import build_hf_model

# one packed row of two segments and padding, and a second row holding one segment
SEGMENTS = [[(1, 11), (2, 7)], [(1, 15)]]
T, MTP_DEPTH = 20, 2


def packed_batch(vocab, rng):
    tokens = np.zeros((len(SEGMENTS), T), np.int32)
    segment_ids = np.zeros((len(SEGMENTS), T), np.int32)
    pieces = []                                            # (row, start, length) of every segment
    for b, row in enumerate(SEGMENTS):
        start = 0
        for seg, length in row:
            tokens[b, start:start + length] = rng.integers(2, vocab, length)
            segment_ids[b, start:start + length] = seg
            pieces.append((b, start, length))
            start += length
    return tokens, segment_ids, pieces


def hf_sum_loss(logits_LV, tokens_L, ahead):
    """Sum over positions t of -log p(tokens[t + ahead]) with HF's loss (which shifts labels by one)."""
    L = len(tokens_L) - (ahead - 1)
    loss = ForCausalLMLoss(torch.as_tensor(np.asarray(logits_LV[None, :L])),
                           torch.as_tensor(tokens_L[None, ahead - 1:]).long(), vocab_size=logits_LV.shape[-1],
                           num_items_in_batch=torch.tensor(1))
    return float(loss), L - 1


def test_next_token_and_mtp_losses_equal_transformers():
    model = build_hf_model("grouped")
    V = model.config.vocab_size
    rng = np.random.default_rng(0)
    tokens, segment_ids, pieces = packed_batch(V, rng)
    # next-token logits: the HF model's own, per segment; MTP logits: random (HF has no MTP module)
    logits = rng.standard_normal((len(SEGMENTS), T, V)).astype(np.float32) * 3
    hf_total, hf_count = 0.0, 0
    for b, start, length in pieces:
        ids = torch.as_tensor(tokens[b:b + 1, start:start + length]).long()
        with torch.no_grad():
            out = model(input_ids=ids, labels=ids)
        logits[b, start:start + length] = out.logits[0].numpy()
        hf_total += float(out.loss) * (length - 1)
        hf_count += length - 1
    mtp_logits = rng.standard_normal((MTP_DEPTH,) + logits.shape).astype(np.float32) * 3

    train_cfg = TrainConfig(mtp_loss_weight=0.3, balance_loss_weight=0.0)
    model_cfg = ModelConfig(vocab_size=V, mtp_depth=MTP_DEPTH, runtime=RuntimeConfig(indexer_loss="none"))
    out = ModelOutput(logits=jnp.asarray(logits), stats=None, mtp_logits=jnp.asarray(mtp_logits))
    batch = Batch(tokens=tokens, segment_ids=segment_ids, positions=positions_from_segments(segment_ids))
    total, parts = lm_losses(out, lay_out_batch(model_cfg, batch), train_cfg, model_cfg, stage_spec("sparse"))

    np.testing.assert_allclose(float(parts["lm_loss"]), hf_total / hf_count, rtol=1e-5)
    assert int(parts["tokens"]) == hf_count == sum(length - 1 for _, _, length in pieces)
    depth_losses = []
    for d in range(MTP_DEPTH):
        sums = [hf_sum_loss(mtp_logits[d, b, start:start + length], tokens[b, start:start + length], d + 2)
                for b, start, length in pieces]
        depth_losses.append(sum(s for s, _ in sums) / sum(n for _, n in sums))
    assert abs(depth_losses[0] - depth_losses[1]) > 1e-3, "the depths' targets differ"
    np.testing.assert_allclose(float(parts["mtp_loss"]), np.mean(depth_losses), rtol=1e-5)
    np.testing.assert_allclose(float(total), hf_total / hf_count + 0.3 * np.mean(depth_losses), rtol=1e-5)
