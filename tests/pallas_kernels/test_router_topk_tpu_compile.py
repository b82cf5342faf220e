"""Real Mosaic compile of the router's top-k kernel for v5p (AOT from a CPU host via libtpu) at GLM-5's shapes:
256 experts, top 8, one decode token and a few. Needs libtpu; skipped without it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("libtpu", reason="libtpu not installed (pip install -r requirements-tpu.txt)")

from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from glm5_jax.cost.hlo_cost.kernels import kernel_cost  # noqa: E402
from pallas_kernels.router_topk import kernel  # noqa: E402

E, K = 256, 8


@pytest.mark.parametrize("tokens", [1, 16])
def test_router_topk_compiles_for_v5p(tokens):
    """Declared cost by hand: 6 vector ops an element per round, the fp32 scores and bias read, indices and
    gates written."""
    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1")
    mesh = Mesh(np.array(topology.devices).reshape(-1), ("x",))
    replicated = NamedSharding(mesh, P())
    args = (jax.ShapeDtypeStruct((tokens, E), jnp.float32, sharding=replicated),
            jax.ShapeDtypeStruct((E,), jnp.float32, sharding=replicated))
    f = jax.shard_map(lambda s, b: kernel.route_topk(s, b, top_k=K, normalize=True, scale=2.5), mesh=mesh,
                      in_specs=(P(), P()), out_specs=(P(), P()), check_vma=False)
    compiled = jax.jit(f).lower(*args).compile()
    line = next(x for x in compiled.as_text().splitlines() if "tpu_custom_call" in x and kernel.NAME in x)
    assert kernel_cost(line.split("custom-call(")[0], [], line) == (float(6 * K * tokens * E),
                                                                    4 * (tokens * E + E + 2 * tokens * K))
