"""Multi-turn RL end to end: learner, policy server, router and a generator as processes under the
supervisor, number guessing played over HTTP, the server SIGKILLed once and restarted (bench/agentic_rl.py
runs 2 generators, the async mode and 10 kills of every role).

Lockstep (tau = 0) pins batch o to version o, so every recorded log-prob is on-policy when it is
trained on: the learner's recomputation must give |r - 1| <= 1e-5 on every policy token of every turn.
"""
import json
import textwrap

from rl_helpers import TINY_MODEL

from glm5_jax.rl.agentic import env_seeds
from glm5_jax.rl.number_guess import GuessTokens
from glm5_jax.rl.run import Supervisor

VERSIONS, PROMPTS, GROUP, MAX_TURNS = 4, 2, 2, 3


def write_configs(folder):
    model = {**TINY_MODEL, "vocab_size": GuessTokens().invalid + 1, "index_topk": 16,
             "eos_token_id": (GuessTokens().end,)}
    sft = folder / "guess_sft.py"
    sft.write_text(textwrap.dedent(f"""
        import dataclasses
        from configs.guess_sft import get_config as base
        from glm5_jax.model.config import ModelConfig

        def get_config():
            cfg = base()
            return dataclasses.replace(cfg, model=ModelConfig.from_fields({model!r}),
                                       data=dataclasses.replace(cfg.data, batch_size=8),
                                       train=dataclasses.replace(cfg.train, steps=1, warmup_steps=1, log_every=1))
    """))
    rl = folder / "rl_guess.py"
    rl.write_text(textwrap.dedent(f"""
        from glm5_jax.rl.config import AgenticConfig, RLConfig, RLExperiment

        def get_config():
            return RLExperiment(
                rl=RLConfig(task="number_guess", num_versions={VERSIONS}, tau=0, lockstep=True,
                            prompts_per_batch={PROMPTS}, group_size={GROUP}, learning_rate=1e-3, eval_every=0),
                agentic=AgenticConfig(digits=1, max_turns={MAX_TURNS}, step_latency_s=0.05, server_max_batch=8,
                                      retry_s=60.0),
                sft_config={str(sft)!r})
    """))
    return str(rl)


def test_multi_turn_run_through_server_survives_a_server_kill(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")      # children: 1 device, fast compiles
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "cache"))
    config = write_configs(tmp_path)
    workdir = tmp_path / "run"
    report = Supervisor(config, str(workdir), [f"sft_workdir={tmp_path / 'sft'}"], num_generators=1).run(
        chaos_kills=1, chaos_interval=(0.2, 0.8), chaos_roles=("server",), chaos_after_version=1)
    assert [k["role"] for k in report["kills"]] == ["server0"]
    assert report["restarts"]["server0"] == 1 and sum(report["restarts"].values()) == 1, report

    summary = json.loads((workdir / "rl_summary.json").read_text())
    ledger = summary["consumed"]
    assert [e["ordinal"] for e in ledger] == list(range(VERSIONS)), "every batch exactly once, in order"
    assert all(e["status"] == "used" for e in ledger) and summary["final_version"] == VERSIONS
    # lockstep, tau = 0: batch o is played by version o and trained at version o (staleness 0 <= tau)
    assert all(e["sampled_with"] == e["trained_at"] == e["ordinal"] for e in ledger)
    # every episode exactly once: the environment seeds are those of the batch's ordinal
    assert all(e["episodes"] == env_seeds(0, e["ordinal"], PROMPTS) for e in ledger)
    turns = [t for e in ledger for t in e["turns"]]
    assert len(turns) == VERSIONS * PROMPTS * GROUP and all(1 <= t <= MAX_TURNS for t in turns)
    assert max(turns) > 1, "some episode must span several turns"

    records = [json.loads(line) for line in open(workdir / "rl_metrics.jsonl")]
    assert [r["version"] for r in records] == list(range(VERSIONS + 1)), "versions monotonic, none lost"
    for r in records[1:]:
        # TITO: the server's log-probs of every action token equal the learner's recomputation
        assert r["staleness"] == 0 and r["ratio_max_dev"] <= 1e-5 and r["keep_fraction"] == 1.0, r
