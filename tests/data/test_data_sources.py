import json

import numpy as np
import pytest

from data_helpers import check_row_invariants, expected_chunks, segments_of
from glm5_jax.data import (DataConfig, DataError, DocumentReader, build_data_pipeline, index_sources,
                           load_documents, make_dataset, write_token_records)

SEQ = 32
TEXTS = ["def add(a, b):\n    return a + b\n" * 5, "import os\nprint(os.getcwd())\n",
         "class Point:\n    x: int = 0\n    y: int = 0\n" * 3, "# just a comment\n"]


def _all_segments(dataset):
    found = None
    for batch in iter(dataset):
        check_row_invariants(batch, batch.tokens.shape[0], SEQ)
        found = segments_of(batch) if found is None else found + segments_of(batch)
    return found


def _pipeline_segments(config, workdir):
    data = build_data_pipeline(config, workdir, process_index=0, process_count=1, show_progress=False)
    docs = data.train_documents + data.eval_documents
    ds = make_dataset(config, docs, data.tokenizer, train=False, process_index=0, process_count=1)
    return data, docs, _all_segments(ds)


def test_text_files_and_directories(tmp_path, tokenizer_file):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text(TEXTS[0])
    (corpus / "sub" / "b.py").write_text(TEXTS[1])
    (corpus / "empty.txt").write_text("")
    (corpus / ".hidden").write_text("never read")
    single = tmp_path / "single.md"
    single.write_text(TEXTS[2])
    docs = index_sources([str(corpus), str(single)], "text")
    assert [d.key for d in docs] == [f"{corpus}/a.txt", f"{corpus}/sub/b.py", str(single)]
    assert [DocumentReader("text").read(d) for d in docs] == [TEXTS[0], TEXTS[1], TEXTS[2]]

    config = DataConfig(source=(str(corpus), str(single)), tokenizer_path=tokenizer_file, seq_len=SEQ,
                        batch_size=2, eval_fraction=0.0)
    data, docs, found = _pipeline_segments(config, str(tmp_path / "work"))
    assert found == expected_chunks(docs, data.tokenizer, SEQ)


def test_jsonl_with_configurable_text_field(tmp_path, tokenizer_file):
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"content": t, "id": i}) for i, t in enumerate(TEXTS)]
    path.write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n")  # a blank line is skipped
    docs = index_sources([str(path)], "content")
    assert [d.key for d in docs] == [f"{path}:1", f"{path}:3", f"{path}:4", f"{path}:5"]
    assert [DocumentReader("content").read(d) for d in docs] == TEXTS

    config = DataConfig(source=str(path), text_field="content", tokenizer_path=tokenizer_file, seq_len=SEQ,
                        batch_size=2, eval_fraction=0.25, min_eval_docs=1)
    data, docs, found = _pipeline_segments(config, str(tmp_path / "work"))
    assert len(data.eval_documents) == 1 and len(data.train_documents) == 3
    assert found == expected_chunks(docs, data.tokenizer, SEQ, text_field="content")


