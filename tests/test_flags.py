"""One flags table: docs/flags.md is generated from train.py's parser, and the README's short table of the flags
researchers change most is checked against it (names, choices, defaults), so a flag's documentation cannot drift
from the code."""
import argparse
import os
import re

import pytest

import flags
from conftest import ROOT


def test_docs_flags_md_is_the_parsers_own_table():
    text = open(os.path.join(ROOT, "docs", "flags.md")).read()
    start, end = "<!-- generated: python flags.py --markdown -->\n", "<!-- end of generated -->"
    assert start in text and end in text
    generated = text[text.index(start) + len(start):text.index(end)]
    assert generated == flags.markdown(), "docs/flags.md is stale: run `python flags.py --write_docs`"


def readme_rows():
    """(flags cell, default cell) of each row of the README's "Flags researchers change most" table."""
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("## Flags researchers change most"):]
    section = section[:section.index("\n## ", 1)]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `--")]
    return [(r[0].lstrip("| "), r[1]) for r in rows]


def split_top(cell):
    """Split a cell at the commas outside parentheses; parenthesised notes dropped."""
    parts, depth, cur = [], 0, ""
    for ch in cell:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [re.sub(r"\(.*?\)", "", p).strip() for p in parts]


def shown(value):
    return "off" if value is False else "on" if value is True else value


@pytest.mark.parametrize("row", readme_rows(), ids=lambda r: r[0][:40])
def test_the_readme_table_matches_the_parser(row):
    """Every flag the README's table names exists; the choices it lists ("--loss_agg token / sequence / dr_grpo")
    are the parser's; each default it gives (one per flag, in order; notes in parentheses and prose defaults of
    list flags aside) is the parser's default with --model."""
    cell, default_cell = row
    actions = {o: a for a in flags.build_parser()._actions for o in a.option_strings}
    defaults = vars(flags.parse_args(["--model", "MODEL"]))
    named = re.findall(r"`(--[a-z_0-9-]+)([^`]*)`", cell)
    assert named, cell
    for name, _ in named:
        assert name in actions, f"README names {name}, which train.py does not have"
    names = [(n, r) for n, r in named if not n.startswith("--no-")]   # a --no- form shares its flag's default
    for name, rest in names:
        listed = [c.strip() for c in rest.split("/") if c.strip()]
        if listed:
            assert listed == [str(c) for c in actions[name].choices], (name, listed, actions[name].choices)
    given = split_top(default_cell)
    if len(given) != len(names) or not any(given):
        return   # a cell of prose, or none (the flags without a default worth a cell)
    for (name, _), want in zip(names, given):
        default = defaults[actions[name].dest]
        if isinstance(default, list) or want.startswith("=") or default is None:
            continue   # a list's default is described in words; "= epsilon" and "all (ds_zero3.json)" are derived
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            assert float(want) == float(default), (name, want, default)
        else:
            assert want == shown(default), (name, want, default)


def test_the_check_catches_a_drifted_default():
    """The README check itself: a default changed in the code but not in the table fails it."""
    p = flags.build_parser()
    for a in p._actions:
        if a.dest == "num_generations":
            a.default = 16
    assert isinstance(p, argparse.ArgumentParser)
    defaults = vars(p.parse_args(["--model", "MODEL"]))
    row = next(r for r in readme_rows() if "--num_generations" in r[0])
    assert split_top(row[1])[0] != str(defaults["num_generations"])


def test_the_flag_groups_and_the_model_help_say_what_they_hold():
    """--memory, --skip_memory_preflight and --plan are the memory plan's, not "LoRA and frozen parts"; --model's help
    names the mixture-of-experts families beside the dense ones (model.FAMILIES)."""
    import model
    groups = {a.dest: g.title for g in flags.build_parser()._action_groups for a in g._group_actions}
    assert {groups[f] for f in ("memory", "skip_memory_preflight", "plan")} == {"the memory plan"}
    helps = {a.dest: a.help for a in flags.build_parser()._actions}
    assert set(model.FAMILIES) == {"qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe"}
    assert all(name in helps["model"] for name in ("Qwen2.5-VL", "Qwen3-VL", "Qwen3.5", "Qwen3-VL-MoE", "Qwen3.5-MoE"))


@pytest.mark.parametrize("loss_type,loss_agg", [("grpo", "sequence"), ("dapo", "token"), ("dr_grpo", "dr_grpo")])
def test_trls_loss_type_names_set_the_aggregation(loss_type, loss_agg):
    """TRL's --loss_type (GRPOConfig.loss_type) is taken: grpo, dapo and dr_grpo set --loss_agg; a --loss_agg that
    says otherwise is refused by name."""
    args = flags.parse_args(["--model", "M", "--loss_type", loss_type])
    assert args.loss_agg == loss_agg and args.loss_type == loss_type
    assert flags.parse_args(["--model", "M", "--loss_type", loss_type, "--loss_agg", loss_agg]).loss_agg == loss_agg
    other = next(a for a in ("token", "sequence") if a != loss_agg)
    with pytest.raises(SystemExit):
        flags.parse_args(["--model", "M", "--loss_type", loss_type, "--loss_agg", other])


@pytest.mark.parametrize("loss_type", ["bnpo", "sapo", "luspo"])
def test_trls_other_loss_types_are_refused_saying_how_they_differ(loss_type, capsys):
    with pytest.raises(SystemExit):
        flags.parse_args(["--model", "M", "--loss_type", loss_type])
    err = capsys.readouterr().err
    assert f"--loss_type {loss_type}: " in err and ("micro-batch" in err if loss_type == "bnpo" else "not built" in err)
def test_every_flag_is_on_one_side_of_the_resume_rule():
    """The refused flags were a list of their own (checkpoint.CHANGES_THE_STATE), and flags were forgotten:
    --limit_videos, --router_aux_loss_coef and --routing_replay changed on a relaunch were applied, and --video_fps /
    --video_max_frames were applied while their image counterparts were refused. Every flag of the parser is now in
    flags.CHANGES_THE_STATE (refused on a resume) or flags.STEERS (applied and said), never both, and a new flag in
    neither fails here; flags.changed_flags refuses the video flags as it refuses the image ones."""
    dests = {a.dest for a in flags.build_parser()._actions if a.dest != "help"}
    unclassified = dests - set(flags.CHANGES_THE_STATE) - flags.STEERS
    assert not unclassified, f"put each in flags.CHANGES_THE_STATE or flags.STEERS: {sorted(unclassified)}"
    assert not set(flags.CHANGES_THE_STATE) & flags.STEERS and set(flags.CHANGES_THE_STATE) | flags.STEERS == dests
    saved = vars(flags.parse_args(["--tiny_arch", "qwen3_vl_moe"]))
    for flag, value in [("limit_videos", 1), ("video_fps", 4.0), ("video_max_frames", 16), ("video_total_pixels", 4096),
                        ("max_pixels", 1024), ("router_aux_loss_coef", 0.01), ("routing_replay", True)]:
        said, refusal = flags.changed_flags(saved, {**saved, flag: value, "explicit": [flag]}, 1, 1)
        assert refusal and f"  --{flag} {saved[flag]} -> {value}: " in refusal and not said, (flag, said)
    said, refusal = flags.changed_flags(saved, {**saved, "lora_dropout": 0.1, "sleep_level": 1}, 1, 1)
    assert refusal is None and len(said) == 2
