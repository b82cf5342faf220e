"""The error every checkpoint reader and writer raises, importable without any checkpoint I/O, and the errors
the command lines report as one ``error: ...`` line (exit status 1) instead of a traceback."""
from glm5_jax.data.config import DataError
from glm5_jax.model.config import ConfigError
from glm5_jax.parallel.mesh import MeshError


class CheckpointError(ValueError):
    """A checkpoint file or index is missing, malformed or inconsistent; the message names it."""


# a user's mistake (a wrong path, a bad file, an impossible setting), each naming the problem; anything else
# is a bug and keeps its traceback
USER_ERRORS = (CheckpointError, ConfigError, DataError, MeshError)
