"""Reward functions: literal completions, exact expected rewards."""
import math
import threading
import time

import numpy as np
import pytest
import torch
from math_verify.errors import TimeoutException

import grpo
import model
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


@pytest.mark.parametrize("completion,solution,expected", [
    # multiple choice: the first standalone capital A-E of the answer
    ("<answer>B</answer>", "B", 1.0),
    ("<answer>(b)</answer>", "B", 1.0),
    ("<answer>B) 42 apples</answer>", "(B)", 1.0),
    ("<answer>I think C, not B</answer>", "B.", 0.0),
    ("<answer>Because of Bob, B</answer>", "B", 1.0),           # "Bob" is not a standalone letter
    ("<answer>A dog, so C</answer>", "C", 0.0),                 # a leading article "A" is read as the letter
    ("<answer>2</answer>", "B", 0.0),                           # letters vs numbers
    ("<answer>B</answer>", "2", 0.0),
    ("<answer></answer>", "A", 0.0),
    # numbers: commas, %, relative 1e-4, absolute 1e-6 around 0
    ("<answer>1,234</answer>", "1234", 1.0),
    ("<answer>1234.05</answer>", "1,234", 1.0),
    ("<answer>1234.2</answer>", "1,234", 0.0),
    ("<answer>50%</answer>", "50", 1.0),
    ("<answer>-0.0000005</answer>", "0", 1.0),
    ("<answer>0.00001</answer>", "0", 0.0),
    ("<answer>3.</answer>", "3", 1.0),
    ("<answer>1,23</answer>", "123", 0.0),                      # not a thousands separator
    ("<answer>NaN</answer>", "3", 0.0),
    ("<answer>nan</answer>", "nan", 1.0),                       # not a number: plain text match
    ("<answer>inf</answer>", "inf", 1.0),
    # math-verify
    ("<answer>0.5</answer>", r"\frac{1}{2}", 1.0),
    (r"<answer>\frac{1}{2}</answer>", "0.5", 1.0),
    (r"<answer>\frac{2}{4}</answer>", r"$\frac{1}{2}$", 1.0),
    (r"<answer>\frac{1}{3}</answer>", r"\frac{1}{2}", 0.0),
    ("<answer>1/2</answer>", "0.5", 1.0),
    (r"<think>so</think><answer>\boxed{\frac{1}{2}}</answer>", "1/2", 1.0),
    (r"The answer is $\boxed{0.5}$.", r"\boxed{\frac{1}{2}}", 1.0),  # no tags: the whole completion
    (r"<answer>\sqrt 2</answer>", r"\sqrt{2}", 1.0),
    ("<answer>1+x^2</answer>", "x^2+1", 1.0),
    ("<answer>x^2+2</answer>", "x^2+1", 0.0),
    ("<answer>3 apples</answer>", "3", 1.0),                    # math-verify takes the number
    ("<answer>3 dogs</answer>", "3 cats", 0.0),                 # a text solution stays text
    ("<answer>3 cats</answer>", "3 cats", 1.0),
    (r"<answer>\text{red}</answer>", r"\text{red}", 1.0),
    ("<answer>red</answer>", r"\frac{1}{2}", 0.0),
    (r"<answer>\frac{1}{</answer>", r"\frac{1}{2}", 0.0),       # malformed LaTeX
    ("<answer>", "0.5", 0.0),                                   # unclosed tag: whole completion
])
def test_accuracy_choices_numbers_math(completion, solution, expected):
    assert reward.accuracy([completion], [solution]) == [expected]


def test_accuracy_missing_solution_is_a_failure():
    assert reward.accuracy(["<answer>1</answer>", "1"], [None, 1]) == [None, 1.0]


@pytest.mark.parametrize("error", [RecursionError("sympy"), TimeoutException("slow")])
def test_accuracy_math_verify_errors_score_zero(monkeypatch, error):
    def boom(*a, **kw):
        raise error
    monkeypatch.setattr(reward.math_verify, "verify", boom)
    completions = [r"<answer>\frac{1}{2}</answer>", "<answer>red</answer>"]
    assert reward.accuracy(completions, [r"\frac{1}{2}", "red"]) == [0.0, 1.0]


def test_accuracy_off_the_main_thread():
    # math-verify's time limit is signal.alarm, which raises outside the main thread
    out = []
    t = threading.Thread(target=lambda: out.append(reward.accuracy(["0.5", "2"], [r"\frac{1}{2}", "x^2"])))
    t.start()
    t.join()
    assert out == [[1.0, 0.0]]


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


