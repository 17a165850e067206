"""Synthetic arithmetic tasks: correct answers, determinism, disjoint splits."""

import pytest

from megatron_gspo.data import TASKS, ArithmeticTask, ChainTask, CharTokenizer, load_tokenizer, make_task

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
ARITHMETIC = sorted(n for n in TASKS if isinstance(make_task(n), ArithmeticTask))
CHAINS = sorted(n for n in TASKS if isinstance(make_task(n), ChainTask))


@pytest.mark.parametrize("name", ARITHMETIC)
def test_items_have_fixed_width_prompts_and_correct_answers(name):
    task = make_task(name, seed=1)
    items = task.items("train", 200)
    for item in items:
        left, rest = item.prompt.split(task.op, 1)
        assert rest.endswith("=")
        right = rest[:-1]
        assert len(left) == len(right) == task.digits  # zero-padded operands
        assert item.answer == str(OPS[task.op](int(left), int(right)))
    assert len({item.prompt for item in items}) == 200


@pytest.mark.parametrize("name", sorted(TASKS))
def test_default_char_tokenizer_covers_every_task_in_a_small_vocab(name):
    tok = load_tokenizer("char")
    assert tok.vocab_size == 16  # REFERENCE.md §8; the tiny model preset has 32
    for item in make_task(name).items("heldout", 50):
        assert tok.decode(tok.encode(item.prompt + item.answer)) == item.prompt + item.answer
    assert set(make_task(name).alphabet) <= set(CharTokenizer().alphabet)


def test_same_seed_same_items_other_seed_other_order():
    a = make_task("add3", seed=5).items("train", 100)
    assert a == make_task("add3", seed=5).items("train", 100)
    assert a != make_task("add3", seed=6).items("train", 100)
    # A larger request extends a smaller one (so a bigger train_size keeps the first prompts).
    assert make_task("add3", seed=5).items("train", 150)[:100] == a
    small = make_task("add2", seed=5)
    assert small.items("train", 150)[:100] == small.items("train", 100)


def test_train_and_heldout_never_share_prompts_whatever_the_seeds():
    # add2 is small enough to take (nearly) every prompt of both splits.
    task = make_task("add2", seed=0)
    heldout = {item.prompt for item in task.items("heldout", 900)}
    train = {item.prompt for item in make_task("add2", seed=1).items("train", 8000)}
    assert not heldout & train
    for name in ("add3", "sub3"):
        heldout = {item.prompt for item in make_task(name, seed=2).items("heldout", 500)}
        train = {item.prompt for item in make_task(name, seed=3).items("train", 5000)}
        assert not heldout & train
        assert 0 < len(heldout) and len(train) == 5000


def test_subtraction_stays_non_negative_unless_allowed():
    assert all(not item.answer.startswith("-") for item in make_task("sub3").items("train", 300))
    negative = ArithmeticTask(digits=2, op="-", allow_negative=True).items("train", 300)
    assert any(item.answer.startswith("-") for item in negative)


def test_bad_requests_raise_clear_errors():
    with pytest.raises(ValueError, match=r"task add2 has \d+ distinct heldout prompts, fewer than the 5000"):
        make_task("add2").items("heldout", 5000)
    with pytest.raises(ValueError, match="split 'test' must be one of"):
        make_task("add2").items("test", 5)
    with pytest.raises(ValueError, match="op '/' is not supported"):
        ArithmeticTask(op="/")
    with pytest.raises(ValueError, match="unknown task 'add9'; known tasks: add2, add3, add4, chain3x2, chain3x3, "
                                         "chain4x2, count2, mul2, sub3"):
        make_task("add9")
    with pytest.raises(ValueError, match="chain terms=2 must be in 3..6"):
        ChainTask(terms=2)


def test_chain_answers_work_the_sum_step_by_step():
    task = ChainTask(terms=3, digits=2)
    assert task.prompt((12, 34, 56)) == "12+34+56=" and task.answer((12, 34, 56)) == "046+56=102"
    assert ChainTask(terms=4, digits=2).answer((99, 99, 99, 99)) == "198+99+99=297+99=396"
    assert ChainTask(terms=3, digits=3).answer((5, 0, 7)) == "0005+007=0012"


@pytest.mark.parametrize("name", CHAINS)
def test_chain_items_are_correct_fixed_length_and_split_like_the_others(name):
    task = make_task(name, seed=3)
    items = task.items("train", 300)
    assert len({it.prompt for it in items}) == 300
    lengths = set()
    for it in items:
        operands = [int(x) for x in it.prompt.removesuffix("=").split("+")]
        assert len(operands) == task.terms and all(len(x) == task.digits for x in it.prompt[:-1].split("+"))
        steps = it.answer.split("=")
        assert len(steps) == task.terms - 1
        for i, step in enumerate(steps):  # step i: the sum of the first i + 2 operands, then the rest unchanged
            head, *rest = step.split("+")
            assert int(head) == sum(operands[: i + 2]) and len(head) == task.width
            assert [int(x) for x in rest] == operands[i + 2 :]
        lengths.add(len(it.answer))
    assert len(lengths) == 1  # every response has the same length
    heldout = {it.prompt for it in make_task(name, seed=4).items("heldout", 200)}
    assert not heldout & {it.prompt for it in items}
    assert make_task(name, seed=3).items("train", 100) == items[:100]


def test_count_answers_count_and_their_lengths_span_the_skew():
    task = make_task("count2", seed=0)
    items = task.items("train", 2000)
    for item in items[:200]:
        a, b = item.prompt[:-1].split("-")
        numbers = item.answer.split("+")
        assert [int(x) for x in numbers] == list(range(int(a), int(b) + 1))
        assert all(len(x) == 2 for x in numbers) and 6 <= len(numbers) <= 85
    lengths = [len(item.answer) for item in items]
    assert min(lengths) < 30 and max(lengths) > 240  # 3 * terms - 1 characters: 17 .. 254
    assert len({item.prompt for item in items}) == 2000
    assert all(task.split_of(item.prompt) == "train" for item in items)
