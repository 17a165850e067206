"""PromptSampler: deterministic epochs, exact resume, top-up draws."""

import pytest

from megatron_gspo.data import PromptItem, PromptSampler

DATA = [PromptItem(f"p{i}", str(i)) for i in range(10)]


def prompts(batch):
    return [item.prompt for item in batch]


def test_each_epoch_is_a_permutation_and_deterministic():
    sampler = PromptSampler(DATA, batch_size=5, seed=7)
    epoch0 = prompts(next(sampler)) + prompts(next(sampler))
    epoch1 = prompts(next(sampler)) + prompts(next(sampler))
    assert sorted(epoch0) == sorted(epoch1) == sorted(prompts(DATA))
    assert epoch0 != epoch1 and sampler.epoch == 2
    again = PromptSampler(DATA, batch_size=5, seed=7)
    assert [prompts(next(again)) for _ in range(4)] == [epoch0[:5], epoch0[5:], epoch1[:5], epoch1[5:]]
    assert prompts(next(PromptSampler(DATA, batch_size=10, seed=8))) != epoch0


def test_batches_straddle_epochs_and_top_up_continues_the_stream():
    a = PromptSampler(DATA, batch_size=4, seed=1)
    stream = prompts(a.next_items(30))
    b = PromptSampler(DATA, batch_size=4, seed=1)
    mixed = prompts(next(b)) + prompts(b.next_items(1)) + prompts(b.next_items(0)) + prompts(next(b))
    mixed += prompts(next(b)) + prompts(b.next_items(17))
    assert mixed == stream
    assert (b.epoch, b.position) == (3, 0)


def test_unshuffled_order_is_the_dataset_order():
    sampler = PromptSampler(DATA, batch_size=3, shuffle=False)
    assert prompts(sampler.next_items(12)) == prompts(DATA) + ["p0", "p1"]


@pytest.mark.parametrize("consumed", [0, 3, 9, 10, 23])
def test_resume_from_state_dict_gives_the_same_next_batches(consumed):
    original = PromptSampler(DATA, batch_size=4, seed=3)
    original.next_items(consumed)
    state = original.state_dict()
    resumed = PromptSampler(DATA, batch_size=4, seed=3)
    resumed.load_state_dict(dict(state))
    expected = [prompts(next(original)) for _ in range(6)]
    assert [prompts(next(resumed)) for _ in range(6)] == expected


def test_state_from_other_data_or_seed_is_refused():
    state = PromptSampler(DATA, batch_size=4, seed=3).state_dict()
    with pytest.raises(ValueError, match="dataset_size=10 but this sampler has dataset_size=9"):
        PromptSampler(DATA[:9], batch_size=4, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=3 but this sampler has seed=4"):
        PromptSampler(DATA, batch_size=4, seed=4).load_state_dict(state)


def test_bad_arguments():
    with pytest.raises(ValueError, match="batch_size=0 must be > 0"):
        PromptSampler(DATA, batch_size=0)
    with pytest.raises(ValueError, match="non-empty dataset"):
        PromptSampler([], batch_size=1)
