"""The converter's speed-ups keep results bit-identical: blocked transposes, the reused read buffer."""
import ml_dtypes
import numpy as np
import pytest
from convert_helpers import GLM_KW

from glm5_jax.convert import hub_reader
from glm5_jax.convert.hub_reader import HubReader, read_leaf_slice, transpose_copy
from glm5_jax.convert.plan import build_plan
from glm5_jax.convert.synthetic import write_random_hub_checkpoint
from glm5_jax.hf.config import config_from_hf
from glm5_jax.hf.layout import to_ours
from glm5_jax.hf.safetensors_io import SafetensorsCheckpoint

CONFIG = {**GLM_KW, "model_type": "glm_moe_dsa", "num_nextn_predict_layers": 1, "eos_token_id": 1,
          "pad_token_id": None}


@pytest.mark.parametrize("shape,perm", [((5, 7), (1, 0)), ((2, 3, 10, 7), (0, 1, 3, 2)), ((4, 6, 10), (2, 0, 1)),
                                        ((10, 4, 6), (1, 2, 0)), ((3, 10), (0, 1))])
@pytest.mark.parametrize("block", [3, 4, 64])
def test_transpose_copy_matches_numpy(monkeypatch, shape, perm, block):
    monkeypatch.setattr(hub_reader, "TRANSPOSE_BLOCK", block)
    src = np.random.default_rng(0).standard_normal(shape).astype(ml_dtypes.bfloat16)
    got = transpose_copy(src, perm)
    want = np.ascontiguousarray(src.transpose(perm))
    assert got.flags.c_contiguous and got.shape == want.shape and got.dtype == want.dtype
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("block", [3, 64])
def test_leaves_read_through_the_reused_buffer_match_the_reference(tmp_path, monkeypatch, block):
    """Every leaf, read in plan order (and again in reverse, so the scratch buffer holds another leaf's
    bytes), equals the hub tensors put through the reference `to_ours` and stacked."""
    monkeypatch.setattr(hub_reader, "TRANSPOSE_BLOCK", block)
    write_random_hub_checkpoint(str(tmp_path / "hf"), CONFIG, dtype=ml_dtypes.bfloat16)
    ckpt = SafetensorsCheckpoint(str(tmp_path / "hf"))
    reader = HubReader(ckpt)
    plan = build_plan(config_from_hf(CONFIG))
    first = {leaf.name: read_leaf_slice(reader, leaf, (), ckpt.raw(leaf.hub_keys()[0]).dtype) for leaf in plan}
    for leaf in reversed(plan):
        got = read_leaf_slice(reader, leaf, (), ckpt.raw(leaf.hub_keys()[0]).dtype)
        assert got.tobytes() == first[leaf.name].tobytes(), leaf.name

        def element(src):
            if src.experts:
                return np.stack([to_ours(ckpt.raw(k), src.layout, src.heads) for k in src.keys()])
            return to_ours(ckpt.raw(src.key), src.layout, src.heads)
        want = np.stack([element(s) for s in leaf.sources]) if leaf.stacked else element(leaf.sources[0])
        assert got.shape == want.shape and got.tobytes() == np.ascontiguousarray(want).tobytes(), leaf.name


def test_leaf_buffers_are_aligned_so_jax_adopts_them():
    """64-byte aligned results let jax's CPU client alias them instead of copying each leaf."""
    import jax

    src = np.arange(3 * 100 * 70, dtype=np.float32).reshape(3, 100, 70).astype(ml_dtypes.bfloat16)
    out = transpose_copy(src, (0, 2, 1))
    assert out.ctypes.data % hub_reader.ALIGN == 0
    arr = jax.device_put(out)
    np.testing.assert_array_equal(np.asarray(arr), src.transpose(0, 2, 1))
    empty = hub_reader.aligned_empty((0, 5), np.float32)
    assert empty.shape == (0, 5)


