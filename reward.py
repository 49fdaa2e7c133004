"""Reward functions: plain functions, combined by a weighted sum.

A reward function takes the completions (a list of str) and the dataset columns of each sample as keyword lists
(`solution`, plus any extra JSONL field). It returns one value per completion: a real number of any type (Python,
numpy or torch; the whole batch may be a 1-D array or tensor), None where it cannot score, or a list of
(start, end, score) spans of the completion's characters, one score per step (a process reward). To add
one, write a function and add it to REWARDS, or to the REWARDS of a file of your own (--plugins, docs/plugins.md).

    --reward_funcs accuracy format --reward_weights 1.0 0.5

    accuracy        1/0: multiple-choice letter, number, math (math-verify) or plain string match
    format          1/0: `<think>...</think><answer>...</answer>`
    iou             0..1: IoU of the answer's box with the `solution` box (columns `image_size`, `seen_size`
                    and `norm_bbox` bring both to the pixels of the image the model saw)
    length_penalty  -1..0: DAPO's soft overlong punishment (columns `completion_length`,
                    `max_completion_length`, optional `overlong_buffer`)
    equation_steps  spans: each arithmetic step "a op b = c" of the completion, +1 right, -1 wrong (a process
                    reward: the example of a reward per step)
    judge           an LLM judge's grade of the completion, from an OpenAI-compatible endpoint (judge.py: --judge_url)
    likelihood      the mean log-prob of the completion's own tokens under --reward_model (a reward that uses a model:
                    its `scorer` parameter gets a Scorer)

A function that raises, or returns None, NaN, a number too large for a float, a dict or a malformed span, fails for
that completion (counted in `reward/<name>_failures`; one line per reward and call says why, None excepted).
train.py leaves the completion out of its group's statistics and out of the loss (its total here is a placeholder
0), and the run goes on. A reward still running after SLOW_S seconds is named once. Left out on purpose: registries,
a scalar-head reward model (the judge reward asks one behind an endpoint), partial credit in accuracy,
and a time limit on math-verify outside the main thread (its limit is signal.alarm, which works only there).
docs/step.md, "Rewards", has the details.
"""
import collections
import dataclasses
import functools
import inspect
import math
import numbers
import re
import threading

import math_verify
from math_verify.errors import TimeoutException

import judge

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
CHOICE = re.compile(r"\(?([A-E])[).]?")                      # a whole multiple-choice answer: B, (B), B.
LETTER = re.compile(r"(?<![A-Za-z0-9])([A-E])(?![A-Za-z0-9])")  # a capital standing alone ("I think B")
NUMBER = re.compile(r"[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?%?")
LATEX = re.compile(r"[$\\^]")
SLOW_S = 30  # seconds a reward may run before compute_rewards names it, while it still runs
# Box coordinates: a number not glued to a word, so the 2 of Qwen2.5-VL's "bbox_2d" key is skipped.
COORD = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?")


def extract_answer(text):
    """The text inside the last <answer>...</answer>, or the whole completion if there is none."""
    found = ANSWER.findall(text)
    return (found[-1] if found else text).strip()


def normalize(s):
    return re.sub(r"\s+", " ", str(s).strip().lower().rstrip(".")).strip()


def to_number(s):
    """"-1,234.5", "50%", "1e3" -> float, the % dropped; None for anything else, units included."""
    s = normalize(s)
    return float(s.replace(",", "").rstrip("%")) if NUMBER.fullmatch(s) else None


def math_parse(s, timeout):
    """math-verify's parse of s, bare LaTeX read as if inside $...$."""
    # math-verify reads LaTeX only inside $...$ or \\boxed{}: bare `\\sqrt 2` or `1+x^2` would be the number 2 or 1.
    if "$" not in s and "\\boxed" not in s and re.search(r"[\\^]", s):
        wrapped = math_verify.parse(f"${s}$", parsing_timeout=timeout)
        if any(not isinstance(p, str) for p in wrapped):
            return wrapped
    return math_verify.parse(s, parsing_timeout=timeout)


