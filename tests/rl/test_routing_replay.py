"""Routing and DSA top-k replay in RL (rl.replay_experts / rl.replay_topk): the generator's recorded routing
goes into the rollout record (compact int16, per position of the learner's rows) and the learner's
log-probs, replaying it, are the sampler's own, where recomputing its own routing is not."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from rl_helpers import tiny_model_config

from glm5_jax.generate.decoding import Sampler, generate
from glm5_jax.model import routing_replay as rr
from glm5_jax.parallel.mesh import MeshConfig, build_mesh
from glm5_jax.rl import rollouts as ro
from glm5_jax.rl.config import RLConfig
from glm5_jax.rl.loss import policy_loss
from glm5_jax.rl.policy import Policy, completion_logprobs, replayed, rl_model_config, sampling_policy

B, P, C = 8, 6, 7           # rows, prompt width, completion width: 13 positions against index_topk 4


def _learner_and_sampler():
    sft = tiny_model_config(index_topk=4)
    rl = RLConfig(replay_experts=True, replay_topk=True)
    sampler = sampling_policy(rl, sft)
    assert sampler.cfg.runtime.capture_routing and not rl_model_config(sft).runtime.capture_routing
    mesh_cfg = MeshConfig(data=1, fsdp=1)
    learner = Policy(rl_model_config(sft), build_mesh(mesh_cfg, jax.devices()[:1]), mesh_cfg.rules)
    variables = jax.jit(learner.model.init)(jax.random.PRNGKey(3), jnp.zeros((1, 8), jnp.int32))
    variables = jax.tree.map(lambda x: getattr(x, "value", x), variables, is_leaf=lambda x: hasattr(x, "value"))
    # the sampler chooses differently: another routing bias and other indexer weights (both only choose)
    rng = np.random.default_rng(5)
    flat = traverse_util.flatten_dict(variables["params"])
    params = traverse_util.unflatten_dict({k: v + rng.standard_normal(v.shape).astype(np.float32) if "indexer" in k
                                           else v for k, v in flat.items()})
    bias = jax.tree.map(lambda b: b + 2.0 * rng.standard_normal(b.shape).astype(np.float32), variables["moe_bias"])
    return rl, learner, sampler, variables, {**variables, "params": params, "moe_bias": bias}


def test_learner_replaying_the_record_reproduces_the_sampler():
    rl, learner, sampler, learner_vars, sampler_vars = _learner_and_sampler()
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, P + 1, B).astype(np.int32)
    prompts = rng.integers(2, 14, (B, P)).astype(np.int32)
    with sampler.context():
        out = generate(sampler.cfg, sampler_vars, prompts, lengths, max_new_tokens=C, temperature=1.0,
                       rng=jax.random.PRNGKey(1))
    fields = ro.routing_fields(rr.extract(sampler.cfg, jax.device_get(out.routing), P + C), replayed(rl))
    assert fields["routed_experts"].dtype == np.int16 and fields["routed_experts"].shape == (B, P + C, 1, 2)
    assert fields["selected_slots"].dtype == np.int16 and fields["selected_slots"].shape == (B, P + C, 2, 4)

    def logp(replay):
        with learner.context():
            return np.asarray(jax.jit(lambda v, a, b, c, d, r: completion_logprobs(
                learner.model, v, a, b, c, d, Sampler(1.0), r))(learner_vars, prompts, lengths, out.tokens,
                                                                out.lengths, replay))

    mask = (np.arange(C)[None] < np.asarray(out.lengths)[:, None]).astype(np.float32)
    behaviour = np.asarray(out.logprobs)
    replay = {name: jnp.asarray(a, jnp.int32) for name, a in fields.items()}
    replayed_logp, own_logp = logp(replay), logp(None)
    np.testing.assert_allclose(np.where(mask > 0, replayed_logp, 0), np.where(mask > 0, behaviour, 0), atol=2e-5)
    assert np.abs(own_logp - behaviour)[mask > 0].max() > 1e-2
    # the DIS weights of the replayed forward: on policy, every token kept with ratio 1
    _, stats = policy_loss(jnp.asarray(replayed_logp), jnp.asarray(behaviour), jnp.ones(B), jnp.asarray(mask))
    assert float(stats["keep_fraction"]) == 1.0 and float(stats["logp_abs_diff"]) < 2e-5
    # replaying experts only leaves the top-k to the learner: still off the sampler
    experts_only = logp({"routed_experts": replay["routed_experts"]})
    assert np.abs(experts_only - behaviour)[mask > 0].max() > 1e-3


def test_routing_fields_round_trip_through_a_record():
    rng = np.random.default_rng(1)
    experts = rng.integers(0, 4, (2, P + C, 1, 2)).astype(np.int32)
    slots = np.where(rng.random((2, P + C, 2, 4)) < 0.5, rng.integers(0, P + C, (2, P + C, 2, 4)), -1)
    fields = ro.routing_fields({"routed_experts": experts, "selected_slots": slots}, ["routed_experts",
                                                                                   "selected_slots"])
    batch = ro.RolloutBatch(
        prompt_tokens=np.ones((2, P), np.int32), prompt_lengths=np.full(2, P, np.int32),
        completion_tokens=np.ones((2, C), np.int32), completion_lengths=np.full(2, C, np.int32),
        logprobs=np.zeros((2, C), np.float32), loss_mask=np.ones((2, C), np.float32), rewards=np.zeros(2, np.float32),
        group_ids=np.zeros(2, np.int32), versions=np.zeros((2, 1), np.int32), meta={}, **fields)
    back = ro.decode(ro.encode(batch))
    np.testing.assert_array_equal(back.routed_experts, experts)
    np.testing.assert_array_equal(back.selected_slots, slots)
    assert ro.content_sha256(back) == ro.content_sha256(batch)
    batch.selected_slots = fields["selected_slots"][:, :-1]
    with pytest.raises(ro.CorruptRollout, match="selected_slots covers 12 positions, the rows 13"):
        batch.validate()


def test_topk_replay_needs_an_indexer():
    with pytest.raises(ValueError, match="no DSA indexer"):
        sampling_policy(RLConfig(replay_topk=True), tiny_model_config(use_indexer=False))


def test_an_episode_keeps_each_positions_first_run_and_fills_its_record():
    """Turn 2 re-reports turn 1's positions (its prefix came from the cache): the episode keeps what ran first.
    The record lays each episode's routing at its absolute positions, -1 after, in the record's width."""
    from glm5_jax.rl.env import Episode, Sampled, episodes_to_batch, run_episode

    turn1 = {"routed_experts": np.full((5, 1, 2), 1), "selected_slots": np.full((5, 2, 6), 2)}
    turn2 = {"routed_experts": np.full((9, 1, 2), 3), "selected_slots": np.full((9, 2, 6), 4)}
    answers = iter([Sampled([5, 1], [-0.5, -0.25], 0, routing=turn1), Sampled([6, 1], [-0.5, -0.25], 0, 0,
                                                                              routing=turn2)])

    class Env:
        def reset(self, seed):
            return [9, 9, 9, 9]

        def step(self, action):
            from glm5_jax.rl.env import StepResult
            return StepResult([8, 8], 0.5, action[0] == 6)

    episode = run_episode(lambda *a: next(answers), Env(), 0, max_turns=2, max_action_tokens=2)
    assert episode.completion == [5, 1, 8, 8, 6, 1]
    np.testing.assert_array_equal(episode.routing["routed_experts"][:, 0, 0], [1] * 5 + [3] * 4)
    batch = episodes_to_batch([episode, Episode(prompt=[9, 9, 9])], [0, 0], {}, completion_width=8,
                              routing_shapes={"routed_experts": (1, 2), "selected_slots": (2, 4)})
    assert batch.routed_experts.shape == (2, 12, 1, 2) and batch.routed_experts.dtype == np.int16
    np.testing.assert_array_equal(batch.routed_experts[0, :, 0, 0], [1] * 5 + [3] * 4 + [-1] * 3)
    assert (batch.routed_experts[1] == -1).all()
    np.testing.assert_array_equal(batch.selected_slots[0, 0, 0], [2, 2, 2, 2])    # recorded 6 wide, cut to 4
