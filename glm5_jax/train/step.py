"""The train state and one jitted, sharded training step (losses, accumulation, optimizer, routing bias).

`TrainState` is a plain pytree: step, params, optimizer state, the routing-bias collection, an RNG key.
Its shardings come from the parameters' logical axis names through the config's rules, so the same
code runs on one CPU, fake CPU meshes or a TPU pod. The step takes a `glm5_jax.data.Batch`, puts it into
the context-parallel layout once (`batch_losses`) and hands the laid-out arrays to the model and the losses.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.core import meta
from optax.transforms._masking import MaskedNode

from glm5_jax.data.batch import Batch
from glm5_jax.model.moe.layer import BIAS_COLLECTION
from glm5_jax.model.transformer import Transformer, lay_out_batch, routing_bias_rows_of_model
from glm5_jax.parallel.mesh import batch_sharding, logical_shardings, mesh_and_rules
from glm5_jax.train.losses import lm_losses, load_spread, update_routing_bias
from glm5_jax.train.optim import learning_rate_schedule, make_optimizer
from glm5_jax.train.stage import stage_spec


@struct.dataclass
class TrainState:
    step: jax.Array
    params: dict
    opt_state: optax.OptState
    moe_bias: dict
    rng: jax.Array


def batch_losses(model: Transformer, variables, batch: Batch, train_cfg, stage):
    """(total loss, its parts, the `ModelOutput`) of `model` on a natural-order `batch`, laid out once
    (`lay_out_batch`) for the model's inputs and the losses' targets; `stage`: a `StageSpec`. With
    ``runtime.loss_chunk_tokens`` the model returns each head's per-token NLL, not its logits."""
    inputs = lay_out_batch(model.cfg, batch)
    out = model.apply(variables, inputs, with_mtp=True, nll_only=model.cfg.runtime.loss_chunk_tokens > 0,
                      method=Transformer.forward_laid_out)
    total, parts = lm_losses(out, inputs, train_cfg, model.cfg, stage)
    return total, parts, out