@pytest.mark.parametrize("completion,solution,expected", [
    ("<answer>[0, 0, 10, 10]</answer>", [0, 0, 10, 10], 1.0),
    ("<answer>[0, 0, 10, 10]</answer>", "[0, 0, 10, 10]", 1.0),
    ("<answer>(0,0),(10,10)</answer>", [0, 0, 10, 10], 1.0),
    ("<|box_start|>(0,0),(10,10)<|box_end|>", [0, 0, 10, 10], 1.0),
    ('<answer>[{"bbox_2d": [0, 0, 10, 10], "label": "cat"}]</answer>', [0, 0, 10, 10], 1.0),
    ("<answer>x1=0 y1=0 x2=10 y2=10</answer>", [0, 0, 10, 10], 1.0),
    ("<answer>[0, 0, 10, 5]</answer>", [0, 0, 10, 10], 0.5),
    ("<answer>[5, 0, 15, 10]</answer>", [0, 0, 10, 10], 50 / 150),
    ("<answer>[20, 20, 30, 30]</answer>", [0, 0, 10, 10], 0.0),   # no overlap
    ("<answer>[0.0, 0.0, 2.5, 2.0]</answer>", [0, 0, 5, 2], 0.5),
    ("<answer>[10, 0, 0, 10]</answer>", [0, 0, 10, 10], 0.0),     # x2 <= x1
    ("<answer>[0, 0, 10, 0]</answer>", [0, 0, 10, 10], 0.0),      # y2 <= y1
    ("<answer>[0, 0, 10]</answer>", [0, 0, 10, 10], 0.0),
    ("<answer>the cat on the left</answer>", [0, 0, 10, 10], 0.0),
    ("<answer>[nan, nan, nan, nan]</answer>", [0, 0, 10, 10], 0.0),
    ("<answer></answer>", [0, 0, 10, 10], 0.0),
    ("", [0, 0, 10, 10], 0.0),
    ("<answer>[0, 0, 10, 10]</answer>", "no box", None),           # a broken solution is a failure
    ("<answer>[0, 0, 10, 10]</answer>", [5, 5, 5, 9], None),
    ("<answer>[0, 0, 10, 10]</answer>", [0, 0, 10, 10, 3], None),
    ("<answer>[0, 0, 10, 10]</answer>", [[0, 0, 10, 10]], 1.0),     # nested: read as text
])
def test_iou(completion, solution, expected):
    assert reward.iou([completion], [solution]) == [expected]


@pytest.mark.parametrize("completion,solution,image_size,seen_size,expected", [
    # the model saw a half-size image: the solution [0, 0, 200, 100] becomes [0, 0, 100, 50]
    ("<answer>[0, 0, 100, 50]</answer>", [0, 0, 200, 100], [400, 200], [200, 100], 1.0),
    ("<answer>[0, 0, 200, 100]</answer>", [0, 0, 200, 100], [400, 200], [200, 100], 0.25),
    ("<answer>[0, 0, 200, 100]</answer>", [0, 0, 200, 100], None, None, 1.0),
    ("<answer>[0, 0, 200, 100]</answer>", [0, 0, 200, 100], [400, 200], None, 1.0),   # needs both
    # width and height scale apart: [0, 0, 100, 100] in 1000x500 seen at 500x400 -> [0, 0, 50, 80]
    ("<answer>[0, 0, 50, 80]</answer>", "[0, 0, 100, 100]", [1000, 500], [500, 400], 1.0),
])
def test_iou_rescales_to_the_seen_image(completion, solution, image_size, seen_size, expected):
    assert reward.iou([completion], [solution], image_size=[image_size], seen_size=[seen_size]) == [expected]


@pytest.mark.parametrize("family", sorted(model.FAMILIES))
def test_iou_reads_each_familys_box_convention(family):
    """A box the model writes in its family's convention (model.FAMILIES norm_bbox: Qwen2.5-VL in pixels of the
    image as shown, Qwen3-VL and Qwen3.5 and their mixture-of-experts variants on a 0-1000 scale) scores 1 against
    the same region given in original pixels; the same numbers read in the other convention miss. data.prepare
    hands the convention to the rewards as the column norm_bbox."""
    norm = model.FAMILIES[family]["norm_bbox"]
    assert norm == ("none" if family == "qwen2_5_vl" else "norm1000")
    gold, orig, seen = [112, 56, 336, 168], [448, 224], [64, 32]   # the centre quarter, original pixels
    said = {"none": "[16, 8, 48, 24]", "norm1000": "[250, 250, 750, 750]"}   # the same region, as the model writes it
    cols = dict(image_size=[orig] * 2, seen_size=[seen] * 2, norm_bbox=[norm] * 2)
    right, wrong = said[norm], said["norm1000" if norm == "none" else "none"]
    assert reward.iou([f"<answer>{right}</answer>", f"<answer>{wrong}</answer>"], [gold] * 2, **cols) == [1.0, 0.0]


