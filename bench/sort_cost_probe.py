"""What a lone XLA sort costs on v5p by libtpu's own cost analysis and by glm5_jax.cost: the indexer top-k's
sort (f32 scores + s32 key indices, sorted along the keys, queries in lanes) at several key counts.

    python bench/sort_cost_probe.py [--keys 4096,65536,202752] [--queries 512] [--out bench/results/sort_cost_probe.json]

Needs libtpu (AOT compile for v5p:2x2x1 from this host). Prints a table and writes JSON. Both models charge
one read and one write of the operands; how many HBM passes the TPU's sort makes is not in the program.
"""
import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.cost.hlo_cost import hlo_cost


def probe(keys: int, queries: int) -> dict:
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices[:1]), ("x",))
    s = NamedSharding(mesh, P())
    spec = lambda dt: jax.ShapeDtypeStruct((1, keys, queries), dt, sharding=s)  # noqa: E731
    sort = jax.jit(lambda a, b: jax.lax.sort((a, b), dimension=1, is_stable=False, num_keys=2))
    compiled = sort.lower(spec(jnp.float32), spec(jnp.int32)).compile()
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    ours = hlo_cost(compiled.as_text())
    return {"keys": keys, "queries": queries, "operand_bytes": keys * queries * 8,
            "libtpu_bytes_accessed": float(xla["bytes accessed"]),
            "libtpu_optimal_seconds": float(xla.get("optimal_seconds", float("nan"))),
            "ours_bytes": float(ours.bytes_accessed)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", default="4096,65536,202752")
    parser.add_argument("--queries", type=int, default=512)
    parser.add_argument("--out", default="bench/results/sort_cost_probe.json")
    args = parser.parse_args()
    rows = [probe(int(k), args.queries) for k in args.keys.split(",")]
    print("| keys | queries | operands GB | libtpu bytes accessed GB | libtpu optimal ms | ours GB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['keys']:,} | {r['queries']} | {r['operand_bytes'] / 1e9:.3f} | {r['libtpu_bytes_accessed'] / 1e9:.3f} "
              f"| {r['libtpu_optimal_seconds'] * 1e3:.3f} | {r['ours_bytes'] / 1e9:.3f} |")
    with open(args.out, "w") as f:
        json.dump({"topology": "v5p:2x2x1", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
