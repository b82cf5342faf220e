"""Where logical axes meet devices: meshes and the one logical-axis rules table (`mesh`), Pallas kernels under
`shard_map` (`shard_map`), and the zig-zag sequence layout of context parallelism (`context`)."""
