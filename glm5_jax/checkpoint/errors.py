"""The error every checkpoint reader and writer raises, importable without any checkpoint I/O."""


class CheckpointError(ValueError):
    """A checkpoint file or index is missing, malformed or inconsistent; the message names it."""
