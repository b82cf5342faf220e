"""Command-line flags shared by the RL entry points (learner, generator, supervisor, sft)."""
from absl import flags


def define_common_flags():
    flags.DEFINE_string("config", None, "RL config file defining get_config() -> RLExperiment.", required=True)
    flags.DEFINE_string("workdir", None, "RL run directory (shared by learner and generators).", required=True)
    flags.DEFINE_multi_string("set", [], "Override a config field, e.g. --set=rl.tau=0 --set=rl.lockstep=True.")
