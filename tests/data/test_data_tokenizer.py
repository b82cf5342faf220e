import json
import os

import pytest
import tokenizers

from glm5_jax.data import DataError, DocumentReader, Tokenizer, cached_bpe, load_tokenizer, stdlib_documents
from glm5_jax.data.tokenizer import EOS_TOKEN, PAD_TOKEN, bpe_settings


def _stdlib_text(*keys):
    docs = {d.key: d for d in stdlib_documents()}
    reader = DocumentReader("text")
    return [reader.read(docs[k]) for k in keys]


def test_round_trip_on_stdlib_text(small_pipeline):
    tok = small_pipeline.tokenizer
    assert tok.vocab_size == 512 and tok.eos_id == 1 and tok.hf.token_to_id(PAD_TOKEN) == 0
    texts = _stdlib_text("stdlib/json/decoder.py", "stdlib/textwrap.py",
                         "stdlib/test/encoded_modules/module_koi8_r.py")  # the last has invalid UTF-8 -> U+FFFD
    for text in texts:
        ids = tok.encode(text)
        assert ids.dtype.name == "int32" and 0 < len(ids) < len(text.encode())  # merges compress
        assert tok.decode(ids) == text
    assert tok.eos_id not in set(tok.encode("".join(texts)).tolist())


def test_special_token_text_is_not_an_eos(small_pipeline):
    tok = small_pipeline.tokenizer
    text = f"x = '{EOS_TOKEN}'\n"
    ids = tok.encode(text)
    assert tok.eos_id not in ids.tolist()
    assert tok.decode(ids) == text


def test_cache_reuses_trained_bpe_and_retrains_on_new_settings(tmp_path):
    texts = _stdlib_text("stdlib/json/decoder.py", "stdlib/json/encoder.py", "stdlib/textwrap.py")
    calls = []

    def corpus():
        calls.append(1)
        return iter(texts)

    settings = bpe_settings(600, "fingerprint-a")
    first = cached_bpe(str(tmp_path), settings, corpus, len(texts), show_progress=False)
    (entry,) = os.listdir(tmp_path)
    tokenizer_file = tmp_path / entry / "tokenizer.json"
    mtime = os.stat(tokenizer_file).st_mtime_ns
    assert json.loads((tmp_path / entry / "settings.json").read_text()) == settings
    assert not [f for f in os.listdir(tmp_path / entry) if f.startswith(".tmp")], "no temp files left"

    second = cached_bpe(str(tmp_path), settings, corpus, len(texts), show_progress=False)
    assert len(calls) == 1, "second call must load the cache, not retrain"
    assert os.stat(tokenizer_file).st_mtime_ns == mtime
    assert second.hf.get_vocab() == first.hf.get_vocab()
    assert second.encode(texts[0]).tolist() == first.encode(texts[0]).tolist()

    cached_bpe(str(tmp_path), bpe_settings(600, "fingerprint-b"), corpus, len(texts), show_progress=False)
    assert len(calls) == 2, "a different corpus fingerprint retrains"
    assert len(os.listdir(tmp_path)) == 2


def test_load_user_tokenizer(tokenizer_file, small_pipeline, tmp_path):
    loaded = load_tokenizer(tokenizer_file)
    assert loaded.vocab_size == small_pipeline.tokenizer.vocab_size and loaded.eos_id == 1
    text = "def f(x):\n    return x + 1\n"
    assert loaded.encode(text).tolist() == small_pipeline.tokenizer.encode(text).tolist()
    assert load_tokenizer(os.path.dirname(tokenizer_file)).eos_id == 1  # a folder holding tokenizer.json
    with pytest.raises(DataError, match="tokenizer file does not exist"):
        load_tokenizer(str(tmp_path / "nope.json"))
    with pytest.raises(DataError, match="no end-of-document token '</s>'"):
        load_tokenizer(tokenizer_file, eos_token="</s>")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path / "bad.json"))


def test_wrapper_rejects_tokenizer_without_eos():
    with pytest.raises(DataError, match="end-of-document token"):
        Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE()))
