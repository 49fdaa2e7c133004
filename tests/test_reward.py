"""Reward functions: literal completions, exact expected rewards."""
import math

import pytest

import reward


@pytest.mark.parametrize("completion,solution,expected", [
    ("red", "red", 1.0),
    ("Red.", "red", 1.0),
    ("  red \n", "red", 1.0),
    ("<think>hmm</think><answer>blue</answer>", "blue", 1.0),
    ("<answer>red</answer> <answer>green</answer>", "green", 1.0),   # the last answer counts
    ("red blue", "red", 0.0),
    ("redred", "red", 0.0),
    ("", "red", 0.0),
    ("<answer></answer>", "red", 0.0),
])
def test_accuracy(completion, solution, expected):
    assert reward.accuracy([completion], [solution]) == [expected]


@pytest.mark.parametrize("completion,expected", [
    ("<think>a</think><answer>b</answer>", 1.0),
    ("<think>a</think>\n<answer>b</answer>\n", 1.0),
    ("<answer>b</answer><think>a</think>", 0.0),
    ("<think>a</think><answer>b</answer><answer>c</answer>", 0.0),
    ("<think>a<answer>b</answer>", 0.0),
    ("b", 0.0),
])
def test_format(completion, expected):
    assert reward.format([completion]) == [expected]


def test_combine_weights_and_failures(monkeypatch):
    def broken(completions, **kw):
        raise ZeroDivisionError("bug in a reward")

    def partial(completions, **kw):
        return [None, math.nan, 0.5]
    monkeypatch.setitem(reward.REWARDS, "broken", broken)
    monkeypatch.setitem(reward.REWARDS, "partial", partial)
    total, scores, failures = reward.compute_rewards(
        ["accuracy", "broken", "partial"], [2.0, 1.0, 4.0], ["red", "blue", "red"], {"solution": ["red"] * 3})
    assert total == [2.0, 0.0, 2.0 + 4 * 0.5]
    assert failures == {"accuracy": 0, "broken": 3, "partial": 2}
    assert scores["partial"] == [0.0, 0.0, 0.5]


def test_weights_must_match_functions():
    with pytest.raises(ValueError, match="--reward_weights has 1 values for 2"):
        reward.compute_rewards(["accuracy", "format"], [1.0], ["a"], {"solution": ["a"]})