def test_plan_traced_on_the_cheap_path_matches_the_model():
    """build_plan traces the model with dense attention and no remat; shapes and logical axes must be
    those of the model as configured."""
    import jax
    from flax.core import meta

    from glm5_jax.model.param_count import abstract_variables

    for hf in (CONFIG, {**CONFIG, "first_k_dense_replace": 0, "num_nextn_predict_layers": 0}):
        cfg = config_from_hf(hf)
        leaves = jax.tree_util.tree_leaves_with_path(abstract_variables(cfg),
                                                     is_leaf=lambda x: isinstance(x, meta.Partitioned))
        want = {tuple(k.key for k in path): (tuple(meta.unbox(x).shape), tuple(x.names)) for path, x in leaves}
        got = {(leaf.collection,) + leaf.path: (leaf.shape, leaf.logical_axes) for leaf in build_plan(cfg)}
        assert got == want


@pytest.mark.parametrize("batch_bytes", [1, 5000])
def test_prefetched_export_round_trip_is_bit_identical(tmp_path, monkeypatch, batch_bytes):
    """orbax-to-hf restores leaves in batches in a background thread; with tiny batches (one leaf each,
    or a few) the round trip is still bit-identical, bf16 and the fp32 router alike."""
    from convert_helpers import assert_same_tensors

    from glm5_jax.convert import hf_to_orbax, orbax_to_hf

    export_module = __import__("sys").modules["glm5_jax.convert.orbax_to_hf"]
    monkeypatch.setattr(export_module, "RESTORE_BATCH_BYTES", batch_bytes)
    write_random_hub_checkpoint(str(tmp_path / "hf"), CONFIG, dtype=ml_dtypes.bfloat16, max_shard_bytes=40_000)
    hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "orbax"), dtype="bfloat16")
    orbax_to_hf(str(tmp_path / "orbax"), str(tmp_path / "back"), shard_size="30KB")
    assert assert_same_tensors(str(tmp_path / "hf"), str(tmp_path / "back")) > 0


def test_export_error_in_prefetch_thread_writes_nothing(tmp_path, monkeypatch):
    """A restore failing in the background thread (here: the third batch) surfaces in the caller and
    leaves no output or temporary directory behind."""
    from convert_helpers import siblings

    from glm5_jax.convert import hf_to_orbax, orbax_io, orbax_to_hf

    export_module = __import__("sys").modules["glm5_jax.convert.orbax_to_hf"]
    monkeypatch.setattr(export_module, "RESTORE_BATCH_BYTES", 1)
    write_random_hub_checkpoint(str(tmp_path / "hf"), CONFIG, dtype=ml_dtypes.bfloat16)
    hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "orbax"), dtype="bfloat16")
    calls, real = [], orbax_io.restore_leaves

    def failing(ckpt_dir, leaves):
        calls.append(leaves)
        if len(calls) == 3:
            raise OSError("disk went away")
        return real(ckpt_dir, leaves)
    monkeypatch.setattr(orbax_io, "restore_leaves", failing)
    with pytest.raises(OSError, match="disk went away"):
        orbax_to_hf(str(tmp_path / "orbax"), str(tmp_path / "back"))
    assert siblings(str(tmp_path / "back")) == []


def test_import_error_in_reader_thread_writes_nothing(tmp_path, monkeypatch):
    """hf-to-orbax builds the next leaf in a background thread; a read failing there (a file shrinking
    after validation) surfaces in the caller and leaves no output or temporary directory."""
    from convert_helpers import siblings

    from glm5_jax.checkpoint.errors import CheckpointError
    from glm5_jax.convert import hf_to_orbax

    write_random_hub_checkpoint(str(tmp_path / "hf"), CONFIG, dtype=ml_dtypes.bfloat16)
    calls, real = [], hub_reader.read_leaf_slice
    import_module = __import__("sys").modules["glm5_jax.convert.hf_to_orbax"]

    def failing(reader, leaf, index, dtype):
        calls.append(leaf.name)
        if len(calls) == 5:
            raise CheckpointError("shard truncated while reading")
        return real(reader, leaf, index, dtype)
    monkeypatch.setattr(import_module, "read_leaf_slice", failing)
    with pytest.raises(CheckpointError, match="truncated while reading"):
        hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "orbax"), dtype="bfloat16")
    assert siblings(str(tmp_path / "orbax")) == []
