"""On-disk formats this project writes, each writer beside its reader: a training run's orbax checkpoints
(`run`), loading any of them for inference (`inference`), and the RL policy handoff (`handoff`)."""