@pytest.mark.parametrize("length,limit,buffer,expected", [
    (0, 100, None, 0.0),
    (80, 100, None, 0.0),        # max - 0.2 * max: the ramp starts after it
    (90, 100, None, -0.5),
    (95, 100, None, -0.75),
    (100, 100, None, -1.0),
    (150, 100, None, -1.0),
    (60, 100, 50, -0.2),
    (50, 100, 50, 0.0),
    (100, 100, 0, 0.0),          # no buffer: only past the limit
    (101, 100, 0, -1.0),
])
def test_length_penalty(length, limit, buffer, expected):
    assert reward.length_penalty(["x"], completion_length=[length], max_completion_length=[limit],
                                 overlong_buffer=[buffer]) == [pytest.approx(expected)]


def test_length_penalty_buffer_column_is_optional():
    assert reward.length_penalty(["a", "b"], completion_length=[10, 95], max_completion_length=[100, 100]) \
        == [0.0, pytest.approx(-0.75)]


def test_new_rewards_are_registered_and_combine():
    total, scores, failures = reward.compute_rewards(
        ["iou", "length_penalty"], [1.0, 0.5], ["<answer>[0, 0, 10, 5]</answer>"],
        {"solution": [[0, 0, 10, 10]], "completion_length": [100], "max_completion_length": [100]})
    assert (total, failures) == ([0.5 - 0.5], {"iou": [False], "length_penalty": [False]})


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
    assert failures == {"accuracy": [False] * 3, "broken": [True] * 3, "partial": [True, True, False]}
    assert scores["partial"] == [0.0, 0.0, 0.5]


def test_weights_must_match_functions():
    with pytest.raises(ValueError, match="--reward_weights has 1 values for 2"):
        reward.compute_rewards(["accuracy", "format"], [1.0], ["a"], {"solution": ["a"]})


def test_no_completions_no_calls():
    total, scores, failures = reward.compute_rewards(["accuracy", "format"], None, [], {})
    assert total == [] and scores == {"accuracy": [], "format": []} and failures == {"accuracy": [], "format": []}


def test_a_reward_that_raises_says_its_completions_are_failures_not_zeros(capsys):
    """A reward that raises is no score: its batch's completions are flagged (left out of their groups' statistics and
    of the loss, train.Completion.scored), and the line says so instead of "scored 0"."""
    def broken(completions, **kwargs):
        raise KeyError("solution")
    reward.REWARDS["broken"] = broken
    try:
        total, scores, failed = reward.compute_rewards(["broken"], None, ["a", "b"], {})
    finally:
        del reward.REWARDS["broken"]
    out = capsys.readouterr().out
    assert failed == {"broken": [True, True]} and "failures" in out and "scored 0" not in out


def scored_by(monkeypatch, values, completions=("a", "b"), spans=None):
    """compute_rewards over `completions` with one reward, "mine", that returns `values`."""
    monkeypatch.setitem(reward.REWARDS, "mine", lambda completions, **kw: values)
    return reward.compute_rewards(["mine"], [2.0], list(completions), {}, spans)


@pytest.mark.parametrize("values,expected", [
    (np.array([0.5, 1.0], dtype=np.float32), [0.5, 1.0]),
    (np.array([2, -3], dtype=np.int64), [2.0, -3.0]),
    ([np.float32(0.25), np.int64(1)], [0.25, 1.0]),
    (np.float16([0.5, 0.75]), [0.5, 0.75]),
    (torch.tensor([0.5, 1.0]), [0.5, 1.0]),
    (torch.tensor([0.5, 1.0], dtype=torch.float64, requires_grad=True), [0.5, 1.0]),
    (torch.tensor([1, 0]), [1.0, 0.0]),
    ([torch.tensor(0.5), torch.tensor(3)], [0.5, 3.0]),
    ([np.array(0.5), 2], [0.5, 2.0]),
    ([True, False], [1.0, 0.0]),                       # Python bools counted as 1/0, as before
    ([np.bool_(True), torch.tensor(False)], [1.0, 0.0]),
])
def test_a_reward_may_return_any_real_number_type(monkeypatch, capsys, values, expected):
    """numpy and torch scalars, 1-D arrays and tensors are the numbers they hold, not failures."""
    total, scores, failed = scored_by(monkeypatch, values)
    assert failed == {"mine": [False, False]} and scores == {"mine": expected}
    assert total == [2.0 * v for v in expected] and all(type(v) is float for v in scores["mine"] + total)
    assert capsys.readouterr().out == ""


