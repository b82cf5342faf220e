import json

import numpy as np

from data_helpers import check_row_invariants, expected_chunks, segments_of
from glm5_jax.data import (DataConfig, DocumentReader, build_data_pipeline, index_sources,
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
