"""The generated "sort" source: sort 6 digits, demonstrated by a noisy teacher (docs/training.md#the-sort-task).

A document is ``S d1 .. d6 = a1 .. a6 <eos>`` over a fixed 14-token vocabulary. The teacher writes
the digits in ascending order, but in half of the demos (`TEACHER_SWAP_PROB`) it swaps two adjacent
answer tokens, so SFT on it plateaus at the teacher's quality and RL with an exact-match reward has
something to fix. Every example is a pure function of (seed, split, index): no files, no downloads.

``DataConfig(source="sort", seq_len>=15)`` selects it in `build_data_pipeline`: one example per row
(segment 1, then padding), global batch b holds examples b*batch_size .. (b+1)*batch_size - 1.
"""
from __future__ import annotations

import dataclasses

import grain
import numpy as np
import tokenizers

from glm5_jax.data.batch import Batch
from glm5_jax.data.config import DataConfig, DataError
from glm5_jax.data.tokenizer import EOS_TOKEN, PAD_TOKEN, Tokenizer

SORT = "sort"                       # DataConfig.source naming this generated task
NUM_DIGITS = 6
TEACHER_SWAP_PROB = 0.5
VOCAB = (PAD_TOKEN, EOS_TOKEN) + tuple("0123456789") + ("S", "=")
PAD_ID, EOS_ID, DIGIT0_ID, START_ID, EQUALS_ID = 0, 1, 2, 12, 13
PROMPT_LEN = NUM_DIGITS + 2         # S d1..d6 =
ANSWER_LEN = NUM_DIGITS + 1         # a1..a6 <eos>
EXAMPLE_LEN = PROMPT_LEN + ANSWER_LEN
EVAL_EXAMPLES = 1024
_SPLIT_SALT = {"train": 0, "eval": 1, "rl": 2}


def sort_tokenizer() -> Tokenizer:
    """The fixed word-level vocabulary (pad 0, eos 1, digits 2..11, S 12, = 13) as a `Tokenizer`."""
    model = tokenizers.models.WordLevel({tok: i for i, tok in enumerate(VOCAB)}, unk_token=PAD_TOKEN)
    hf = tokenizers.Tokenizer(model)
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Split("", behavior="isolated")
    hf.add_special_tokens([PAD_TOKEN, EOS_TOKEN])
    return Tokenizer(hf, EOS_TOKEN)


def digits_of(seed: int | tuple[int, ...], split: str, index: int) -> np.ndarray:
    """The NUM_DIGITS digits (0..9) of example `index` of `split`: a pure function of its arguments.
    `seed` may be a tuple (e.g. (seed, generator)) naming an independent stream."""
    key = [*(seed if isinstance(seed, tuple) else (seed,)), _SPLIT_SALT[split], index]
    rng = np.random.default_rng(key)
    return rng.integers(0, 10, NUM_DIGITS)


def prompt_ids(digits: np.ndarray) -> np.ndarray:
    return np.concatenate([[START_ID], DIGIT0_ID + np.asarray(digits), [EQUALS_ID]]).astype(np.int32)


def correct_answer_ids(digits: np.ndarray) -> np.ndarray:
    """The exact-match target: sorted digits then EOS."""
    return np.concatenate([DIGIT0_ID + np.sort(digits), [EOS_ID]]).astype(np.int32)


def teacher_example(seed: int, split: str, index: int) -> np.ndarray:
    """int32 [EXAMPLE_LEN]: prompt + the noisy teacher's answer (adjacent swap with TEACHER_SWAP_PROB)."""
    digits = digits_of(seed, split, index)
    answer = correct_answer_ids(digits)
    noise = np.random.default_rng([seed, _SPLIT_SALT[split], index, 1])
    if noise.random() < TEACHER_SWAP_PROB:
        i = int(noise.integers(0, NUM_DIGITS - 1))
        answer[i], answer[i + 1] = answer[i + 1], answer[i]
    return np.concatenate([prompt_ids(digits), answer])


class SortBatch(grain.transforms.Map):
    """Global batch index -> this process's rows, a `Batch` of int32 [B, seq_len]."""

    def __init__(self, seed: int, split: str, batch_size: int, seq_len: int, rows: slice):
        self.seed, self.split, self.batch_size, self.seq_len, self.rows = seed, split, batch_size, seq_len, rows

    def map(self, batch_index: int) -> Batch:
        first = int(batch_index) * self.batch_size
        indices = range(first, first + self.batch_size)[self.rows]
        tokens = np.zeros((len(indices), self.seq_len), np.int32)
        segment_ids = np.zeros_like(tokens)
        positions = np.zeros_like(tokens)
        for row, index in enumerate(indices):
            tokens[row, :EXAMPLE_LEN] = teacher_example(self.seed, self.split, index)
            segment_ids[row, :EXAMPLE_LEN] = 1
            positions[row, :EXAMPLE_LEN] = np.arange(EXAMPLE_LEN)
        return Batch.from_rows(tokens, segment_ids, positions)


@dataclasses.dataclass(frozen=True)
class SortPipeline:
    """Same interface as `DataPipeline` (tokenizer, train_dataset(), eval_dataset()) for the sort task."""
    config: DataConfig
    process_index: int
    process_count: int

    def __post_init__(self):
        if self.config.seq_len < EXAMPLE_LEN:
            raise DataError(f"source 'sort' needs DataConfig.seq_len >= {EXAMPLE_LEN}, got {self.config.seq_len}")
        self.config.per_process_batch(self.process_count)

    has_eval = True                                   # generated eval examples

    @property
    def tokenizer(self) -> Tokenizer:
        return sort_tokenizer()

    def _dataset(self, split: str, num_batches: int) -> grain.IterDataset:
        rows = self.config.per_process_batch(self.process_count)
        mine = slice(self.process_index * rows, (self.process_index + 1) * rows)
        return grain.MapDataset.range(num_batches).map(
            SortBatch(self.config.seed, split, self.config.batch_size, self.config.seq_len, mine)).to_iter_dataset()

    def train_dataset(self) -> grain.IterDataset:
        return self._dataset("train", 1 << 40)       # fresh examples forever

    def eval_dataset(self) -> grain.IterDataset:
        return self._dataset("eval", max(EVAL_EXAMPLES // self.config.batch_size, 1))
