"""Train GLM-5 (any size) on any mesh: python train.py --config=configs/tiny.py --workdir=DIR [--set=k=v ...]

Re-running with the same workdir resumes from its latest checkpoint.
"""
import logging
import sys

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("config", None, "Python config file defining get_config() -> ExperimentConfig.", required=True)
flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics.jsonl, tb/, tokenizer cache.", required=True)
flags.DEFINE_multi_string("set", [], "Override a config field, e.g. --set=train.steps=100 --set=mesh.fsdp=2.")
flags.DEFINE_integer("host_devices", None, "Simulate this many CPU devices (sets XLA_FLAGS before JAX starts).")
flags.DEFINE_string("coordinator_address", None, "Multi-process: host:port of process 0 (jax.distributed).")
flags.DEFINE_integer("num_processes", None, "Multi-process: total number of processes.")
flags.DEFINE_integer("process_id", None, "Multi-process: this process's index.")
flags.DEFINE_bool("compile_only", False, "AOT-compile the train step for --topology and write compile_report.json.")
flags.DEFINE_string("topology", None, "TPU topology for --compile_only, e.g. v5p:8x16x16 (needs libtpu).")


def main(argv):
    del argv
    from glm5_jax.platforms import simulate_host_devices, skip_absent_tpu

    simulate_host_devices(FLAGS.host_devices)
    skip_absent_tpu()       # no TPU runtime (and its failure-looking lines) on a host without a TPU
    import jax

    if FLAGS.coordinator_address:
        jax.distributed.initialize(coordinator_address=FLAGS.coordinator_address,
                                   num_processes=FLAGS.num_processes, process_id=FLAGS.process_id)
    from absl import logging as absl_logging

    from glm5_jax.train.experiment import apply_overrides, load_config_file

    absl_logging.set_verbosity(absl_logging.WARNING)          # orbax/grain INFO chatter
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    run_log = logging.getLogger("glm5_jax")
    run_log.addHandler(handler)
    run_log.setLevel(logging.INFO)
    run_log.propagate = False
    cfg = apply_overrides(load_config_file(FLAGS.config), FLAGS.set)
    from glm5_jax.platforms import tpu_flags

    tpu_flags.apply(cfg.train.tpu_flags)    # before libtpu starts (a TPU backend or an AOT topology)
    if FLAGS.compile_only:
        if not FLAGS.topology:
            raise app.UsageError("--compile_only needs --topology (e.g. v5p:8x16x16)")
        from glm5_jax.train.compile_report import write_compile_report

        write_compile_report(cfg, FLAGS.topology, FLAGS.workdir)
        return
    from glm5_jax.train.loop import run_training

    run_training(cfg, FLAGS.workdir)


def main_reporting_user_errors(argv):
    """`main`, with a user's mistake (a missing config file, a bad --set, data or workdir that cannot be used)
    reported as one line ``error: ...`` and exit status 1; anything else is a bug and keeps its traceback."""
    try:
        return main(argv)
    except Exception as e:
        from glm5_jax.checkpoint.errors import USER_ERRORS    # after main: it imports JAX once XLA_FLAGS are set

        if not isinstance(e, USER_ERRORS):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    app.run(main_reporting_user_errors)
