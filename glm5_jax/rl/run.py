"""The supervisor: makes the SFT checkpoint if needed, then runs the learner and N generators as
processes, restarts any that dies, and stops when the learner has published its last version.

    python -m glm5_jax.rl.run --config=configs/rl_sort.py --workdir=W [--generators=N] [--set=rl.lockstep=True]

When rl.task is a multi-turn environment (glm5_jax.rl.agentic) it also runs agentic.num_servers policy
servers (`glm5_jax.rl.policy_server`) and a router in front of them (`glm5_jax.serve.router`), on
fixed loopback ports so a restarted one is found at the same address; generators play through the router.
There the learner makes the (short) teacher SFT itself when it is missing, while the others start up.

It prints a line per SFT log step and per learner step (reward, staleness, eval) as the metrics logs
grow, and at the end a summary naming the outputs and the children's logs (W/logs/<role>.log).

`--chaos_kills=K` is fault injection for tests and bench/rl.py: K times, after a random pause in
`--chaos_interval` seconds, SIGKILL a random live child (learner, generator, server or router; or only
the roles given to `run(chaos_roles=...)`); the supervisor then restarts it like any other crash.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

from glm5_jax import storage
from glm5_jax.checkpoint.handoff import committed_versions, policy_dir
from glm5_jax.platforms import skip_absent_tpu
from glm5_jax.rl.learner import METRICS, SUMMARY
from glm5_jax.rl.progress import Console, LogFollower, outcome_line, sft_line, version_line

FOLLOW_SECONDS = 0.5          # how often the metrics logs are read for progress lines


def child_env(compile_cache: str | None = None) -> dict:
    """This checkout's glm5_jax first on the children's path (not whatever else is installed), and a
    persistent XLA compilation cache so a restarted process does not compile everything again."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # above glm5_jax/
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if compile_cache and "JAX_COMPILATION_CACHE_DIR" not in env:
        env["JAX_COMPILATION_CACHE_DIR"] = compile_cache
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    return env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class Supervisor:
    def __init__(self, config: str, workdir: str, overrides: list[str], num_generators: int, *,
                 max_restarts: int = 100, log_dir: str | None = None, out=None):
        """`out`: where progress lines go (default: sys.stdout)."""
        from glm5_jax.rl.config import load_rl_config, resolve_sft

        self.workdir = storage.absolute(workdir)
        self.common = [f"--config={os.path.abspath(config)}", f"--workdir={self.workdir}"] + \
                      [f"--set={o}" for o in overrides] + [f"--set=rl.num_generators={num_generators}"]
        self.num_generators = num_generators
        self.max_restarts = max_restarts
        # the children's stdout goes to local files: on a gs:// workdir, under the local temp directory
        self.log_dir = log_dir or (os.path.join(tempfile.gettempdir(), "glm5_rl_logs", storage.basename(self.workdir))
                                   if storage.is_remote(self.workdir) else os.path.join(self.workdir, "logs"))
        self.compile_cache = storage.join(self.workdir, "jax_cache")   # JAX_COMPILATION_CACHE_DIR overrides
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts = {"learner": 0, **{f"gen{g}": 0 for g in range(num_generators)}}
        exp = load_rl_config(config, overrides)
        self.num_versions = exp.rl.num_versions
        self.sft_cfg, self.sft_workdir = resolve_sft(exp, self.workdir)
        self.console = Console(out)
        self.num_servers = exp.agentic.num_servers if exp.is_agentic else 0
        self.ports = {role: free_port() for role in [f"server{i}" for i in range(self.num_servers)]
                      + (["router"] if self.num_servers else [])}
        self.restarts.update({role: 0 for role in self.ports})
        self.kills: list[dict] = []

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"

    def _command(self, role: str) -> list[str]:
        if role == "learner":
            return [sys.executable, "-m", "glm5_jax.rl.learner", *self.common]
        if role == "sft":
            return [sys.executable, "-m", "glm5_jax.rl.sft", *self.common]
        if role.startswith("server"):
            return [sys.executable, "-m", "glm5_jax.rl.policy_server", *self.common, f"--port={self.ports[role]}",
                    f"--server_id={role[6:]}"]
        if role == "router":
            replicas = ",".join(self.url(f"server{i}") for i in range(self.num_servers))
            return [sys.executable, "-m", "glm5_jax.serve.router", f"--replicas={replicas}",
                    f"--port={self.ports[role]}", "--health_interval_s=0.2"]
        policy = [f"--policy_url={self.url('router')}"] if self.num_servers else []
        return [sys.executable, "-m", "glm5_jax.rl.generator", *self.common, f"--generator_id={role[3:]}", *policy]

    def _start(self, role: str) -> None:
        out = open(os.path.join(self.log_dir, f"{role}.log"), "a")
        self.procs[role] = subprocess.Popen(self._command(role), stdout=out, stderr=subprocess.STDOUT,
                                            env=child_env(self.compile_cache))
        out.close()

    def make_sft(self) -> None:
        from glm5_jax.rl.config import sft_checkpoint_dir
        from glm5_jax.rl.sft import final_sft_step

        os.makedirs(self.log_dir, exist_ok=True)
        sft_log = os.path.join(self.log_dir, "sft.log")
        step = final_sft_step(self.sft_cfg, self.sft_workdir)
        if step is not None:
            self.console.say(f"SFT: using {storage.join(sft_checkpoint_dir(self.sft_workdir), str(step))}")
        else:
            self.console.say(f"SFT: training {self.sft_workdir} ({self.sft_cfg.train.steps} steps; log {sft_log})")
        training, start = step is None, time.time()
        follower = LogFollower(storage.join(self.sft_workdir, "metrics.jsonl"), "step")
        with open(sft_log, "a") as out:
            proc = subprocess.Popen(self._command("sft"), stdout=out, stderr=subprocess.STDOUT,
                                    env=child_env(self.compile_cache))
        while True:
            rc = proc.poll()
            if training:                       # a line per logged SFT step
                for record in follower.poll():
                    self.console.say(sft_line(record, self.sft_cfg.train.steps))
            if rc is not None:
                break
            time.sleep(FOLLOW_SECONDS)
        if rc:
            raise RuntimeError(f"SFT step failed (exit {rc}); see {sft_log}")
        if training:
            self.console.say(f"SFT: done in {time.time() - start:.1f} s")

    def run(self, chaos_kills: int = 0, chaos_interval=(3.0, 7.0), chaos_seed: int = 0, chaos_roles=None,
            chaos_after_version: int = 0) -> dict:
        """Runs until the learner's last version. Fault injection: `chaos_roles` (role names or prefixes
        such as "gen") limits which children may be killed; the first kill is timed from the commit of
        version `chaos_after_version` (0: from the start, whatever is committed)."""
        os.makedirs(self.log_dir, exist_ok=True)
        began = time.time()
        if not self.num_servers:
            self.make_sft()
        # else multi-turn: the learner makes the (short) teacher SFT itself if it is missing (Learner.start),
        # while the servers and generators start up and wait for version 0
        start = time.time()
        for role in self.restarts:
            self._start(role)
        self.console.say(f"RL: {self.num_versions} steps; started {', '.join(self.restarts)} (logs in {self.log_dir})")
        metrics = LogFollower(storage.join(self.workdir, METRICS), "version")
        next_follow = 0.0
        rng = random.Random(chaos_seed)
        next_kill = None
        try:
            while True:
                if time.time() >= next_follow:
                    self._print_new_versions(metrics)
                    next_follow = time.time() + FOLLOW_SECONDS
                if chaos_kills and next_kill is None and not self.kills and \
                        (chaos_after_version <= 0 or max(committed_versions(policy_dir(self.workdir)), default=-1)
                         >= chaos_after_version):
                    next_kill = time.time() + rng.uniform(*chaos_interval)
                learner_rc = self.procs["learner"].poll()
                if learner_rc == 0:
                    break
                for role, proc in list(self.procs.items()):
                    rc = proc.poll()
                    if rc is None or (role != "learner" and rc == 0):
                        continue              # running, or a generator that saw the last version and stopped
                    self.restarts[role] += 1
                    if sum(self.restarts.values()) > self.max_restarts:
                        raise RuntimeError(f"more than {self.max_restarts} restarts; last: {role} exit {rc}; "
                                           f"see {self.log_dir}/{role}.log")
                    self.console.say(f"{role} exited with {rc}: restarting")
                    self._start(role)
                if next_kill is not None and time.time() >= next_kill:
                    live = sorted(r for r, p in self.procs.items() if p.poll() is None
                                  and (chaos_roles is None or r.startswith(tuple(chaos_roles))))
                    if live:
                        victim = rng.choice(live)
                        self.procs[victim].send_signal(signal.SIGKILL)
                        self.kills.append({"role": victim, "at": time.time() - start})
                        self.console.say(f"chaos: SIGKILL {victim} ({len(self.kills)}/{chaos_kills})")
                    next_kill = time.time() + rng.uniform(*chaos_interval) if len(self.kills) < chaos_kills else None
                time.sleep(0.05)
        finally:
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.terminate()
            for proc in self.procs.values():
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        report = {"seconds": time.time() - start, "restarts": self.restarts, "kills": self.kills}
        storage.write_atomically(storage.join(self.workdir, "supervisor.json"), json.dumps(report, indent=1).encode())
        self._print_new_versions(metrics)
        self._summarise(report, time.time() - began)
        return report

    def _print_new_versions(self, metrics: LogFollower) -> None:
        for record in metrics.poll():
            self.console.say(version_line(record, self.num_versions))

    def _summarise(self, report: dict, wall_seconds: float) -> None:
        from glm5_jax.rl.config import sft_checkpoint_dir

        records = storage.read_jsonl(storage.join(self.workdir, METRICS))
        logs = [os.path.join(self.log_dir, f"{role}.log") for role in ["sft", *self.restarts]
                if os.path.exists(os.path.join(self.log_dir, f"{role}.log"))]
        sft = storage.join(sft_checkpoint_dir(self.sft_workdir), str(self.sft_cfg.train.steps))
        for line in [outcome_line(records, report["seconds"], wall_seconds, report["restarts"]),
                     f"metrics: {storage.join(self.workdir, METRICS)}, {storage.join(self.workdir, SUMMARY)}",
                     f"checkpoints: policy versions in {policy_dir(self.workdir)}; SFT {sft}",
                     "logs: " + ", ".join(logs)]:
            self.console.say(line)


def main(argv):
    skip_absent_tpu()
    from absl import flags

    from glm5_jax.rl.config import load_rl_config
    from glm5_jax.rl.logs import setup_logging

    FLAGS = flags.FLAGS
    setup_logging("run")
    exp = load_rl_config(FLAGS.config, FLAGS.set)          # fail here, not in every child
    n = FLAGS.generators or exp.rl.num_generators
    Supervisor(FLAGS.config, FLAGS.workdir, FLAGS.set, n).run(
        FLAGS.chaos_kills, tuple(float(x) for x in FLAGS.chaos_interval), FLAGS.chaos_seed)


if __name__ == "__main__":
    from absl import app, flags

    from glm5_jax.rl.flags import define_common_flags

    define_common_flags()
    flags.DEFINE_integer("generators", 0, "Generator processes (0: rl.num_generators of the config).")
    flags.DEFINE_integer("chaos_kills", 0, "Fault injection: SIGKILL this many random children.")
    flags.DEFINE_list("chaos_interval", ["3", "7"], "Fault injection: seconds between kills (min,max).")
    flags.DEFINE_integer("chaos_seed", 0, "Fault injection: which children and when.")
    app.run(main)
