"""Shared set-up of the INT4 MoE kernels' v5p compile tests: a 4-chip `expert` mesh and abstract operands on it."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

CHIPS = 4
EXPERTS = P(None, "expert")                  # stacked [L, E, ...] weights: the experts over the chips


def expert_mesh() -> Mesh:
    """v5p:2x2x1's 4 chips as one `expert` axis."""
    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1")
    return Mesh(np.array(topology.devices).reshape(-1), ("expert",))


def replicated(mesh, shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))


def stacked_int4_weights(mesh, L: int, e_local: int, D: int, F: int, G: int) -> tuple:
    """Abstract packed gate / up [L, E, D/8, F] and down [L, E, F/8, D] int32 words, each followed by its bf16 scales
    (one per G inputs), E = `CHIPS` x ``e_local`` experts split over the mesh."""
    def pair(k, n):
        sharding = NamedSharding(mesh, EXPERTS)
        return (jax.ShapeDtypeStruct((L, CHIPS * e_local, k // 8, n), jnp.int32, sharding=sharding),
                jax.ShapeDtypeStruct((L, CHIPS * e_local, k // G, n), jnp.bfloat16, sharding=sharding))
    return (*pair(D, F), *pair(D, F), *pair(F, D))
