"""Number guessing: find a secret number in [0, 10**digits) from "higher" / "lower" answers.

Token protocol (ids configurable; the defaults extend the sort task's vocabulary, so a model needs 17):

    reset       -> [start]
    action      -> `digits` digit tokens then the end token (EOS), e.g. 4 2 <eos> guesses 42
    observation -> [higher] (secret is larger), [lower] (smaller), [invalid] (not a well-formed guess);
                   a correct guess ends the episode with reward 1 (there is no further observation)

A malformed guess costs a turn; running out of turns ends the episode with reward 0. Binary search
needs at most ceil(log2(10**digits)) + 1 turns (7 for two digits).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from glm5_jax.rl.env import Environment, StepResult


@dataclasses.dataclass(frozen=True)
class GuessTokens:
    digit0: int = 2        # digits d are digit0 + d
    end: int = 1           # EOS closes an action
    start: int = 12
    higher: int = 14
    lower: int = 15
    invalid: int = 16


class NumberGuess(Environment):
    def __init__(self, digits: int = 2, tokens: GuessTokens = GuessTokens()):
        if digits < 1:
            raise ValueError(f"digits={digits}: must be >= 1")
        self.digits, self.tokens = digits, tokens
        self.secret = None

    def reset(self, seed: int) -> list[int]:
        self.secret = int(np.random.default_rng(seed).integers(0, 10 ** self.digits))
        return [self.tokens.start]

    def encode_guess(self, number: int) -> list[int]:
        """The action that guesses `number` (for scripted policies and tests)."""
        return [self.tokens.digit0 + int(c) for c in f"{number:0{self.digits}d}"] + [self.tokens.end]

    def parse(self, action: list[int]) -> int | None:
        t = self.tokens
        body = action[:-1] if action and action[-1] == t.end else None
        if body is None or len(body) != self.digits or any(not 0 <= x - t.digit0 <= 9 for x in body):
            return None
        return int("".join(str(x - t.digit0) for x in body))

    def step(self, action: list[int]) -> StepResult:
        if self.secret is None:
            raise RuntimeError("step() before reset()")
        guess = self.parse(action)
        if guess is None:
            return StepResult([self.tokens.invalid], 0.0, False)
        if guess == self.secret:
            return StepResult([], 1.0, True)
        return StepResult([self.tokens.higher if guess < self.secret else self.tokens.lower], 0.0, False)


def feasible_range(env: NumberGuess, context: list[int]) -> tuple[int, int]:
    """[lo, hi] still possible after the guesses and answers in `context` (an episode so far:
    start, then action / observation pairs)."""
    t, lo, hi = env.tokens, 0, 10 ** env.digits - 1
    action, last = [], None
    for token in context[1:]:
        if token in (t.higher, t.lower, t.invalid):
            if token == t.higher and last is not None:
                lo = max(lo, last + 1)
            elif token == t.lower and last is not None:
                hi = min(hi, last - 1)
            action, last = [], None
            continue
        action.append(token)
        if token == t.end:
            last = env.parse(action)
    return lo, hi


def teacher_guess(env: NumberGuess, context: list[int], noise: float, rng: np.random.Generator) -> int:
    """The noisy teacher: binary search (the midpoint of the feasible range), except that with
    probability `noise` it guesses a uniformly random number, feasible or not (a wasted turn, mostly)."""
    if rng.random() < noise:
        return int(rng.integers(0, 10 ** env.digits))
    lo, hi = feasible_range(env, context)
    return (lo + hi) // 2