class Trainer:
    """Builds the state, its shardings and the jitted step for one experiment on one mesh."""

    def __init__(self, exp_cfg, mesh):
        self.exp = exp_cfg
        self.mesh = mesh
        self.rules = exp_cfg.mesh.rules
        self.stage = stage_spec(exp_cfg.train.stage)
        self.model_cfg = self.stage.model_config(exp_cfg.model)       # the model as this stage runs it
        self.model = Transformer(self.model_cfg)
        self.tx = make_optimizer(exp_cfg.train, self.stage)
        self.lr_schedule = learning_rate_schedule(exp_cfg.train)
        self._init_boxed_jit = jax.jit(self._init_boxed)      # traced once: for shapes here and for init
        with self.context():
            # an abstract key: nothing runs here (the mesh may be an AOT topology without devices)
            abstract = self._init_boxed_jit.eval_shape(jax.ShapeDtypeStruct((2,), jnp.uint32))
        unboxed = meta.unbox(abstract)
        # optax marks frozen subtrees with MaskedNode (no arrays); keep them out of the sharding tree
        is_masked = lambda x: isinstance(x, MaskedNode)
        self.state_shardings = jax.tree.map(lambda a, s: a if is_masked(a) else s, unboxed,
                                            meta.unbox(logical_shardings(abstract, mesh, self.rules)),
                                            is_leaf=is_masked)
        self.abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                           unboxed, self.state_shardings)
        self.batch_sharding = batch_sharding(mesh, self.rules)          # of one [B, T] field
        self.batch_shardings = Batch(*(self.batch_sharding,) * 3)      # of a whole `Batch`
        self._step = jax.jit(self._train_step, in_shardings=(self.state_shardings, self.batch_shardings),
                             out_shardings=(self.state_shardings, None), donate_argnums=0)
        self._eval = jax.jit(self._eval_step, in_shardings=(self.state_shardings, self.batch_shardings))

    # ------------------------------------------------------------------ init
    def _init_boxed(self, rng):
        init_rng, state_rng = jax.random.split(rng)
        variables = self.model.init(init_rng, jnp.zeros((1, 8), jnp.int32))
        params = variables["params"]
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params),
                          moe_bias=variables.get(BIAS_COLLECTION, {}), rng=state_rng)

    def init_state(self, seed: int) -> TrainState:
        with self.context():
            init = jax.jit(lambda r: meta.unbox(self._init_boxed_jit(r)), out_shardings=self.state_shardings)
            return init(jax.random.PRNGKey(seed))

    def state_from_weights(self, params, moe_bias, seed: int) -> TrainState:
        """A step-0 state around given (already placed) weights: fresh optimizer state, the seed's RNG."""
        with self.context():
            opt_state = jax.jit(self.tx.init, out_shardings=self.state_shardings.opt_state)(params)
        _, rng = jax.random.split(jax.random.PRNGKey(seed))
        return TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), self.state_shardings.step), params=params,
                          opt_state=opt_state, moe_bias=moe_bias, rng=jax.device_put(rng, self.state_shardings.rng))

    def context(self):
        """The mesh and the logical-axis rules this trainer's code runs under."""
        return mesh_and_rules(self.mesh, self.rules)

    # ------------------------------------------------------------------ step
    def _loss(self, params, moe_bias, batch: Batch):
        total, parts, out = batch_losses(self.model, {"params": params, BIAS_COLLECTION: moe_bias}, batch,
                                         self.exp.train, self.stage)
        if self.model_cfg.runtime.moe_ep != "none":
            parts = {**parts, "moe_dropped": jnp.sum(out.stats.dropped)}
        return total, (parts, out.stats)

    def _accumulated_grads(self, params, moe_bias, batch):
        """Gradients, loss parts and `LayerStats` over `grad_accum` micro-batches: gradients and parts
        averaged (token counts summed), stats as `LayerStats.losses_divided_by` gives (loads summed)."""
        n = self.exp.train.grad_accum
        grad_fn = jax.value_and_grad(self._loss, has_aux=True)
        if n == 1:
            (_, (parts, stats)), grads = grad_fn(params, moe_bias, batch)
            return grads, parts, stats
        micro = jax.tree.map(lambda x: x.reshape((n, x.shape[0] // n) + x.shape[1:]), batch)

        def body(acc, mb):
            (_, (parts, stats)), g = grad_fn(params, moe_bias, mb)
            acc_g, acc_parts, acc_stats = acc
            return (jax.tree.map(jnp.add, acc_g, g), jax.tree.map(jnp.add, acc_parts, parts), acc_stats + stats), None

        (_, out_shape), grads_shape = jax.eval_shape(grad_fn, params, moe_bias, jax.tree.map(lambda x: x[0], micro))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (grads_shape,) + out_shape)
        (grads, parts, stats), _ = jax.lax.scan(body, zeros, micro)
        parts = {k: (v if k == "tokens" else v / n) for k, v in parts.items()}
        return jax.tree.map(lambda g: g / n, grads), parts, stats.losses_divided_by(n)

    def _train_step(self, state: TrainState, batch):
        train = self.exp.train
        grads, parts, stats = self._accumulated_grads(state.params, state.moe_bias, batch)
        labels = self.stage.trainable_labels(grads)
        trainable = jax.tree.map(lambda g, l: g if l == "train" else jnp.zeros_like(g), grads, labels)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        moe_bias = state.moe_bias
        if train.bias_update_rate and self.stage.updates_routing_bias and moe_bias:
            moe_bias = update_routing_bias(moe_bias, stats, routing_bias_rows_of_model(self.model_cfg),
                                           train.bias_update_rate)
        metrics = dict(parts)
        metrics["grad_norm"] = optax.tree.norm(trainable)
        metrics["lr"] = self.lr_schedule(state.step)
        if self.model_cfg.num_moe_layers or self.model_cfg.mtp_depth:
            spread = load_spread(stats.expert_load, stats.has_moe)
            metrics["expert_load_max_over_mean"] = jnp.sum(spread) / jnp.maximum(jnp.sum(stats.has_moe), 1)
            metrics["expert_load_max_over_mean_worst"] = jnp.max(spread)
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, moe_bias=moe_bias,
                               rng=jax.random.fold_in(state.rng, state.step))
        return new_state, metrics

    def _eval_step(self, state: TrainState, batch):
        _, (parts, _) = self._loss(state.params, state.moe_bias, batch)
        return {"eval_loss_sum": parts["lm_loss"] * parts["tokens"], "eval_tokens": parts["tokens"]}

    def step(self, state, batch):
        with self.context():
            return self._step(state, batch)

    def evaluate(self, state, batch):
        with self.context():
            return self._eval(state, batch)

    def put_batch(self, batch_np: Batch) -> Batch:
        """Host numpy `Batch` (this process's rows) -> one of global arrays sharded over the batch axes."""
        return jax.tree.map(jax.make_array_from_process_local_data, self.batch_shardings, batch_np)
