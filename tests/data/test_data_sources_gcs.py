"""Data sources and the tokenizer cache on gs:// (a GCS emulator): the same documents, texts and batches as
from a local copy; an ArrayRecord source on gs:// is refused with an error naming the limitation."""
import json

import pytest
from test_data_sources import SEQ, TEXTS, _pipeline_segments

from glm5_jax import storage
from glm5_jax.data import DataConfig, DocumentReader, index_sources
from glm5_jax.data.config import DataError


def _upload(local_dir, remote_dir):
    for d, _, names in storage.walk(str(local_dir)):
        for n in names:
            src = storage.join(d, n)
            storage.copy_file(src, storage.join(remote_dir, src[len(str(local_dir)) + 1:]))


def test_text_and_jsonl_sources_and_tokenizer_cache_on_gcs(tmp_path, gcs_dir):
    local = tmp_path / "data"
    (local / "corpus" / "sub").mkdir(parents=True)
    (local / "corpus" / "a.txt").write_text(TEXTS[0])
    (local / "corpus" / "sub" / "b.py").write_text(TEXTS[1])
    (local / "corpus" / ".hidden").write_text("never read")
    (local / "docs.jsonl").write_text("\n".join(json.dumps({"text": t * 20}) for t in TEXTS) + "\n")
    remote = storage.join(gcs_dir, "data")
    _upload(local, remote)

    sources = {where: (storage.join(root, "corpus"), storage.join(root, "docs.jsonl"))
               for where, root in (("local", str(local)), ("gs", remote))}
    docs = {where: index_sources(list(s), "text") for where, s in sources.items()}
    strip = {"local": str(local), "gs": remote}
    assert [d.key.replace(strip["gs"], "") for d in docs["gs"]] == \
        [d.key.replace(strip["local"], "") for d in docs["local"]]
    assert len(docs["gs"]) == 2 + len(TEXTS)
    assert [DocumentReader("text").read(d) for d in docs["gs"]] == \
        [DocumentReader("text").read(d) for d in docs["local"]]

    # a trained BPE cached in a gs:// workdir, then reused from it; batches equal the local run's
    found = {}
    for where, workdir in (("local", str(tmp_path / "work")), ("gs", storage.join(gcs_dir, "work"))):
        config = DataConfig(source=sources[where], vocab_size=512, seq_len=SEQ, batch_size=2, eval_fraction=0.0)
        data, _, found[where] = _pipeline_segments(config, workdir)
    assert found["gs"] == found["local"]
    cache = storage.glob(storage.join(gcs_dir, "work", "tokenizer"), "bpe-*")
    assert len(cache) == 1 and sorted(storage.listdir(cache[0])) == ["settings.json", "tokenizer.json"]
    config = DataConfig(source=sources["gs"], vocab_size=512, seq_len=SEQ, batch_size=2, eval_fraction=0.0)
    assert _pipeline_segments(config, storage.join(gcs_dir, "work"))[2] == found["local"]     # from the cache


def test_array_record_on_gcs_is_refused(gcs_dir):
    path = storage.join(gcs_dir, "tokens.arrayrecord")
    storage.write_atomically(path, b"not read")
    with pytest.raises(DataError, match="array_record reads local files only"):
        index_sources([path], "text")
