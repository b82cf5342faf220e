import collections
import dataclasses
import json

import jax
import numpy as np
import pytest

from data_helpers import SMALL, check_row_invariants, expected_chunks, segments_of
from glm5_jax.data import DataConfig, make_dataset

SEQ = SMALL["seq_len"]


def _config(**overrides):
    return DataConfig(**{**SMALL, **overrides})


def _collect(dataset):
    batches = list(iter(dataset))
    found = collections.Counter()
    for b in batches:
        found += segments_of(b)
    return batches, found


def test_train_epoch_packs_every_document_exactly_once(small_pipeline):
    """One shuffled training epoch: row invariants hold and the segments are exactly the documents'
    direct tokenization (+EOS), cut into seq_len chunks: nothing lost, duplicated or reordered."""
    tok, docs = small_pipeline.tokenizer, small_pipeline.train_documents
    config = _config(batch_size=1, num_epochs=1)  # batch 1: no remainder is dropped
    batches, found = _collect(make_dataset(config, docs, tok, train=True, process_index=0, process_count=1))
    for b in batches:
        check_row_invariants(b, 1, SEQ)
    expected = expected_chunks(docs, tok, SEQ)
    assert sum(expected.values()) > 3 * len(docs), "long documents were split into several chunks"
    assert found == expected
    used = sum(int(np.count_nonzero(b.segment_ids)) for b in batches)
    assert used == sum(len(c) * n for c, n in expected.items())
    padding = 1 - used / (len(batches) * SEQ)
    assert padding < 0.1, f"first-fit packing wastes {padding:.1%}"


def test_eval_single_pass_in_order_with_padded_last_batch(small_pipeline):
    tok, docs = small_pipeline.tokenizer, small_pipeline.eval_documents
    expected = expected_chunks(docs, tok, SEQ)
    batch_size = sum(expected.values()) + 1  # more rows than chunks: the only batch must be padded
    config = _config(batch_size=batch_size)
    batches, found = _collect(make_dataset(config, docs, tok, train=False, process_index=0, process_count=1))
    assert len(batches) == 1
    check_row_invariants(batches[0], batch_size, SEQ)
    assert found == expected
    empty_rows = batches[0].segment_ids.max(axis=1) == 0
    assert empty_rows[-1] and not empty_rows[0], "padding rows are appended at the end"
    again, _ = _collect(make_dataset(config, docs, tok, train=False, process_index=0, process_count=1))
    np.testing.assert_array_equal(again[0].tokens, batches[0].tokens)


def test_shuffle_seed_changes_order_not_content(small_pipeline):
    tok, docs = small_pipeline.tokenizer, small_pipeline.train_documents
    runs = {}
    for seed in (0, 1):
        ds = make_dataset(_config(batch_size=1, num_epochs=1, seed=seed), docs, tok, train=True,
                          process_index=0, process_count=1)
        runs[seed] = _collect(ds)
    assert runs[0][1] == runs[1][1]
    assert not all(np.array_equal(a.tokens, b.tokens) for a, b in zip(runs[0][0], runs[1][0]))


def test_two_process_shards_are_disjoint_and_cover_the_documents(small_pipeline):
    tok, docs = small_pipeline.tokenizer, small_pipeline.train_documents
    config = _config(batch_size=2, num_epochs=1)  # 1 row per process per batch
    shards = []
    for index in (0, 1):
        batches, found = _collect(make_dataset(config, docs, tok, train=True, process_index=index, process_count=2))
        assert all(b.tokens.shape == (1, SEQ) for b in batches)
        shards.append(found)
    assert shards[0] + shards[1] == expected_chunks(docs, tok, SEQ)
    owners = []
    for doc in docs:
        chunks = expected_chunks([doc], tok, SEQ)
        in_shard = [all(shard[c] >= n for c, n in chunks.items()) for shard in shards]
        assert sum(in_shard) == 1, f"{doc.key} must belong to exactly one process"
        owners.append(in_shard.index(True))
    assert abs(owners.count(0) - owners.count(1)) <= 1