def is_whole_expression(s, parsed):
    """Whether math-verify read all of s, not a number out of prose ("3 cats" parses to 3, so "3 dogs" would match)."""
    squash = lambda t: re.sub(r"\s+", "", t)
    return any(isinstance(p, str) and squash(p) == squash(s) for p in parsed)


def accuracy_one(answer, solution, timeout):
    """1/0 for answer against solution, by the first rule that applies: a letter A-E, the answer's first standalone
    capital; two numbers, equal within a relative 1e-4; LaTeX or a whole expression, math-verify; else the
    normalized strings."""
    if not answer:
        return 0.0
    choice = CHOICE.fullmatch(solution.strip())
    if choice:  # a capital, so "(B) because..." counts and a lower-case article "a" does not
        mine = CHOICE.fullmatch(answer.upper()) or LETTER.search(answer)
        return float(bool(mine) and mine.group(1) == choice.group(1))
    gold, mine = to_number(solution), to_number(answer)
    if gold is not None and mine is not None:
        return float(abs(mine - gold) <= (1e-4 * abs(gold) if gold else 1e-6))
    try:
        gold = math_parse(solution, timeout)
        if gold and (LATEX.search(solution) or is_whole_expression(solution, gold)):
            if math_verify.verify(gold, math_parse(answer, timeout), timeout_seconds=timeout):
                return 1.0
    except (Exception, TimeoutException):  # sympy can choke on odd input: a wrong answer, not a dead run
        return 0.0
    return float(normalize(answer) == normalize(solution))  # math-verify also misses e.g. \text{red}


def accuracy(completions, solution, **kwargs):
    """1/0 per completion for its answer (extract_answer) against its solution (accuracy_one); None where the
    solution is None."""
    # math-verify's time limit is signal.alarm: it raises outside the main thread, so off there.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    return [None if s is None else accuracy_one(extract_answer(c), str(s), timeout)
            for c, s in zip(completions, solution)]


def format(completions, **kwargs):
    """1.0 for `<think>...</think><answer>...</answer>`, each tag exactly once, in this order."""
    pattern = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    return [float(bool(pattern.match(c)) and all(c.count(t) == 1 for t in tags)) for c in completions]


def box_numbers(value):
    """value's numbers as a box reads them: a list of numbers as it is, else the first 4 numbers of its text."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
        return [float(v) for v in value]
    # text ("(1,2),(3,4)", '{"bbox_2d": [1,2,3,4]}'), or a list of strings or lists: read its printed form
    return [float(v) for v in COORD.findall(str(value))[:4]]


def box_of(value):
    """value's first 4 numbers as [x1, y1, x2, y2]; None if fewer or empty."""
    nums = box_numbers(value)
    ok = len(nums) == 4 and all(map(math.isfinite, nums)) and nums[2] > nums[0] and nums[3] > nums[1]
    return nums if ok else None


def box_in_pixels(box, norm_bbox, size):
    """box in norm_bbox's convention -> pixels of the shown image of size (w, h)."""
    if norm_bbox in (None, "none"):
        return box
    if norm_bbox != "norm1000":
        raise ValueError(f"norm_bbox {norm_bbox!r}: a box convention is none or norm1000")
    w, h = size
    return [box[0] * w / 1000, box[1] * h / 1000, box[2] * w / 1000, box[3] * h / 1000]


def box_iou(a, b):
    """Boxes a, b as [x1, y1, x2, y2], b not empty -> their IoU."""
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    area = lambda r: (r[2] - r[0]) * (r[3] - r[1])
    return w * h / (area(a) + area(b) - w * h)


