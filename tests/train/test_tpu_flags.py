"""glm5_jax.platforms.tpu_flags: named libtpu flag sets, merged with the user's own LIBTPU_INIT_ARGS, and their effect
on a real AOT TPU compile (a fresh process: libtpu reads its flags once, when it starts)."""
import functools
import json
import os
import subprocess
import sys
import textwrap

import pytest

from glm5_jax.train.experiment import apply_overrides, load_config_file
from glm5_jax.platforms.tpu_flags import FLAG_SETS, libtpu_init_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_flag_sets_merge_with_the_users_flags():
    assert libtpu_init_args("none", "--a=1") == "--a=1"
    merged = libtpu_init_args("collective_overlap", "--xla_enable_async_all_gather=false --a=1").split()
    assert merged[:2] == ["--xla_enable_async_all_gather=false", "--a=1"]            # the user's value wins
    assert "--xla_enable_async_all_gather=true" not in merged
    assert set(merged[2:]) == set(FLAG_SETS["collective_overlap"]) - {"--xla_enable_async_all_gather=true"}
    with pytest.raises(ValueError, match="tpu_flags='fast'"):
        libtpu_init_args("fast")
    cfg = load_config_file(os.path.join(ROOT, "configs", "tiny.py"))
    with pytest.raises(ValueError, match="train.tpu_flags"):
        apply_overrides(cfg, ["train.tpu_flags=fast"]).validate()


# An FSDP-sharded scan of matmuls and its gradient, compiled for v5p:2x2x1 after tpu_flags.apply(name):
# prints hlo_cost's collectives (kind, async) and its exposed communication.
PROGRAM = textwrap.dedent(r"""
    import json, os, re, sys
    from glm5_jax.platforms import tpu_flags
    tpu_flags.apply(sys.argv[1])
    import jax, jax.numpy as jnp, numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from glm5_jax.cost.hlo_cost import StepTiming, hlo_cost
    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices
    mesh = Mesh(np.array(devices).reshape(4), ("fsdp",))

    def loss(ws, x):
        x, _ = jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)
        return jnp.sum(x)

    ws = jax.ShapeDtypeStruct((8, 2048, 2048), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "fsdp")))
    x = jax.ShapeDtypeStruct((32768, 2048), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    text = jax.jit(jax.grad(loss)).lower(ws, x).compile().as_text()
    # the computations the SparseCores run (their collectives are offloaded)
    sparsecore_computations = re.findall(r"\n%[^\n]*\{\n(?:  [^\n]*\n)*\}, execution_thread=\"sparsecore\"", text)
    cost = hlo_cost(text, timing=StepTiming(peak_flops=4.59e14, hbm_bandwidth=2.76e12,
                                            collective_seconds=lambda op: op.nbytes / 1e11))
    print(json.dumps({"collectives": sorted({(op.kind, op.is_async) for op in cost.collectives}),
                      "comm": cost.comm_seconds, "exposed": cost.exposed_comm_seconds, "bytes": cost.bytes_accessed,
                      "on_sparsecores": sorted(set(re.findall(r" (all-reduce|reduce-scatter|all-gather)\(",
                                                              "".join(sparsecore_computations))))}))
""")


@functools.lru_cache(maxsize=None)
def _compile(flag_set):
    pytest.importorskip("libtpu", reason="libtpu not installed (pip install -r requirements-tpu.txt)")
    env = {k: v for k, v in os.environ.items() if k != "LIBTPU_INIT_ARGS"}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    run = subprocess.run([sys.executable, "-c", PROGRAM, flag_set], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_collective_overlap_makes_the_fsdp_collectives_async():
    plain, overlap = _compile("none"), _compile("collective_overlap")
    # libtpu's defaults: the weight all-gathers and the gradient all-reduce stall compute
    assert plain["collectives"] == [["all-gather", False], ["all-reduce", False]]
    assert plain["exposed"] == pytest.approx(plain["comm"])
    # with the set: the compiler fuses them into the compute around them (each counted once, at its start:
    # the same bytes), and the counter hides them behind that compute
    assert ["all-gather", True] in overlap["collectives"] and ["all-reduce", True] in overlap["collectives"]
    assert overlap["comm"] == pytest.approx(plain["comm"])
    assert overlap["exposed"] < 0.5 * plain["exposed"]
    # the same HBM traffic in both forms: the async form's three fusions (start, the compute it runs beside,
    # done) charge the collective's buffers once (before that rule: 6.68 GB against 5.64 GB here)
    assert overlap["bytes"] == pytest.approx(plain["bytes"], rel=0.02)


def test_sparsecore_offload_runs_the_fsdp_collectives_on_the_sparsecores():
    overlap, offload = _compile("collective_overlap"), _compile("sparsecore_offload")
    assert overlap["on_sparsecores"] == []
    # the weight all-gathers and the gradient all-reduce become async calls the SparseCores run: the same
    # bytes and communication
    assert offload["on_sparsecores"] == ["all-gather", "all-reduce"]
    assert ["all-reduce", True] in offload["collectives"] and ["all-gather", True] in offload["collectives"]
    assert offload["comm"] == pytest.approx(overlap["comm"])
    assert offload["exposed"] < 0.5 * overlap["exposed"]        # nothing synchronous left
    assert offload["bytes"] == pytest.approx(overlap["bytes"], rel=0.02)


def test_sparsecore_offload_can_leave_the_all_reduces_to_the_tensorcore():
    offload, tc_all_reduce = _compile("sparsecore_offload"), _compile("sparsecore_offload_tc_all_reduce")
    # the weight all-gathers stay on the SparseCores; the gradient all-reduce is the TensorCore's async one
    assert tc_all_reduce["on_sparsecores"] == ["all-gather"]
    assert ["all-reduce", True] in tc_all_reduce["collectives"]
    assert tc_all_reduce["comm"] == pytest.approx(offload["comm"])
