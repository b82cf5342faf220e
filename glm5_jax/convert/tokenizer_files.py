"""The tokenizer files a converted checkpoint carries, so that it is usable without the original.

* hf-to-orbax copies the source's tokenizer files (those of `TOKENIZER_FILES` it has) beside the orbax steps,
  where `glm5_jax.checkpoint.inference.checkpoint_tokenizer` finds them for generate and serve.
* orbax-to-hf writes them into the export, so that ``AutoTokenizer.from_pretrained(export)`` (and vLLM,
  SGLang) load the tokenizer the model was trained with: a tokenizer that came with its own
  ``tokenizer_config.json`` (a hub checkpoint's) is copied as it is; the byte-level BPE a train.py run
  trained (a bare ``tokenizer.json``) gets a ``tokenizer_config.json`` naming its special tokens by the ids of
  the exported config.json, and encoding special-token text as text, as `glm5_jax.data.tokenizer.Tokenizer`
  does.
"""
from __future__ import annotations

import json
import logging

import tokenizers

from glm5_jax import storage
from glm5_jax.checkpoint.errors import CheckpointError
from glm5_jax.checkpoint.inference import checkpoint_tokenizer

log = logging.getLogger("glm5_jax.convert")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")
SPECIAL_TOKEN_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "pad_token": "pad_token_id"}


def copy_tokenizer_files(src_dir: str, out_dir: str) -> list[str]:
    """Copies the tokenizer files `src_dir` has into `out_dir`; their names."""
    names = [n for n in TOKENIZER_FILES if storage.isfile(storage.join(src_dir, n))]
    for name in names:
        storage.copy_file(storage.join(src_dir, name), storage.join(out_dir, name))
    return names


def export_tokenizer_config(tokenizer_json: str, hf_config: dict) -> dict:
    """The tokenizer_config.json transformers needs beside a bare tokenizer.json: its special tokens are the
    tokens of the model config's ids (the first of several EOS ids)."""
    tokenizer = tokenizers.Tokenizer.from_str(storage.read_text(tokenizer_json))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              # our Tokenizer encodes "<|endoftext|>" in a text as text, never as the EOS id
              "split_special_tokens": True, "model_max_length": hf_config.get("max_position_embeddings")}
    for name, key in SPECIAL_TOKEN_IDS.items():
        ids = hf_config.get(key)
        ids = [i for i in (ids if isinstance(ids, list) else [ids]) if i is not None]
        token = tokenizer.id_to_token(ids[0]) if ids else None
        if ids and token is None:
            log.warning("%s=%s of config.json is not in the tokenizer's vocabulary (%d tokens); the exported "
                        "tokenizer has no %s", key, ids[0], tokenizer.get_vocab_size(), name)
        config[name] = token
    return config


def write_export_tokenizer(ckpt_dir: str, out_dir: str, hf_config: dict, tokenizer: str | None = None) -> None:
    """Writes the tokenizer of the checkpoint at `ckpt_dir` (or `tokenizer`: a tokenizer.json or a directory
    of tokenizer files) into the export `out_dir`; without one, a warning says how to give it."""
    if tokenizer is None:
        try:
            tokenizer = checkpoint_tokenizer(ckpt_dir)
        except CheckpointError as e:
            log.warning("the export carries no tokenizer (%s); pass --tokenizer=PATH, or give loaders the "
                        "original one", e)
            return
    tokenizer_json = storage.join(tokenizer, "tokenizer.json") if storage.isdir(tokenizer) else tokenizer
    if not storage.isfile(tokenizer_json):
        raise CheckpointError(f"--tokenizer={tokenizer}: no such file {tokenizer_json}")
    folder = storage.dirname(tokenizer_json)
    if storage.isfile(storage.join(folder, "tokenizer_config.json")):
        copy_tokenizer_files(folder, out_dir)
        return
    storage.copy_file(tokenizer_json, storage.join(out_dir, "tokenizer.json"))
    storage.write_atomically(storage.join(out_dir, "tokenizer_config.json"),
                             json.dumps(export_tokenizer_config(tokenizer_json, hf_config), indent=2).encode())
