"""Rollout files: a truncated, half-written or damaged file is never admitted; whole files round-trip."""
import hashlib
import os

import numpy as np
import pytest

from glm5_jax.rl import rollouts as ro


def _batch(n=4, C=3, seq=0):
    rng = np.random.default_rng(seq)
    return ro.RolloutBatch(
        prompt_tokens=rng.integers(2, 12, (n, 5)).astype(np.int32), prompt_lengths=np.full(n, 5, np.int32),
        completion_tokens=rng.integers(2, 12, (n, C)).astype(np.int32), completion_lengths=np.full(n, C, np.int32),
        logprobs=-rng.random((n, C)).astype(np.float32), loss_mask=np.ones((n, C), np.float32),
        rewards=rng.random(n).astype(np.float32), group_ids=(np.arange(n) // 2).astype(np.int32),
        versions=np.full((n, 1), 3, np.int32), meta={"generator": 0, "seq": seq, "sampler": {"temperature": 1.0}})


def test_round_trip_is_exact(tmp_path):
    dirs = ro.RolloutDirs(str(tmp_path))
    batch = _batch()
    path = ro.write_batch(dirs, 0, 7, batch)
    assert os.path.basename(path) == "g000_s0000007.rollout" and dirs.seqs_of(0) == [7]
    assert os.listdir(dirs.tmp) == []                        # the temp file was renamed, not copied
    back, sha = ro.read_batch(path)
    for name in ro.RolloutBatch.ARRAYS:
        np.testing.assert_array_equal(getattr(back, name), getattr(batch, name))
        assert getattr(back, name).dtype == getattr(batch, name).dtype
    assert back.meta == batch.meta and len(sha) == 64


def test_every_truncation_and_a_flipped_byte_are_rejected(tmp_path):
    blob = ro.encode(_batch())
    # every prefix length (a half-written file, or a crash mid-copy) must fail, never parse as fewer rows
    for cut in list(range(0, len(blob), max(len(blob) // 97, 1))) + [len(blob) - 1]:
        with pytest.raises(ro.CorruptRollout):
            ro.decode(blob[:cut])
    damaged = bytearray(blob)
    damaged[len(blob) // 2] ^= 0x01
    with pytest.raises(ro.CorruptRollout, match="checksum"):
        ro.decode(bytes(damaged))
    with pytest.raises(ro.CorruptRollout, match="end marker"):
        ro.decode(blob + b"\0")


def test_half_written_file_stays_invisible(tmp_path, monkeypatch):
    """A writer killed between write and rename leaves only a tmp/ file; ready/ never shows it."""
    dirs = ro.RolloutDirs(str(tmp_path))

    def crash(*args):
        raise KeyboardInterrupt("killed before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        ro.write_batch(dirs, 1, 0, _batch())
    monkeypatch.undo()
    assert dirs.seqs_of(1) == [] and len(os.listdir(dirs.tmp)) == 1
    dirs.clear_tmp(1)                                        # what a restarted generator does first
    assert os.listdir(dirs.tmp) == []


def test_invalid_fields_are_rejected():
    bad = _batch()
    bad.logprobs = bad.logprobs.astype(np.float64)
    with pytest.raises(ro.CorruptRollout, match="logprobs"):
        ro.encode(bad)
    bad = _batch()
    bad.completion_lengths = np.full(4, 9, np.int32)
    with pytest.raises(ro.CorruptRollout, match="completion_lengths"):
        ro.encode(bad)


def test_token_versions_round_trip_and_older_records_still_read(tmp_path):
    """A record with per-token versions round-trips them (and a truncation of it is still rejected); one
    without them (written before in-flight updates) reads back with token_versions None and its old hash."""
    dirs = ro.RolloutDirs(str(tmp_path))
    old = _batch()
    with_versions = _batch()
    with_versions.token_versions = np.array([[3, 3, 4]] * 4, np.int32)
    back, sha = ro.read_batch(ro.write_batch(dirs, 0, 1, with_versions))
    np.testing.assert_array_equal(back.token_versions, with_versions.token_versions)
    assert back.token_versions.dtype == np.int32 and sha != ro.content_sha256(old)
    back_old, sha_old = ro.read_batch(ro.write_batch(dirs, 0, 2, old))
    assert back_old.token_versions is None
    before = hashlib.sha256()                      # the hash as records were hashed before the optional field
    for name in ro.RolloutBatch.ARRAYS:
        a = getattr(old, name)
        before.update(f"{name}|{a.dtype}|{a.shape}|".encode() + np.ascontiguousarray(a).tobytes())
    assert sha_old == before.hexdigest()
    blob = ro.encode(with_versions)
    with pytest.raises(ro.CorruptRollout):
        ro.decode(blob[:len(blob) // 2])
    with_versions.token_versions = np.array([[3, 4]] * 4, np.int32)            # not [N, C]
    with pytest.raises(ro.CorruptRollout, match="token_versions"):
        ro.encode(with_versions)
