"""Each GPU recipe in recipes/ runs here with the same flags, on the tiny model and task: only the
model and data paths are swapped (and one step is run), so the flags are known to work together."""
import os
import shlex

import pytest

import tiny
from conftest import ROOT, launch

RECIPES = sorted(f for f in os.listdir(os.path.join(ROOT, "recipes")) if f.endswith(".sh"))
PATHS = ("--model", "--train_data", "--val_data", "--image_root", "--output_dir")


def recipe_flags(name):
    text = open(os.path.join(ROOT, "recipes", name)).read()
    lines = [ln for ln in text.replace("\\\n", " ").splitlines() if ln.strip().startswith("deepspeed")]
    argv = shlex.split(lines[0])
    flags = argv[argv.index("train.py") + 1:]
    out, i = [], 0
    while i < len(flags):
        if flags[i] in PATHS:
            i += 2
            continue
        out.append(flags[i])
        i += 1
    return out


def test_recipes_are_found():
    """Every recipes/*.sh (a new one is picked up by its file alone) has one deepspeed train.py line."""
    assert RECIPES and all(recipe_flags(name) for name in RECIPES)
    assert "--offload_optimizer" in recipe_flags("swift_3b_4gpu.sh")


@pytest.mark.launch
@pytest.mark.parametrize("name", RECIPES)
def test_recipe_runs_on_the_tiny_model(tmp_path, tiny_default, name):
    flags = recipe_flags(name)
    # a box reward's recipe runs on the tiny grounding task: the launch skips a row whose solution iou cannot read
    # (the colour task's words), as --check_data counts it
    model, train_jsonl, val_jsonl = tiny_default if "iou" not in flags else \
        tiny.ensure_default(os.path.join(ROOT, ".cache", "tiny"), task="grounding", size="small")
    rows, log = launch(tmp_path, "--model", model, "--train_data", train_jsonl, "--val_data", val_jsonl, *flags,
                       "--max_steps", "1", "--val_freq", "0", "--no-val_before_train", "--save_steps", "0",
                       "--no-save_final_model")
    assert ("[flags] note: --epsilon_high" in log) == ("--epsilon_high" in flags and "--num_iterations" not in flags), \
        log[-3000:]
    (step,) = [r for r in rows if "rollout/logp_diff_max" in r]
    assert step["step"] == 1 and step["rollout/logp_diff_max"] < 0.5    # bf16 over long completions: loose
    assert "reward/mean" in step and step.get("reward/iou_failures", 0) == 0, step