def test_resume_from_state_is_exact_across_epochs(small_pipeline):
    tok = small_pipeline.tokenizer
    docs = sorted(small_pipeline.train_documents, key=lambda d: d.size)[:6]  # small: resume spans epochs
    epoch_tokens = sum(len(c) * n for c, n in expected_chunks(docs, tok, SEQ).items())
    num_batches = 3 * epoch_tokens // (2 * SEQ) + 1  # more than 3 epochs' worth of token slots
    ds = make_dataset(_config(batch_size=2), docs, tok, train=True, process_index=0, process_count=1)
    it = iter(ds)
    for _ in range(7):  # 14 rows: mid-way through a 16-row packing group
        next(it)
    state = it.get_state()
    json.dumps(state)  # plain JSON: small and portable
    reference = [next(it) for _ in range(num_batches)]
    resumed = iter(ds)
    resumed.set_state(state)
    for want in reference:
        got = next(resumed)
        jax.tree.map(np.testing.assert_array_equal, got, want)


def test_orbax_checkpoint_manager_saves_and_restores_the_iterator(small_pipeline, tmp_path):
    grain = pytest.importorskip("grain")
    import orbax.checkpoint as ocp

    tok, docs = small_pipeline.tokenizer, small_pipeline.train_documents
    ds = make_dataset(_config(batch_size=2), docs, tok, train=True, process_index=0, process_count=1)
    it = iter(ds)
    for _ in range(5):
        next(it)
    manager = ocp.CheckpointManager(str(tmp_path / "ckpt"), options=ocp.CheckpointManagerOptions(max_to_keep=2))
    manager.save(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it),
                                            meta=ocp.args.JsonSave({"step": 5})))
    manager.wait_until_finished()
    reference = [next(it) for _ in range(6)]

    restored_manager = ocp.CheckpointManager(str(tmp_path / "ckpt"))
    assert restored_manager.latest_step() == 5
    fresh = iter(ds)
    restored = restored_manager.restore(5, args=ocp.args.Composite(
        data=grain.checkpoint.CheckpointRestore(fresh), meta=ocp.args.JsonRestore()))
    assert restored["meta"] == {"step": 5}
    for want in reference:
        got = next(fresh)
        jax.tree.map(np.testing.assert_array_equal, got, want)
    manager.close()
    restored_manager.close()


def test_build_pipeline_defaults_to_jax_process(workdir):
    from glm5_jax.data import build_data_pipeline

    data = build_data_pipeline(dataclasses.replace(_config(), batch_size=2), workdir, show_progress=False)
    assert (data.process_index, data.process_count) == (0, 1)
    batch = next(iter(data.train_dataset()))
    check_row_invariants(batch, 2, SEQ)


def test_loader_shards_make_batches_independent_of_process_count(small_pipeline):
    tok, docs = small_pipeline.tokenizer, small_pipeline.train_documents
    config = _config(batch_size=4, loader_shards=2)
    one = iter(make_dataset(config, docs, tok, train=True, process_index=0, process_count=1))
    two = [iter(make_dataset(config, docs, tok, train=True, process_index=p, process_count=2)) for p in range(2)]
    for _ in range(5):
        whole = next(one)
        halves = [next(it) for it in two]
        assert whole.tokens.shape == (4, SEQ) and halves[0].tokens.shape == (2, SEQ)
        jax.tree.map(lambda w, *h: np.testing.assert_array_equal(w, np.concatenate(h)), whole, *halves)
    state = one.get_state()                    # the zipped iterator is checkpointable too
    expected = next(one)
    resumed = iter(make_dataset(config, docs, tok, train=True, process_index=0, process_count=1))
    resumed.set_state(state)
    np.testing.assert_array_equal(next(resumed).tokens, expected.tokens)
    with pytest.raises(ValueError, match="loader_shards=3 must be a multiple of process_count=2"):
        make_dataset(_config(batch_size=4, loader_shards=3), docs, tok, train=True, process_index=0,
                     process_count=2)
