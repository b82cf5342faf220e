import json

import pytest

from glm5_jax.data import (DataConfig, DataError, build_data_pipeline, index_sources, load_documents,
                           make_dataset, write_token_records)


def _build(config, tmp_path, **kw):
    return build_data_pipeline(config, str(tmp_path / "work"), show_progress=False,
                               **{"process_index": 0, "process_count": 1, **kw})


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match="data source path does not exist: .*nowhere"):
        _build(DataConfig(source=str(tmp_path / "nowhere")), tmp_path)


def test_empty_sources(tmp_path):
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match="holds no documents"):
        index_sources([str(tmp_path / "empty_dir")], "text")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="empty.txt holds no documents"):
        index_sources([str(tmp_path / "empty.txt")], "text")
    with pytest.raises(DataError, match="source is empty"):
        _build(DataConfig(source=()), tmp_path)


@pytest.mark.parametrize("line, message", [
    ('{"text": "ok"', r"bad JSON at .*bad.jsonl:2"),
    ('{"body": "no text"}', r"bad.jsonl:2: line has no field 'text'"),
    ('{"text": 3}', r"bad.jsonl:2: field 'text' is int, expected a string"),
    ('["text"]', r"bad.jsonl:2: line has no field 'text'"),
])
def test_bad_jsonl_lines_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(DataError, match=message):
        _build(DataConfig(source=str(path), eval_fraction=0.0), tmp_path)


def test_batch_not_divisible_by_process_count(tmp_path):
    with pytest.raises(DataError, match="batch_size=6 is not divisible by process_count=4"):
        _build(DataConfig(batch_size=6, max_corpus_bytes=50_000), tmp_path, process_index=1, process_count=4)
    with pytest.raises(DataError, match=r"process_index=2 is not in \[0, process_count=2\)"):
        _build(DataConfig(batch_size=6), tmp_path, process_index=2, process_count=2)


def test_bad_settings():
    for bad, message in [(dict(seq_len=0), "seq_len must be >= 1"), (dict(vocab_size=300), "vocab_size=300"),
                         (dict(eval_fraction=1.0), "eval_fraction"), (dict(num_epochs=0), "num_epochs")]:
        with pytest.raises(DataError, match=message):
            load_documents(DataConfig(**bad))


def test_pre_tokenized_without_tokenizer_and_out_of_vocab_ids(tmp_path, tokenizer_file, small_pipeline):
    path = tmp_path / "t.arrayrecord"
    write_token_records(str(path), [[5, 6, 7], [8, 100_000]])
    with pytest.raises(DataError, match="set DataConfig.tokenizer_path"):
        _build(DataConfig(source=str(path), eval_fraction=0.0), tmp_path)
    with pytest.raises(DataError, match="max_corpus_bytes cannot be applied to ArrayRecord"):
        _build(DataConfig(source=str(path), eval_fraction=0.0, max_corpus_bytes=10,
                          tokenizer_path=tokenizer_file), tmp_path)
    config = DataConfig(source=str(path), tokenizer_path=tokenizer_file, eval_fraction=0.0, seq_len=8,
                        batch_size=1)
    data = _build(config, tmp_path)
    ds = make_dataset(config, data.train_documents, data.tokenizer, train=False, process_index=0,
                      process_count=1)
    with pytest.raises(DataError, match=r"t.arrayrecord#1: token id 100000 is outside the tokenizer's vocabulary"):
        list(iter(ds))
