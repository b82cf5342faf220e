"""The three roles of the RL handoff, each run as its own process by test_handoff_gcs.py, on one workdir:
generator (writes rollout batches), learner (consumes them in global order, publishes one policy version
per batch through orbax, deletes consumed files), server (polls committed versions and reads each)."""
import json
import sys
import time

import numpy as np

from glm5_jax import storage
from glm5_jax.checkpoint.handoff import PolicyReader, PolicyWriter
from glm5_jax.rl import rollouts as ro

N_GEN, N_SEQ = 2, 3


def batch(g, seq):
    rng = np.random.default_rng(100 * g + seq)
    n, C = 4, 3
    return ro.RolloutBatch(
        prompt_tokens=rng.integers(2, 12, (n, 5)).astype(np.int32), prompt_lengths=np.full(n, 5, np.int32),
        completion_tokens=rng.integers(2, 12, (n, C)).astype(np.int32), completion_lengths=np.full(n, C, np.int32),
        logprobs=-rng.random((n, C)).astype(np.float32), loss_mask=np.ones((n, C), np.float32),
        rewards=rng.random(n).astype(np.float32), group_ids=(np.arange(n) // 2).astype(np.int32),
        versions=np.zeros((n, 1), np.int32), meta={"generator": g, "seq": seq})


def generator(workdir, g):
    dirs = ro.RolloutDirs(workdir)
    dirs.clear_tmp(g)
    for seq in range(N_SEQ):
        ro.write_batch(dirs, g, seq, batch(g, seq))


def learner(workdir):
    dirs, writer = ro.RolloutDirs(workdir), PolicyWriter(workdir, max_to_keep=2)
    ledger, w = [], np.zeros(8, np.float32)
    for ordinal in range(N_GEN * N_SEQ):
        g, seq = ordinal % N_GEN, ordinal // N_GEN
        path = dirs.path(g, seq)
        while not storage.exists(path):
            time.sleep(0.02)
        got, sha = ro.read_batch(path)
        ledger.append({"ordinal": ordinal, "generator": g, "seq": seq, "sha256": sha})
        w = w + float(got.rewards.sum())
        writer.publish(ordinal + 1, {"params": {"w": w}},
                       {"version": ordinal + 1, "ledger": list(ledger)})   # saved asynchronously: a copy
        storage.remove(path)
    writer.wait()
    writer.close()


def server(workdir, out):
    reader, seen = PolicyReader(workdir), {}
    deadline = time.time() + 50
    while time.time() < deadline and max(seen, default=0) < N_GEN * N_SEQ:
        latest = reader.latest_version()
        if latest is not None and latest not in seen:
            try:
                seen[latest] = reader.read_meta(latest)
            except Exception:            # deleted by max_to_keep between listing and reading: skip it
                pass
        time.sleep(0.02)
    storage.write_atomically(out, json.dumps({str(k): v for k, v in seen.items()}).encode())


if __name__ == "__main__":
    role, workdir = sys.argv[1], sys.argv[2]
    {"generator": lambda: generator(workdir, int(sys.argv[3])), "learner": lambda: learner(workdir),
     "server": lambda: server(workdir, sys.argv[3])}[role]()