def test_jsonl_trains_its_own_tokenizer(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": t * 20}) for t in TEXTS) + "\n")
    config = DataConfig(source=str(path), vocab_size=512, seq_len=SEQ, batch_size=2, eval_fraction=0.0)
    data, docs, found = _pipeline_segments(config, str(tmp_path / "work"))
    assert data.tokenizer.eos_id == 1 and data.tokenizer.decode(data.tokenizer.encode(TEXTS[2])) == TEXTS[2]
    assert found == expected_chunks(docs, data.tokenizer, SEQ)
    assert (tmp_path / "work" / "tokenizer").is_dir()


def test_array_record_pre_tokenized_documents(tmp_path, tokenizer_file, small_pipeline):
    tok = small_pipeline.tokenizer
    records = [tok.encode(t) for t in TEXTS] + [np.arange(2, 100, dtype=np.int32)]
    path = tmp_path / "tokens.arrayrecord"
    write_token_records(str(path), records)
    docs = index_sources([str(path)], "text")
    assert [d.key for d in docs] == [f"{path}#{i}" for i in range(len(records))]
    for doc, want in zip(docs, records):
        np.testing.assert_array_equal(DocumentReader("text").read(doc), want)

    config = DataConfig(source=str(path), tokenizer_path=tokenizer_file, seq_len=SEQ, batch_size=2,
                        eval_fraction=0.0)
    data, docs, found = _pipeline_segments(config, str(tmp_path / "work"))
    expected = expected_chunks(docs, tok, SEQ)
    assert found == expected
    assert expected[tuple(range(2, 34))] == 1  # record 4 cut into [2..33], [34..65], [66..99, EOS]
    assert expected[tuple(range(66, 100)) + (tok.eos_id,)] == 0  # 35 tokens do not fit in one chunk
    assert expected[tuple(range(98, 100)) + (tok.eos_id,)] == 1


def test_mixed_sources(tmp_path, tokenizer_file):
    text = tmp_path / "a.txt"
    text.write_text(TEXTS[0])
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text(json.dumps({"text": TEXTS[1]}) + "\n")
    config = DataConfig(source=("stdlib", str(text), str(jsonl)), tokenizer_path=tokenizer_file,
                        eval_fraction=0.0)
    train, _ = load_documents(config)
    assert [d.key for d in train[-2:]] == [str(text), f"{jsonl}:1"] and train[-1].kind == "jsonl"
    assert len(train) > 500 and all(d.key.startswith("stdlib/") for d in train[:-2])


def test_globs_are_expanded_by_the_pipeline(tmp_path, monkeypatch):
    notes = tmp_path / "notes"
    (notes / "deep").mkdir(parents=True)
    (notes / "a.md").write_text(TEXTS[0])
    (notes / "b.txt").write_text(TEXTS[1])
    (notes / "deep" / "c.md").write_text(TEXTS[2])
    monkeypatch.setenv("HOME", str(tmp_path))
    keys = lambda source: [d.key for d in index_sources([source], "text")]       # noqa: E731
    assert keys("~/notes/*.md") == [f"{notes}/a.md"]
    assert keys(f"{notes}/**/*.md") == [f"{notes}/a.md", f"{notes}/deep/c.md"]     # ** crosses folders
    assert keys("~/notes") == [f"{notes}/a.md", f"{notes}/b.txt", f"{notes}/deep/c.md"]
    with pytest.raises(DataError, match=r"data source .*/\*\.rst matches no files"):
        index_sources([f"{notes}/*.rst"], "text")
    with pytest.raises(DataError, match="glob patterns are expanded on local paths only"):
        index_sources(["gs://bucket/notes/*.md"], "text")


def test_a_long_text_file_is_cut_into_documents_at_paragraphs(tmp_path):
    paragraphs = [f"paragraph {i}: " + "word " * (i % 7 * 20 + 10) + "\n\n" for i in range(400)]
    text = "".join(paragraphs)
    path = tmp_path / "book.txt"
    path.write_text(text)
    docs = index_sources([str(path)], "text", text_document_bytes=1000)
    pieces = [DocumentReader("text").read(d) for d in docs]
    assert "".join(pieces) == text and len(docs) > 40
    assert all(p.endswith("\n\n") and 1000 <= len(p) <= 2000 for p in pieces[:-1])     # cut after a blank line
    assert [d.key for d in docs[:2]] == [f"{path}@0", f"{path}@{docs[1].offset}"]
    assert index_sources([str(path)], "text")[0].key == str(path)                      # None: one document
    # the default config holds out documents of the one file for eval
    train, held_out = load_documents(DataConfig(source=str(path), text_document_bytes=1000))
    assert len(held_out) == 4 and len(train) == len(docs) - 4


def test_text_pieces_keep_utf8_characters_whole():
    import io

    from glm5_jax.data.sources import text_pieces

    data = ("é" * 90 + "\n" + "日本語" * 200).encode()           # one line break, then 1,800 bytes without one
    pieces = text_pieces(io.BytesIO(data), len(data), 100)
    assert sum(n for _, n in pieces) == len(data)
    assert [data[o:o + n].decode() for o, n in pieces]                 # every piece decodes on its own
    assert pieces[0] == (0, 181)                                       # after the line break past 100 bytes
    assert all(198 <= n <= 200 for _, n in pieces[1:-1])               # 200 bytes, or less not to split a character
