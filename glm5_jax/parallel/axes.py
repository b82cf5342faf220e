"""The logical axis names: the one vocabulary model code shards with. Model code names these, never a mesh;
`glm5_jax.parallel.mesh.DEFAULT_RULES` maps each to mesh axes (or none: replicated).
"""
# Activations:
BATCH = "batch"              # rows of a batch
SEQ = "seq"                  # training tokens of a row (split by context parallelism)
CACHE_SEQ = "cache_seq"      # decode-cache slots
ACT_EMBED = "act_embed"      # the residual stream's width
ACT_HEADS = "act_heads"      # attention heads of activations
ACT_MLP = "act_mlp"          # the FFN's hidden width in activations
ACT_VOCAB = "act_vocab"      # logits' vocabulary dimension

# Parameters:
EMBED = "embed"              # the model width (hidden_size)
VOCAB = "vocab"              # the embedding / head vocabulary
HEADS = "heads"              # attention heads of the MLA up-projections
INDEX_HEADS = "index_heads"  # the lightning indexer's heads
MLP = "mlp"                  # dense FFN / shared expert hidden width
EXP = "exp"                  # routed experts
MLP_MOE = "mlp_moe"          # a routed expert's hidden width
Q_LORA = "q_lora"            # the query LoRA rank
KV_LORA = "kv_lora"          # the latent (kv LoRA) rank
KV = "kv"                    # per-head widths (qk_nope, qk_rope, v) and the latent row
O_KV = "o_kv"                # the output projection's per-head value width (o_proj's middle axis)
INDEX_DIM = "index_dim"      # the indexer's head width
MTP_CONCAT = "mtp_concat"    # the MTP module's [embedding; hidden] concatenation
LAYERS = "layers"            # the stacked-layer axis of a scanned segment
KDA_QKV = "kda_qkv"          # a KDA layer's flat heads x head width (q, k, v, gates; head-major)
HC_EMBED = "hc_embed"        # the hyper-connections' flattened streams x model width

ALL = (BATCH, SEQ, CACHE_SEQ, ACT_EMBED, ACT_HEADS, ACT_MLP, ACT_VOCAB, EMBED, VOCAB, HEADS, INDEX_HEADS, MLP, EXP,
       MLP_MOE, Q_LORA, KV_LORA, KV, O_KV, INDEX_DIM, MTP_CONCAT, LAYERS, KDA_QKV,
       HC_EMBED)