def iou(completions, solution, image_size=None, seen_size=None, norm_bbox=None, **kwargs):
    """Per completion, the IoU in [0, 1] of its answer's box with its solution box; 0.0 for no readable box, None
    for a solution that is none."""
    n = len(completions)
    image_size, seen_size, norm_bbox = image_size or [None] * n, seen_size or [None] * n, norm_bbox or [None] * n
    out = []
    for c, s, orig, seen, norm in zip(completions, solution, image_size, seen_size, norm_bbox):
        gold, mine = box_of(s), box_of(extract_answer(c))
        # Both boxes to the shown image's pixels; without image_size and seen_size both are taken in the same units.
        if gold is not None and orig and seen:
            sx, sy = seen[0] / orig[0], seen[1] / orig[1]
            gold = [gold[0] * sx, gold[1] * sy, gold[2] * sx, gold[3] * sy]
            mine = mine and box_in_pixels(mine, norm, seen)
        # The IoU itself, not 1 above a threshold, so that a group of poor boxes still has a signal.
        out.append(None if gold is None else box_iou(gold, mine) if mine else 0.0)
    return out


# DAPO's overlong reward shaping (arXiv 2503.14476): a completion cut at the limit is punished, not scored.
def length_penalty(completions, completion_length, max_completion_length, overlong_buffer=None, **kwargs):
    """0 up to max - buffer tokens, linearly down to -1 at max, -1 beyond; buffer 0.2 x max by default."""
    buffers = overlong_buffer or [None] * len(completions)
    out = []
    for length, limit, buf in zip(completion_length, max_completion_length, buffers):
        buf = 0.2 * limit if buf is None else buf
        if length <= limit - buf:
            out.append(0.0)
        else:
            out.append(-1.0 if length >= limit else (limit - buf - length) / buf)
    return out


# A process reward, the example of a score per step: each arithmetic step "12 * 7 = 84" (+, -, *, x, the times sign, /).
STEP = re.compile(r"(-?\d+(?:\.\d+)?)\s*([-+*/x\u00d7])\s*(-?\d+(?:\.\d+)?)\s*=\s*(-?\d+(?:\.\d+)?)")


def equation_steps(completions, **kwargs):
    """Per completion, [(start, end, +1 or -1)]: the characters of each arithmetic step "a op b = c", +1 if right."""
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "x": lambda a, b: a * b,
           "\u00d7": lambda a, b: a * b, "/": lambda a, b: a / b if b else math.nan}
    return [[(m.start(), m.end(), 1.0 if abs(ops[m[2]](float(m[1]), float(m[3])) - float(m[4])) < 1e-9 else -1.0)
             for m in STEP.finditer(c)] for c in completions]


@dataclasses.dataclass
class Scorer:
    """A `scorer` parameter's value under --reward_model: its log-probs of each completion, and what it read."""
    processor: object     # the policy's processor; the reward model has the same tokenizer
    device: object        # where the engine computes
    token_ids: list       # (N,) each completion's token ids
    images: list          # (N,) each completion's images (its prompt's, then its tools'), PIL
    logps: list           # (N,) each completion's (n,) log-probs under the reward model, at temperature 1
    mask: list            # (N,) each completion's (n,) 1 where the policy wrote the token (not a tool message)
    engine: object        # the reward model's DeepSpeed engine (model.logps_forward); call it as often on every rank


def likelihood(completions, scorer, **kwargs):
    """Per completion, the mean log-prob under --reward_model of the tokens the policy wrote (None: validation)."""
    if scorer is None:
        return [None] * len(completions)
    return [float((lp * m).sum() / m.sum()) if m.sum() else None for lp, m in zip(scorer.logps, scorer.mask)]


def asks_for_model(name):
    """Whether reward `name` takes a `scorer`."""
    return takes_scorer(REWARDS[name])


@functools.lru_cache(maxsize=None)
def takes_scorer(fn):   # the planner checks the flags of every set-up it tries: inspect's signature is slow
    return "scorer" in inspect.signature(fn).parameters


REWARDS = {"accuracy": accuracy, "format": format, "iou": iou, "length_penalty": length_penalty,
           "equation_steps": equation_steps, "judge": judge.judge, "likelihood": likelihood}


