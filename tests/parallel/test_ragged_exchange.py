"""glm5_jax.parallel.ragged_exchange: the dense emulation of a ragged all-to-all against the collective's
definition written out in numpy (each member's slices copied into the other members' outputs), on 4 CPU
devices; and the native collective compiled for v5p with the cost model's bytes for it (needs libtpu)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from glm5_jax.parallel.ragged_exchange import ragged_all_to_all

N, ROWS, OUT, D = 4, 6, 9, 3


def _plan(rng):
    """Each member's sizes to the others (at most ROWS rows sent, at most OUT received) and offsets with gaps."""
    while True:
        sizes = rng.integers(0, 3, (N, N))
        if sizes.sum(1).max() <= ROWS - 1 and sizes.sum(0).max() <= OUT - 2:
            break
    input_offsets = np.cumsum(sizes, 1) - sizes + (np.arange(N) >= 2)            # a gap before the third slice
    landing = np.cumsum(sizes, 0) - sizes + 1                                     # row 0 of every output untouched
    return sizes, input_offsets, landing


def _by_definition(operands, outputs, sizes, input_offsets, landing):
    out = outputs.copy()
    for s in range(N):
        for r in range(N):
            k, a, b = sizes[s, r], input_offsets[s, r], landing[s, r]
            out[r, b:b + k] = operands[s, a:a + k]
    return out


@pytest.mark.parametrize("seed", range(3))
def test_dense_exchange_equals_the_definition(seed):
    rng = np.random.default_rng(seed)
    sizes, input_offsets, landing = _plan(rng)
    operands = rng.normal(size=(N, ROWS, D)).astype(np.float32)
    outputs = np.full((N, OUT, D), -7.0, np.float32)
    mesh = jax.make_mesh((N,), ("x",), devices=jax.devices()[:N])

    def body(operand, output, input_offsets, sizes, landing, recv):
        return ragged_all_to_all(operand[0], output[0], input_offsets[0], sizes[0], landing[0], recv[0],
                                 axis_name="x", impl="dense")[None]

    rows = P("x")
    args = [jax.device_put(jnp.asarray(a), NamedSharding(mesh, rows)) for a in
            (operands, outputs, input_offsets.astype(np.int32), sizes.astype(np.int32), landing.astype(np.int32),
             sizes.T.astype(np.int32))]
    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(rows,) * 6, out_specs=rows))(*args)
    np.testing.assert_array_equal(np.asarray(got), _by_definition(operands, outputs, sizes, input_offsets, landing))


def test_native_exchange_compiles_for_v5p_and_is_charged_its_rows():
    """The collective itself, AOT-compiled for v5p:2x2x1 (4 chips), in the decode dispatch's two directions: 96
    rows out of a 192-row output buffer (a dispatch: the cost model's bytes are the rows sent, 96 x 256 bf16),
    then 192 rows back into 96 (a return: the rows taken back, the same 96 x 256)."""
    pytest.importorskip("libtpu", reason="libtpu not installed (pip install -r requirements-tpu.txt)")
    from jax.experimental import topologies
    from jax.sharding import Mesh

    from glm5_jax.cost.hlo_cost import hlo_cost

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1")
    mesh = Mesh(np.array(topology.devices).reshape(-1), ("x",))
    M, R, W = 96, 192, 256

    def body(x, sizes):
        me = jax.lax.axis_index("x")
        send, recv = sizes[me], sizes[:, me]
        starts = jnp.cumsum(sizes, 1) - sizes
        land = jnp.cumsum(sizes, 0) - sizes
        there = (starts[me], send, land[me], recv)
        rows = ragged_all_to_all(x, jnp.zeros((R, W), x.dtype), *there, axis_name="x", impl="native")
        back = (land[:, me], recv, starts[:, me], send)
        return ragged_all_to_all(rows * 2, jnp.zeros((M, W), x.dtype), *back, axis_name="x", impl="native")

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"), check_vma=False)
    args = (jax.ShapeDtypeStruct((N * M, W), jnp.bfloat16, sharding=NamedSharding(mesh, P("x"))),
            jax.ShapeDtypeStruct((N, N), jnp.int32, sharding=NamedSharding(mesh, P())))
    text = jax.jit(f).lower(*args).compile().as_text()
    ragged = {op.nbytes: n for op, n in hlo_cost(text, num_partitions=N).collectives.items()
              if op.kind == "ragged-all-to-all"}
    assert ragged == {M * W * 2: 2}          # both directions (one op kind, counted twice)
