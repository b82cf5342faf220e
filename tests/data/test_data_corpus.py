import math
import os

import pytest

from glm5_jax.data import DataConfig, DataError, load_documents, select_within_budget, split_train_eval
from glm5_jax.data import stdlib_documents
from glm5_jax.data.corpus import stdlib_root


def test_stdlib_documents_are_sorted_stdlib_py_files():
    docs = stdlib_documents()
    root = stdlib_root()
    assert len(docs) > 500
    assert [d.key for d in docs] == sorted(d.key for d in docs)
    assert all(d.path.endswith(".py") and d.path.startswith(root + os.sep) for d in docs)
    assert not any("site-packages" in d.key or "__pycache__" in d.key for d in docs)
    assert all(d.size == os.path.getsize(d.path) > 0 for d in docs)
    assert "stdlib/json/decoder.py" in {d.key for d in docs}


def test_byte_budget_is_deterministic_and_spread_out():
    docs = stdlib_documents()
    subset = select_within_budget(docs, 400_000)
    assert subset == select_within_budget(docs, 400_000)
    assert 350_000 < sum(d.size for d in subset) <= 400_000
    assert [d.key for d in subset] == sorted(d.key for d in subset)
    top_level = {d.key.split("/")[1] for d in subset}
    assert len(top_level) > 10, "a budget samples the whole stdlib, not its alphabetical start"
    with pytest.raises(DataError, match="smaller than the smallest document"):
        select_within_budget(docs, 1)


def test_eval_split_is_disjoint_deterministic_and_sized():
    docs = select_within_budget(stdlib_documents(), 300_000)
    train, held_out = split_train_eval(docs, 0.05, 3)
    assert len(held_out) == max(math.ceil(0.05 * len(docs)), 3)
    assert not {d.key for d in train} & {d.key for d in held_out}
    assert {d.key for d in train} | {d.key for d in held_out} == {d.key for d in docs}
    assert split_train_eval(docs, 0.05, 3) == (train, held_out)
    assert split_train_eval(docs, 0.0, 3) == (docs, [])
    with pytest.raises(DataError, match="eval split needs"):
        split_train_eval(docs[:3], 0.5, 3)


def test_load_documents_eval_split_disjoint_from_train():
    train, held_out = load_documents(DataConfig(max_corpus_bytes=200_000, eval_fraction=0.1, min_eval_docs=2))
    assert len(held_out) >= 2 and len(train) > len(held_out)
    assert not {d.path for d in train} & {d.path for d in held_out}
