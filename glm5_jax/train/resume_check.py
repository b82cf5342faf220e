"""Before a run resumes a workdir: the config stored with its latest checkpoint must describe the same
parameters, optimizer-state tree and tokens as this run's, else a `ConfigError` names every differing field.

Refused (`IDENTITY_FIELDS`): the model fields that shape a parameter, the optimizer and DSA stage (they shape
the optimizer state), and the data fields that decide the corpus the BPE was trained on and so what every
token id means. Everything else may change on resume: train.steps, the schedule, intervals, profiling,
batch size, mesh, runtime settings (attention_impl, remat, dtype), model.quant (int4_qat fake-quantises
the same weights), train.init_from (unused once the workdir has a checkpoint).
"""
from __future__ import annotations

import orbax.checkpoint as ocp

from glm5_jax import storage
from glm5_jax.checkpoint.inference import step_json_meta
from glm5_jax.checkpoint.run import config_as_json
from glm5_jax.model.config import ConfigError

IDENTITY_FIELDS = {
    "model": ("vocab_size", "hidden_size", "num_hidden_layers", "first_k_dense_replace", "intermediate_size",
              "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim", "use_indexer", "index_n_heads", "index_head_dim", "indexer_types",
              "n_routed_experts", "n_shared_experts", "moe_intermediate_size", "num_nextn_predict_layers",
              "tie_word_embeddings"),
    "train": ("stage", "optimizer"),
    "data": ("source", "text_field", "text_document_bytes", "max_corpus_bytes", "eval_fraction", "min_eval_docs",
             "tokenizer_path", "vocab_size", "eos_token"),
}


def latest_stored_config(workdir: str) -> tuple[int | None, dict | None]:
    """(newest committed step of the workdir's checkpoints, the experiment config stored with it), read
    without creating anything; (None, None) for a workdir without checkpoints."""
    directory = storage.join(workdir, "checkpoints")
    if not storage.isdir(directory):
        return None, None
    steps = ocp.path.step.checkpoint_steps(storage.path(storage.absolute(directory)))
    if not steps:
        return None, None
    step = max(steps)
    config = (step_json_meta(storage.join(directory, str(step)), "config") or {}).get("config")
    return step, config if isinstance(config, dict) else None


def config_differences(stored: dict, current: dict) -> list[str]:
    """'group.field stored != current' for each identity field the two configs hold with different values
    (a field a stored config predates is not compared)."""
    found = []
    for group, names in IDENTITY_FIELDS.items():
        old, new = stored.get(group) or {}, current.get(group) or {}
        for name in names:
            if name in old and name in new and old[name] != new[name]:
                found.append(f"{group}.{name} {old[name]!r} != {new[name]!r}")
    return found


def check_resumable(exp_cfg, workdir: str) -> None:
    """A ConfigError when `workdir` holds checkpoints of a run whose parameters or tokens differ from
    `exp_cfg`'s (restoring them would fail on a shape, or silently read other token ids)."""
    step, stored = latest_stored_config(workdir)
    if stored is None:
        return
    differences = config_differences(stored, config_as_json(exp_cfg))
    if differences:
        raise ConfigError(f"{workdir} holds a run of another configuration (step {step}, stored != this run): "
                          f"{', '.join(differences)}; use another --workdir or the same config")
