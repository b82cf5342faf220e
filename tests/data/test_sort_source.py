"""The generated "sort" source: format, the noisy teacher's statistics, determinism, process slicing."""
import numpy as np
import pytest

from data_helpers import check_row_invariants
from glm5_jax.data import DataConfig, DataError, build_data_pipeline
from glm5_jax.data import sort_task as st


def _pipeline(process_index=0, process_count=1, **kw):
    return build_data_pipeline(DataConfig(source="sort", seq_len=16, batch_size=8, **kw), "/nonexistent",
                               process_index=process_index, process_count=process_count)


def test_rows_hold_one_example_then_padding():
    batch = next(iter(_pipeline().train_dataset()))
    check_row_invariants(batch, 8, 16)
    np.testing.assert_array_equal(batch.segment_ids[:, :15], 1)
    np.testing.assert_array_equal(batch.segment_ids[:, 15], 0)
    np.testing.assert_array_equal(batch.positions[0, :15], np.arange(15))
    for row in batch.tokens:
        assert row[0] == st.START_ID and row[7] == st.EQUALS_ID and row[14] == st.EOS_ID and row[15] == st.PAD_ID
        digits, answer = row[1:7] - st.DIGIT0_ID, row[8:14] - st.DIGIT0_ID
        assert sorted(answer) == sorted(digits)              # a permutation of the prompt's digits...
        wrong = np.nonzero(answer != np.sort(digits))[0]
        # ...that is sorted, or sorted with one adjacent pair swapped
        assert len(wrong) == 0 or (len(wrong) == 2 and wrong[1] == wrong[0] + 1)


def test_teacher_is_right_about_as_often_as_designed():
    n = 4000
    correct = np.mean([np.array_equal(st.teacher_example(0, "train", i)[8:], st.correct_answer_ids(
        st.digits_of(0, "train", i))) for i in range(n)])
    # 50% untouched + the swaps of two equal digits: P(adjacent sorted digits equal) = 1 - P(distinct neighbours)
    swaps_equal = np.mean([len(set(st.digits_of(1, "eval", i))) < 6 for i in range(n)])   # loose upper bound
    assert 0.5 < correct < 0.5 + 0.5 * swaps_equal + 0.03, (correct, swaps_equal)


def test_batches_are_deterministic_and_split_by_process():
    whole = next(iter(_pipeline().train_dataset()))
    again = next(iter(_pipeline().train_dataset()))
    np.testing.assert_array_equal(whole.tokens, again.tokens)
    halves = [next(iter(_pipeline(i, 2).train_dataset())).tokens for i in range(2)]
    np.testing.assert_array_equal(np.concatenate(halves), whole.tokens)
    it = iter(_pipeline().train_dataset())
    next(it)
    state = it.get_state()
    second = next(it).tokens
    it2 = iter(_pipeline().train_dataset())
    it2.set_state(state)
    np.testing.assert_array_equal(next(it2).tokens, second)
    assert not np.array_equal(second, whole.tokens)
    eval_first = next(iter(_pipeline().eval_dataset())).tokens
    assert not np.array_equal(eval_first, whole.tokens)   # held-out stream


def test_tokenizer_and_errors():
    tok = _pipeline().tokenizer
    assert tok.vocab_size == 14 and tok.eos_id == st.EOS_ID
    np.testing.assert_array_equal(tok.encode("S305="), [12, 5, 2, 7, 13])
    with pytest.raises(DataError, match="seq_len >= 15"):
        build_data_pipeline(DataConfig(source="sort", seq_len=8, batch_size=8), "/x", process_index=0,
                            process_count=1)