def test_span_rewards_may_use_numpy_numbers(monkeypatch):
    spans = {}
    total, _, failed = scored_by(monkeypatch, [[(np.int64(0), np.int64(1), np.float32(0.5))], []], spans=spans)
    assert failed == {"mine": [False, False]} and total == [1.0, 0.0] and spans == {"mine": [[(0, 1, 0.5)], []]}


@pytest.mark.parametrize("values", [{"a": 1.0, "b": 0.0}, {0: 0.25, 1: 0.75}])
def test_a_reward_returning_a_dict_is_refused_by_name(monkeypatch, capsys, values):
    """A dict is not scored as its keys: every completion fails, and the line names the reward and what it must
    return."""
    total, scores, failed = scored_by(monkeypatch, values)
    out = capsys.readouterr().out
    assert failed == {"mine": [True, True]} and total == [0.0, 0.0]
    assert out.count("\n") == 1 and "mine" in out and "dict" in out and "one number per completion" in out


def test_a_dict_per_completion_fails_that_completion_and_says_so(monkeypatch, capsys):
    total, _, failed = scored_by(monkeypatch, [{"score": 1.0}, 0.5])
    out = capsys.readouterr().out
    assert failed == {"mine": [True, False]} and total == [0.0, 1.0]
    assert out.count("\n") == 1 and out.startswith("[reward] mine") and "dict" in out


def test_a_number_too_large_for_a_float_fails_its_completion_not_the_run(monkeypatch, capsys):
    total, _, failed = scored_by(monkeypatch, [10 ** 400, 0.5])
    out = capsys.readouterr().out
    assert failed == {"mine": [True, False]} and total == [0.0, 1.0]
    assert out.count("\n") == 1 and out.startswith("[reward] mine") and "too large" in out


def test_values_that_are_not_scores_are_said_once_per_reward_and_call(monkeypatch, capsys):
    """NaN, infinity, a string, a malformed span list: failures as before, now with one line that counts each kind;
    None stays the silent "cannot score this" of a reward (a row without a solution)."""
    values = [math.nan, float("inf"), np.float32("nan"), "0.5", [(0, 99, 1.0)], None, 1.0]
    total, _, failed = scored_by(monkeypatch, values, completions=["abc"] * 7)
    out = capsys.readouterr().out
    assert failed == {"mine": [True] * 6 + [False]} and total == [0.0] * 6 + [2.0]
    assert out.count("\n") == 1 and out.startswith("[reward] mine: 5 of 7 values are not scores")
    assert "3 NaN or infinite" in out and "1 a str" in out and "1 a malformed span list" in out
    scored_by(monkeypatch, [None, 1.0])
    assert capsys.readouterr().out == ""


def test_a_slow_reward_is_named_while_it_runs(monkeypatch, capsys):
    """One line past SLOW_S while the reward still runs; no timer thread outlives the call; the scores are the
    same."""
    def sleepy(completions, **kwargs):
        time.sleep(0.5)
        return [1.0] * len(completions)
    monkeypatch.setitem(reward.REWARDS, "sleepy", sleepy)
    monkeypatch.setattr(reward, "SLOW_S", 0.05)
    threads = threading.active_count()
    total, _, failed = reward.compute_rewards(["sleepy", "format"], None, ["a", "b"], {})
    out = capsys.readouterr().out
    assert out == "[reward] sleepy still running after 0.05 s on 2 completions\n"
    assert total == [1.0, 1.0] and failed == {"sleepy": [False, False], "format": [False, False]}
    assert threading.active_count() == threads


@pytest.mark.parametrize("totals,lost", [
    ([1.0, 0.0, 0.0, 0.0], False),
    ([3.0, 3.0, math.nan], False),                   # no spread to lose
    ([math.nan, 5.0, math.nan], False),              # one scored completion: no spread
    ([1e200, 0.0, 0.0, 0.0], True),                  # inf in float32
    ([1e20, 0.0, 0.0, 0.0], True),                   # centred 7.5e19, its square 5.6e39 > float32's 3.4e38: std inf
    ([1e18, 0.0], False),                            # centred 5e17, square 2.5e35: fits, advantages -+0.707
    ([1e8, 1e8 + 1, math.nan], True),                # float32's spacing at 1e8 is 8: both read 1e8
    ([1e8, 1e8 + 16], False),                        # 16 apart: mean 1e8 + 8, advantages -+0.707
    (torch.tensor([1e200, 0.0], dtype=torch.float64), True),
    (torch.tensor([1.0, math.nan, 2.0]), False),
])
def test_spread_lost_to_precision(totals, lost):
    assert grpo.spread_lost_to_precision(totals) is lost
