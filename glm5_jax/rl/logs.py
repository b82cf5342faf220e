"""Log setup for the RL processes: one timestamped line per event, prefixed with the process role."""
import logging


def setup_logging(role: str) -> None:
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)          # orbax / grain INFO chatter
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"%(asctime)s [{role}] %(message)s", "%H:%M:%S"))
    for name in ("glm5_jax", "glm5_jax.rl"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False
