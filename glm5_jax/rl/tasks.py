"""RL tasks: a prompt source plus a verifier, behind one small interface.

Prompts are pure functions of (seed, generator, sequence number) so a restarted generator neither
skips nor repeats (docs/training.md#generators-resume-without-gaps-or-repeats); the verifier scores generated
token ids directly (TITO: no text round trip).
"""
from __future__ import annotations

import abc

import numpy as np

from glm5_jax.data import sort_task


class Task(abc.ABC):
    """prompts(...) -> (prompt_tokens int32 [N, P] right-padded with 0, prompt_lengths int32 [N])."""

    eos_ids: tuple[int, ...] = ()

    @abc.abstractmethod
    def prompts(self, seed: int, generator: int, seq: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The n prompts of batch `seq` of `generator`."""

    @abc.abstractmethod
    def eval_prompts(self, seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """n fixed held-out prompts."""

    @abc.abstractmethod
    def reward(self, prompt_ids: np.ndarray, completion_ids: np.ndarray) -> float:
        """Reward of one completion (ids up to and including EOS, no padding) for one prompt (no padding)."""

    def rewards(self, prompt_BP, prompt_lengths_B, completion_BC, completion_lengths_B) -> np.ndarray:
        return np.asarray([self.reward(p[:lp], c[:lc]) for p, lp, c, lc in
                           zip(prompt_BP, prompt_lengths_B, completion_BC, completion_lengths_B)], np.float32)


class SortTask(Task):
    """Sort NUM_DIGITS digits; reward 1 for the exact sorted answer followed by EOS, else 0.
    Background: docs/training.md#the-sort-task.
    partial_credit: the fraction of the NUM_DIGITS + 1 answer positions that are right (a dense reward)."""

    eos_ids = (sort_task.EOS_ID,)

    def __init__(self, partial_credit: bool = False):
        self.partial_credit = partial_credit

    def _batch(self, seed, split, first, n):
        # RL prompts come from their own stream ("rl"), disjoint from the SFT demos and the eval prompts
        prompts = np.stack([sort_task.prompt_ids(sort_task.digits_of(seed, split, first + i)) for i in range(n)])
        return prompts, np.full((n,), sort_task.PROMPT_LEN, np.int32)

    def prompts(self, seed, generator, seq, n):
        # a disjoint index range per (generator, seq): generator g's batch s uses indices of stream (g, s)
        return self._batch((seed, generator), "rl", seq * n, n)

    def eval_prompts(self, seed, n):
        return self._batch(seed, "eval", 0, n)

    def reward(self, prompt_ids, completion_ids):
        digits = np.asarray(prompt_ids[1:1 + sort_task.NUM_DIGITS]) - sort_task.DIGIT0_ID
        target = sort_task.correct_answer_ids(digits)
        if self.partial_credit:
            n = min(len(completion_ids), len(target))
            return float(np.sum(np.asarray(completion_ids[:n]) == target[:n]) / len(target))
        return float(len(completion_ids) == len(target) and np.array_equal(completion_ids, target))


TASKS = {"sort": SortTask, "sort_partial": lambda: SortTask(partial_credit=True)}
# multi-turn environments (glm5_jax.rl.env): episodes played through a policy server
# (glm5_jax.rl.agentic), rewards from the environment
ENVIRONMENTS = ("number_guess",)


def is_environment(name: str) -> bool:
    return name in ENVIRONMENTS


def make_task(name: str) -> Task:
    if name not in TASKS:
        hint = " (a multi-turn environment: it has no single-turn prompts)" if is_environment(name) else ""
        raise ValueError(f"rl.task={name!r}: unknown task{hint}; known: {sorted(TASKS)}")
    return TASKS[name]()
