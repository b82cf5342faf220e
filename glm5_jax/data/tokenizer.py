"""Tokenizer: a byte-level BPE trained on the corpus (cached in the workdir) or a user tokenizer.json."""
from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Callable, Iterable, Sequence

import numpy as np
import tokenizers

from glm5_jax import storage
from glm5_jax.data.config import DataError

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN)  # ids 0 and 1 in a trained BPE: padding is token 0
CACHE_FORMAT = 1
log = logging.getLogger(__name__)   # under "glm5_jax": train.py prints these lines


class Tokenizer:
    """Thin wrapper over a HF `tokenizers.Tokenizer` with the ids the pipeline needs."""

    def __init__(self, hf_tokenizer: tokenizers.Tokenizer, eos_token: str = EOS_TOKEN):
        eos_id = hf_tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise DataError(f"tokenizer has no end-of-document token {eos_token!r} (set DataConfig.eos_token)")
        self.hf = hf_tokenizer
        # Document text that happens to contain "<|endoftext|>" must not turn into the real EOS id.
        self.hf.encode_special_tokens = True
        self.eos_id = eos_id
        self.eos_token = eos_token

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> np.ndarray:
        """int32 ids of `text`, without any special tokens (no BOS/EOS)."""
        return np.asarray(self.hf.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str) -> None:
        _write_atomically(path, self.hf.to_str())


def load_tokenizer(path: str, eos_token: str = EOS_TOKEN) -> Tokenizer:
    """A user tokenizer: a HF `tokenizer.json` file, or a directory holding one."""
    if storage.isdir(path):
        path = storage.join(path, "tokenizer.json")
    if not storage.isfile(path):
        raise DataError(f"tokenizer file does not exist: {path}")
    try:
        hf = tokenizers.Tokenizer.from_str(storage.read_text(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise DataError(f"cannot load tokenizer {path}: {e}") from None
    return Tokenizer(hf, eos_token)


def train_bpe(texts: Iterable[str], vocab_size: int, num_texts: int | None = None,
              show_progress: bool = True) -> Tokenizer:
    """Trains a byte-level BPE (GPT-2 style pre-tokenization, lossless decode) on `texts`."""
    hf = tokenizers.Tokenizer(tokenizers.models.BPE())
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=show_progress)
    hf.train_from_iterator(texts, trainer=trainer, length=num_texts)
    return Tokenizer(hf, EOS_TOKEN)


def _write_atomically(path: str, text: str) -> None:
    storage.write_atomically(path, text.encode())


def bpe_settings(vocab_size: int, corpus_fingerprint: str) -> dict:
    """What a cached BPE must match to be reused."""
    return {"format": CACHE_FORMAT, "kind": "byte_level_bpe", "vocab_size": vocab_size,
            "special_tokens": list(SPECIAL_TOKENS), "min_frequency": 2,
            "corpus_fingerprint": corpus_fingerprint}


def cached_bpe(cache_root: str, settings: dict, texts: Callable[[], Iterable[str]],
               num_texts: int | None = None, show_progress: bool = True) -> Tokenizer:
    """Loads the BPE cached under `cache_root` for `settings`, or trains it with `texts()` and caches it.

    Layout: `<cache_root>/bpe-<hash of settings>/{tokenizer.json, settings.json}`. settings.json is
    written last, so its presence (with equal content) marks a complete cache entry.
    """
    blob = json.dumps(settings, sort_keys=True)
    folder = storage.join(cache_root, "bpe-" + hashlib.sha256(blob.encode()).hexdigest()[:16])
    tokenizer_file = storage.join(folder, "tokenizer.json")
    settings_file = storage.join(folder, "settings.json")
    if storage.isfile(settings_file) and storage.isfile(tokenizer_file):
        if json.loads(storage.read_text(settings_file)) == settings:
            log.info("data: reusing cached tokenizer %s", tokenizer_file)
            return load_tokenizer(tokenizer_file, EOS_TOKEN)
    log.info("data: training byte-level BPE (vocab %d) on %s documents -> %s",
             settings["vocab_size"], num_texts if num_texts is not None else "?", tokenizer_file)
    start = time.perf_counter()
    tokenizer = train_bpe(texts(), settings["vocab_size"], num_texts, show_progress)
    log.info("data: BPE trained in %.1f s (vocab %d)", time.perf_counter() - start, tokenizer.vocab_size)
    tokenizer.save(tokenizer_file)
    _write_atomically(settings_file, json.dumps(settings, sort_keys=True, indent=1))
    return tokenizer
