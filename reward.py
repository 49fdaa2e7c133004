"""Reward functions: plain functions, combined by a weighted sum.

A reward function takes the completions (list of str) and the dataset columns of each sample
as keyword lists (`solution`, plus any extra JSONL field), and returns one float per completion
(None counts as a failure). Adding one = writing a function and adding it to REWARDS.

    --reward_funcs accuracy format --reward_weights 1.0 0.5

A function that raises or returns None/NaN is counted in `reward/<name>_failures` and scores 0
for that completion; the run goes on. Left out on purpose: registries, reward models.
"""
import math
import re

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(text):
    """The text inside the last <answer>...</answer>, or the whole completion if there is none."""
    found = ANSWER.findall(text)
    return (found[-1] if found else text).strip()


def normalize(s):
    return re.sub(r"\s+", " ", str(s).strip().lower().rstrip(".")).strip()


def accuracy(completions, solution, **kwargs):
    """1.0 when the answer equals the solution after normalising case, spaces, a final period."""
    return [float(normalize(extract_answer(c)) == normalize(s)) for c, s in zip(completions, solution)]


def format(completions, **kwargs):
    """1.0 for `<think>...</think><answer>...</answer>`, each tag exactly once, in this order."""
    pattern = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    return [float(bool(pattern.match(c)) and all(c.count(t) == 1 for t in tags)) for c in completions]


REWARDS = {"accuracy": accuracy, "format": format}


def compute_rewards(names, weights, completions, columns):
    """-> (total (N,), per-function scores {name: [N floats]}, failures {name: count}).

    columns: {field: list of N values}, the sample fields repeated per completion."""
    weights = weights or [1.0] * len(names)
    if len(weights) != len(names):
        raise ValueError(f"--reward_weights has {len(weights)} values for {len(names)} --reward_funcs")
    total, scores, failures = [0.0] * len(completions), {}, {}
    for name, w in zip(names, weights):
        try:
            values = list(REWARDS[name](completions, **columns))
            if len(values) != len(completions):
                raise ValueError(f"returned {len(values)} values for {len(completions)} completions")
        except Exception as e:  # a buggy reward must not kill a days-long run: count, warn, score 0
            print(f"[reward] {name} raised {type(e).__name__}: {e}; scored 0 for this batch")
            values = [None] * len(completions)
        clean = [v if isinstance(v, (int, float)) and math.isfinite(v) else None for v in values]
        failures[name] = sum(v is None for v in clean)
        scores[name] = [0.0 if v is None else float(v) for v in clean]
        total = [t + w * v for t, v in zip(total, scores[name])]
    return total, scores, failures
