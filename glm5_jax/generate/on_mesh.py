"""`generate` on a sampling mesh (`glm5_jax.parallel.sampling`): the prompt batch split over the batch axes,
weights resident by SAMPLING_RULES, the decode cache's slots over ``context``.

    mesh = sampling_mesh("data:2,expert:2,tensor:2")
    variables = place_variables(variables, cfg, mesh, SAMPLING_RULES)
    result = generate_on_mesh(cfg, variables, prompts_BT, lengths_B, mesh, max_new_tokens=64, temperature=0.0)

Any number of prompts works: a batch that does not divide the batch shards is padded with copies of its
last row (a greedy copy ends when its original does, so the loop runs no longer), which are dropped from
the result. The prompt width is padded (right, like any shorter prompt) so that the cache's slots divide
over ``context``. Padding is for layout: the prompts are placed already split over the batch axes (a split
needs a dimension that divides) and every shard holds as many rows. An unpadded batch that the program splits
itself decodes the same (tests/generate/test_generate_on_mesh.py). Rows, their tokens and log-probs are
those of the single-device `generate`.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from glm5_jax.generate.decoding import GenerationResult, prepare_generate
from glm5_jax.generate.settings import cache_slot_multiple
from glm5_jax.parallel.axes import BATCH, CACHE_SEQ
from glm5_jax.parallel.mesh import mesh_and_rules
from glm5_jax.parallel.sampling import SAMPLING_RULES, axis_shards


def padded_rows(prompt_tokens_BT, prompt_lengths_B, multiple: int):
    """(tokens, lengths) with copies of the last row appended up to a multiple of `multiple` rows."""
    extra = -len(prompt_lengths_B) % multiple
    return (np.concatenate([prompt_tokens_BT, np.repeat(prompt_tokens_BT[-1:], extra, 0)]),
            np.concatenate([prompt_lengths_B, np.repeat(prompt_lengths_B[-1:], extra)]))


def padded_width(prompt_tokens_BT, cache_extra: int, multiple: int):
    """The prompts right-padded so that width + `cache_extra` (the cache's slots) divides by `multiple`."""
    extra = -(prompt_tokens_BT.shape[1] + cache_extra) % multiple
    return np.pad(prompt_tokens_BT, ((0, 0), (0, extra)))


def place_prompts(prompt_tokens, prompt_lengths, mesh, rules, cache_extra: int, slot_multiple: int = 1):
    """(tokens, lengths, number of real rows): the prompts padded (rows to the batch shards, width so that
    width + `cache_extra` cache slots divide over ``context``, each shard's a multiple of `slot_multiple`:
    `settings.cache_slot_multiple`) and put on the mesh's batch axes."""
    prompt_tokens = np.asarray(prompt_tokens, np.int32)
    prompt_lengths = np.asarray(prompt_lengths, np.int32)
    rows = len(prompt_lengths)
    prompt_tokens, prompt_lengths = padded_rows(prompt_tokens, prompt_lengths, axis_shards(mesh, BATCH, rules))
    prompt_tokens = padded_width(prompt_tokens, cache_extra, axis_shards(mesh, CACHE_SEQ, rules) * slot_multiple)
    with mesh_and_rules(mesh, rules):
        batch_axes = nn.logical_to_mesh_axes((BATCH,))[0]
    tokens = jax.device_put(prompt_tokens, NamedSharding(mesh, P(batch_axes, None)))
    lengths = jax.device_put(prompt_lengths, NamedSharding(mesh, P(batch_axes)))
    return tokens, lengths, rows


def prepare_generate_on_mesh(cfg, variables, prompt_tokens, prompt_lengths, mesh, *, rules=SAMPLING_RULES,
                             max_new_tokens: int, speculative: bool = False, **kwargs):
    """(jitted program, its arguments, number of real rows): `prepare_generate` for `mesh`, the variables
    already on it (`glm5_jax.checkpoint.placement`). Trace, lower or call the program under
    ``mesh_and_rules(mesh, rules)``, then keep the real rows of its result (`real_rows`)."""
    cache_extra = max_new_tokens + (cfg.mtp_depth if speculative else 0)
    tokens, lengths, rows = place_prompts(prompt_tokens, prompt_lengths, mesh, rules, cache_extra,
                                          cache_slot_multiple(cfg))
    fn, args = prepare_generate(cfg, variables, tokens, lengths, max_new_tokens=max_new_tokens,
                                speculative=speculative, **kwargs)
    return fn, args[:3] + (jax.device_put(args[3], NamedSharding(mesh, P())),), rows


def real_rows(result: GenerationResult, rows: int) -> GenerationResult:
    """The first `rows` rows of a padded batch's result (the draft counts cover every row)."""
    routing = None if result.routing is None else jax.tree.map(lambda x: x[:, :rows], result.routing)
    return result._replace(tokens=result.tokens[:rows], lengths=result.lengths[:rows],
                           logprobs=result.logprobs[:rows], routing=routing)


def generate_on_mesh(cfg, variables, prompt_tokens, prompt_lengths, mesh, *, rules=SAMPLING_RULES,
                     **kwargs) -> GenerationResult:
    """`generate` on `mesh` (see the module docstring); same arguments, the result of the real rows."""
    fn, args, rows = prepare_generate_on_mesh(cfg, variables, prompt_tokens, prompt_lengths, mesh, rules=rules,
                                              **kwargs)
    with mesh_and_rules(mesh, rules):
        return real_rows(fn(*args), rows)
