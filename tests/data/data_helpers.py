"""Helpers shared by the data tests: the small test config, direct tokenization, packed-row checks."""
import collections
import dataclasses

import numpy as np

from glm5_jax.data import Batch, DocumentReader

SMALL = dict(max_corpus_bytes=120_000, vocab_size=512, seq_len=64, eval_fraction=0.1, min_eval_docs=2)


def expected_chunks(docs, tokenizer, seq_len, text_field="text"):
    """Direct tokenization: every document + EOS cut into seq_len chunks (what packing must contain)."""
    reader = DocumentReader(text_field)
    chunks = collections.Counter()
    for doc in docs:
        content = reader.read(doc)
        ids = tokenizer.encode(content) if isinstance(content, str) else content
        ids = np.append(ids, tokenizer.eos_id)
        for i in range(0, len(ids), seq_len):
            chunks[tuple(int(t) for t in ids[i:i + seq_len])] += 1
    return chunks


def segments_of(batch):
    """Counter of the token tuples of every packed segment in a batch."""
    found = collections.Counter()
    for tokens, segs in zip(batch.tokens, batch.segment_ids):
        for s in np.unique(segs[segs > 0]):
            found[tuple(int(t) for t in tokens[segs == s])] += 1
    return found


def check_row_invariants(batch, batch_size, seq_len):
    assert isinstance(batch, Batch), type(batch)
    for field in dataclasses.fields(batch):
        x = getattr(batch, field.name)
        assert isinstance(x, np.ndarray) and x.shape == (batch_size, seq_len) and x.dtype == np.int32, field.name
    for tokens, segs, pos in zip(batch.tokens, batch.segment_ids, batch.positions):
        used = int(np.count_nonzero(segs))
        assert np.all(segs[:used] > 0) and np.all(segs[used:] == 0), "padding only at the end of a row"
        assert np.all(pos[used:] == 0) and np.all(tokens[used:] == 0), "padding is token 0 at position 0"
        if used:
            assert segs[0] == 1
            steps = np.diff(segs[:used])
            assert set(np.unique(steps)) <= {0, 1}, "segment ids are contiguous and increase by one"
            starts = np.concatenate([[0], np.nonzero(steps)[0] + 1])
            assert np.all(pos[starts] == 0), "positions restart at 0 for each segment"
            same = steps == 0
            assert np.all(np.diff(pos[:used])[same] == 1), "positions increase by one inside a segment"
