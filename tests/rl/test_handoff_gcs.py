"""The RL handoff protocol with its directory on gs:// (a GCS emulator): generators, the learner and a
policy server as separate processes. Every batch is consumed exactly once, in global order, with the
bytes its generator wrote; the server reads only committed versions, each with the ledger it carries;
consumed rollout objects are deleted and nothing is left in tmp/."""
import json
import os
import subprocess
import sys

from gcs_handoff_roles import N_GEN, N_SEQ, batch

from glm5_jax import storage
from glm5_jax.rl import rollouts as ro

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def test_handoff_on_gcs_consumes_every_batch_once(gcs_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, HERE]), "JAX_PLATFORMS": "cpu"}
    script = os.path.join(HERE, "gcs_handoff_roles.py")
    seen_file = str(tmp_path / "server_seen.json")
    procs = [subprocess.Popen([sys.executable, script, "learner", gcs_dir], env=env),
             subprocess.Popen([sys.executable, script, "server", gcs_dir, seen_file], env=env)]
    procs += [subprocess.Popen([sys.executable, script, "generator", gcs_dir, str(g)], env=env) for g in range(N_GEN)]
    for p in procs:
        assert p.wait(timeout=60) == 0

    want = [{"ordinal": o, "generator": o % N_GEN, "seq": o // N_GEN,
             "sha256": ro.content_sha256(batch(o % N_GEN, o // N_GEN))} for o in range(N_GEN * N_SEQ)]
    seen = {int(v): meta for v, meta in json.load(open(seen_file)).items()}
    assert max(seen) == N_GEN * N_SEQ
    for version, meta in seen.items():                 # each version read whole, with its own ledger
        assert meta["version"] == version and meta["ledger"] == want[:version]
    dirs = ro.RolloutDirs(gcs_dir)
    assert [dirs.seqs_of(g) for g in range(N_GEN)] == [[]] * N_GEN      # consumed files deleted
    assert storage.glob(dirs.tmp, "*") == []


def test_rejected_rollout_moves_on_gcs(gcs_dir):
    """No rename on object storage: reject copies to rejected/ then deletes from ready/."""
    dirs = ro.RolloutDirs(gcs_dir)
    path = ro.write_batch(dirs, 1, 4, batch(1, 4))
    assert dirs.seqs_of(1) == [4]
    dirs.reject(path)
    assert dirs.seqs_of(1) == [] and not storage.exists(path)
    assert ro.read_batch(storage.join(dirs.rejected, "g001_s0000004.rollout"))[1] == ro.content_sha256(batch(1, 4))