def real(value):
    """value as a float if it is a real number of any type (bool, int, float, a numpy or torch scalar, a 0-d array),
    else None. An int too large for a float raises OverflowError."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    return float(value) if isinstance(value, numbers.Real) else None


def spans_of(value, text):
    """A reward's value for `text` -> [(start, end, score)], checked: integers 0 <= start < end <= len(text), a finite
    real score; else None."""
    if not isinstance(value, (list, tuple)):
        return None
    out = []
    for s in value:
        if not (isinstance(s, (list, tuple)) and len(s) == 3 and all(isinstance(x, numbers.Integral) for x in s[:2])):
            return None
        try:
            score = real(s[2])
        except OverflowError:
            return None
        if score is None or not math.isfinite(score) or not 0 <= s[0] < s[1] <= len(text):
            return None
        out.append((int(s[0]), int(s[1]), score))
    return out


def score_of(value, text):
    """A reward's value for one completion `text` -> (score: a finite float or None, its spans or None, why it is no
    score: "" for a score or for None)."""
    if value is None:
        return None, None, ""
    steps = spans_of(value, text) if isinstance(value, (list, tuple)) else None
    if isinstance(value, (list, tuple)) and steps is None:
        return None, None, "a malformed span list"
    try:
        score = sum(s for _, _, s in steps) if steps is not None else real(value)
    except OverflowError:
        return None, None, "too large for a float"
    if score is None:
        return None, None, f"a {type(value).__name__}"
    return (score, steps, "") if math.isfinite(score) else (None, None, "NaN or infinite")


def call(name, completions, columns):
    """REWARDS[name] on the batch -> its values, one per completion; all None, with a line that says why, if it
    raises or returns something else than one value per completion. Named once if it runs past SLOW_S seconds."""
    n = len(completions)
    slow = threading.Timer(SLOW_S, print, [f"[reward] {name} still running after {SLOW_S:g} s on {n} completions"],
                           {"flush": True})
    slow.daemon = True
    slow.start()
    try:
        values = REWARDS[name](completions, **columns)
        if isinstance(values, (dict, str)) or getattr(values, "ndim", 1) != 1:
            shape = f" of shape {tuple(values.shape)}" if hasattr(values, "shape") else ""
            problem = (f"returned a {type(values).__name__}{shape}; a reward returns one number per completion (a "
                       f"list, or a 1-D array or tensor), None where it cannot score, or a list of spans")
        else:
            values = values.tolist() if hasattr(values, "tolist") else list(values)
            problem = None if len(values) == n else f"returned {len(values)} values for {n} completions"
    except Exception as e:  # a buggy reward must not kill a days-long run: count, warn, leave the batch out
        problem = f"raised {type(e).__name__}: {e}"
    finally:
        slow.cancel()
        slow.join()
    if problem:
        print(f"[reward] {name} {problem}; this batch's completions count as its failures (left out of their groups' "
              f"statistics and of the loss)")
        return [None] * n
    return values


def weights_of(names, weights):
    """`weights`, one per name, or 1 each if not given."""
    weights = weights or [1.0] * len(names)
    if len(weights) != len(names):
        raise ValueError(f"--reward_weights has {len(weights)} values for {len(names)} --reward_funcs")
    return weights


def compute_rewards(names, weights, completions, columns, spans=None):
    """completions (N), columns {field: N values} -> (total (N,), scores {name: N floats}, failed {name: N bools}).
    A reward that returns spans scores their sum; `spans`, when given, gets {name: N lists of (start, end, score),
    None for a plain score} for each reward that returned any."""
    weights = weights_of(names, weights)
    total, scores, failed = [0.0] * len(completions), {}, {}
    for name, w in zip(names, weights):
        judged = [score_of(v, c) for v, c in zip(call(name, completions, columns) if completions else [], completions)]
        why = collections.Counter(y for _, _, y in judged if y)
        if why:
            print(f"[reward] {name}: {sum(why.values())} of {len(judged)} values are not scores "
                  f"({', '.join(f'{k} {y}' for y, k in why.items())}); those completions count as its failures. A "
                  f"reward returns per completion a real number, None where it cannot score, or a list of spans")
        failed[name] = [x is None for x, _, _ in judged]
        scores[name] = [0.0 if x is None else x for x, _, _ in judged]
        total = [t + w * v for t, v in zip(total, scores[name])]
        if spans is not None and any(st is not None for _, st, _ in judged):
            spans[name] = [st for _, st, _ in judged]
    return total, scores, failed
