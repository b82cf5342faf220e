"""Where logical axes meet devices: meshes and the one logical-axis rules table (`mesh`), the samplers' mesh and
rules (`sampling`), Pallas kernels under `shard_map` (`shard_map`), and the zig-zag sequence layout of context
parallelism (`context`)."""
