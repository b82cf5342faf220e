"""Orbax policy handoff: only committed steps are read; reads survive the writer's deletions."""
import os
import threading

import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.checkpoint.handoff import HandoffError, PolicyReader, PolicyWriter, committed_versions


def _vars(v):
    return {"params": {"w": jnp.full((4, 3), float(v))}, "moe_bias": {}}


def _abstract():
    import jax
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _vars(0))


def test_uncommitted_steps_are_never_read(tmp_path):
    writer = PolicyWriter(str(tmp_path), max_to_keep=5)
    for v in range(2):
        writer.publish(v, _vars(v), {"version": v})
    writer.wait()
    policy = os.path.join(str(tmp_path), "policy")
    # a step being written (orbax's temporary name) and a step directory without its commit marker
    os.makedirs(os.path.join(policy, "2.orbax-checkpoint-tmp-1234", "params"))
    os.makedirs(os.path.join(policy, "3", "params"))
    open(os.path.join(policy, "3", "_CHECKPOINT_METADATA"), "w").close()
    reader = PolicyReader(str(tmp_path))
    assert committed_versions(policy) == [0, 1]
    assert reader.latest_version() == 1 and not reader.has_version(3)
    np.testing.assert_array_equal(reader.restore_variables(1, _abstract())["params"]["w"], np.full((4, 3), 1.0))
    assert reader.read_meta(1) == {"version": 1}
    with pytest.raises(HandoffError, match="version 3 is not committed"):
        reader.read_meta(3)
    writer.close()


def test_reader_survives_concurrent_publish_and_deletion(tmp_path, caplog):
    """max_to_keep=2 deletes steps while the reader lists and restores them (3 of ~40 polls raced; see
    docs/training.md#policy-handoff-through-orbax); every restore that returns must hold the version it claims.
    The reader touches only the committed step it reads, so orbax never warns about another step's
    missing metadata (a step being finalised or deleted)."""
    writer = PolicyWriter(str(tmp_path), max_to_keep=2)
    writer.publish(0, _vars(0), {"version": 0})
    writer.wait()
    reader, seen, errors = PolicyReader(str(tmp_path)), [], []
    done = threading.Event()

    def poll():
        while not done.is_set():
            v = reader.latest_version()
            try:
                w = reader.restore_variables(v, _abstract())["params"]["w"]
            except HandoffError as e:          # v was deleted for good: fine, the next poll finds a newer one
                errors.append(str(e))
                continue
            seen.append((v, float(w[0, 0])))

    t = threading.Thread(target=poll)
    t.start()
    for v in range(1, 25):
        writer.publish(v, _vars(v), {"version": v})
    writer.wait()
    done.set()
    t.join()
    writer.close()
    assert seen and all(v == value for v, value in seen), seen
    assert committed_versions(os.path.join(str(tmp_path), "policy")) == [23, 24]
    assert not [r for r in caplog.records if "Metadata file does not exist" in r.getMessage()]


def test_writer_uses_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    writer = PolicyWriter("rel_run", max_to_keep=3)           # orbax would silently fail on a relative dir
    writer.publish(0, _vars(0), {"version": 0})
    writer.wait()
    assert writer.latest_version() == 0 and os.path.isabs(writer.directory)
    writer.close()
