"""Built-in rewards: exact_match, boxed_exact_match, math_verify."""

import signal
import threading

import pytest

from megatron_gspo.data import load_tokenizer, make_task
from megatron_gspo.rewards import RewardScorer, get_reward
from megatron_gspo.rewards.exact_match import last_boxed


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("168", "168", 1.0),
        (" 168\n", "168", 1.0),
        ("1681", "168", 0.0),
        ("0168", "168", 0.0),
        ("", "168", 0.0),
    ],
)
def test_exact_match(response, answer, expected):
    assert get_reward("exact_match")(response, answer, {}) == expected


def test_exact_match_on_decoded_task_responses():
    tok = load_tokenizer("char")
    items = make_task("add3", seed=0).items("heldout", 3)
    right = [tok.decode(tok.encode(item.answer) + [tok.eos_id]) for item in items]
    wrong = [tok.decode(tok.encode(item.answer + "1") + [tok.eos_id]) for item in items]
    scorer = RewardScorer("exact_match")
    answers = [item.answer for item in items]
    rewards = scorer.score(right + wrong, answers * 2, [item.meta for item in items] * 2)
    assert rewards.tolist() == [1.0] * 3 + [0.0] * 3


def test_last_boxed_and_boxed_exact_match():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{unclosed") is None and last_boxed("no box") is None
    fn = get_reward("boxed_exact_match")
    assert fn(r"so \boxed{ 42 }", "42", {}) == 1.0
    assert fn(r"so \boxed{42}", r"\boxed{42}", {}) == 1.0
    assert fn("42", "42", {}) == 0.0


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        (r"The answer is \boxed{\frac{1}{2}}.", "0.5", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
        (r"\boxed{\{2, 1\}}", r"\{1,2\}", 1.0),
        (r"\boxed{168}", 168, 1.0),
        (r"\boxed{\frac{1}{3}}", "0.5", 0.0),
        (r"I think it is 0.5", "0.5", 0.0),  # no \boxed{}: not graded
        (r"\boxed{}", "1", 0.0),
    ],
)
def test_math_verify(response, answer, expected):
    assert get_reward("math_verify")(response, str(answer), {}) == expected


def test_math_verify_off_the_main_thread():
    # math_verify's signal-based timeout cannot be installed here; the reward must still work.
    fn = get_reward("math_verify")
    results = []
    thread = threading.Thread(target=lambda: results.append(fn(r"\boxed{\dfrac{3}{4}}", "0.75", {})))
    thread.start()
    thread.join()
    assert results == [1.0]


def test_math_verify_leaves_an_armed_alarm_armed():
    # A watchdog's SIGALRM timer (here 100 s) must survive scoring: math_verify's timeout would cancel it.
    old_handler = signal.signal(signal.SIGALRM, lambda signum, frame: None)
    old_timer = signal.setitimer(signal.ITIMER_REAL, 100.0)
    try:
        assert get_reward("math_verify")(r"\boxed{1/2}", "0.5", {}) == 1.0
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < remaining <= 100.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, *old_timer)
        signal.signal(signal.SIGALRM, old_handler)


def test_unparseable_gold_answer_is_a_counted_error():
    scorer = RewardScorer("math_verify")
    assert scorer.score([r"\boxed{1}"], [""], [{}]).tolist() == [0.0]
    assert scorer.num_errors == 1


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("07+08+09", "07+08+09", 1.0),
        (" 07+08+09\n", "07+08+09", 1.0),
        ("07+08", "07+08+09", 5 / 8),  # stopped short: the right prefix counts
        ("07+09+09", "07+08+09", 4 / 8),  # the first mistake ends the credit
        ("07+08+09+10+11", "07+08+09", 8 / 14),  # running on: right prefix, times 8 / 14 characters
        ("", "07", 0.0),
    ],
)
def test_prefix_match_gives_partial_credit_and_one_only_for_the_answer(response, answer, expected):
    assert get_reward("prefix_match")(response, answer, {}) == pytest.approx(expected)
