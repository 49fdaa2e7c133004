"""wandb starts in the mode the user chose (WANDB_MODE over everything), within a bounded time, and a start
that fails goes offline and says so: a wandb failure never stops the run. Real wandb 0.31, no network: an
unreachable WANDB_BASE_URL stands in for a server that does not answer."""
import os
import time
import types

import pytest

import logs
import train
from conftest import wandb_history

KEY = "x" * 40        # wandb checks only the length of a key before it talks to the server
NOWHERE = "http://127.0.0.1:9"   # the discard port: nothing listens, every connection is refused


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """A clean wandb environment for one test: its variables removed, its settings in tmp_path, its
    process-wide singleton torn down before and after (it reads the environment once, when it starts)."""
    import wandb
    for k in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()
    yield monkeypatch
    wandb.teardown()


def fake_run(out_dir):
    args = train.parse_args(["--output_dir", str(out_dir), "--report_to", "wandb", "--resume", "none"])
    return types.SimpleNamespace(args=args, master=True, start=0, wandb=None, wandb_failed=False)


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_wandb_mode_is_respected_with_an_api_key(tmp_path, wandb_env, mode):
    """An API key in the environment and WANDB_MODE exported: the user's mode, at once. (Before: forced online,
    it waited for the server and crashed the run; WANDB_INIT_TIMEOUT=5 makes that fail in seconds, not 100.)"""
    import wandb
    wandb_env.setenv("WANDB_API_KEY", KEY)
    wandb_env.setenv("WANDB_MODE", mode)
    wandb_env.setenv("WANDB_BASE_URL", NOWHERE)
    wandb_env.setenv("WANDB_INIT_TIMEOUT", "5")
    run = fake_run(tmp_path)
    t = time.monotonic()
    logs.open_logs(run, resumed=False)
    assert run.wandb.settings.mode == mode and time.monotonic() - t < 15   # a second or two: no server asked
    logs.write_metrics(run, {"reward/mean": 0.5}, step=1)
    run.wandb.finish()
    wandb.teardown()   # its service writes the last records as it exits
    assert not run.wandb_failed
    if mode == "offline":
        run_id = open(tmp_path / "wandb_run_id").read().strip()
        history = wandb_history(tmp_path)
        assert list(history) == [run_id] and list(history[run_id]) == [1] and "reward/mean" in history[run_id][1]


def test_a_failed_online_start_goes_offline_and_says_so(tmp_path, wandb_env, capsys):
    """Online (an API key, no WANDB_MODE) with a server that never answers: wandb.init gives up after
    logs.WANDB_INIT_TIMEOUT seconds (wandb's own default is 90, plus 10 of grace), the run goes on with an
    offline wandb run of the same id (`wandb sync` uploads it later), and the message says so."""
    import wandb
    wandb_env.setenv("WANDB_API_KEY", KEY)
    wandb_env.setenv("WANDB_BASE_URL", NOWHERE)
    wandb_env.setattr(logs, "WANDB_INIT_TIMEOUT", 3, raising=False)   # raising=False: code without it fails below
    run = fake_run(tmp_path)
    t = time.monotonic()
    logs.open_logs(run, resumed=False)
    took = time.monotonic() - t
    assert run.wandb.settings.mode == "offline" and took < 30, took
    out = capsys.readouterr().out
    assert "[wandb] could not start online" in out and "continuing offline" in out and "wandb sync" in out
    logs.write_metrics(run, {"reward/mean": 0.5}, step=1)
    run.wandb.finish()
    wandb.teardown()   # its service writes the last records as it exits
    run_id = open(tmp_path / "wandb_run_id").read().strip()
    history = wandb_history(tmp_path)   # the failed online attempt left no offline run of its own
    assert run.wandb.id == run_id and list(history) == [run_id] and "reward/mean" in history[run_id][1]


def test_a_few_trajectories_and_the_images_the_model_saw_go_to_the_run_folder(tmp_path, tiny_default):
    """Every --log_completions_steps, without wandb: the first completion of rank 0's first --log_completions groups
    in output_dir/completions.jsonl (the prompt, the answer, with --tools the trajectory and each call, the rewards),
    and for --tools and video runs the images the model saw as PNG: the prompt's, each video's frames side by side,
    the tools'. A resume trims the rows after its checkpoint, as metrics.jsonl's."""
    import json

    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(tiny_default[0])
    args = train.parse_args(["--output_dir", str(tmp_path), "--tools", "crop", "--max_turns", "2",
                             "--log_completions_steps", "5", "--log_completions", "2"])
    run = types.SimpleNamespace(args=args, master=True, processor=processor, start=0)
    shown, crop = Image.new("RGB", (56, 56), (200, 0, 0)), Image.new("RGB", (28, 28), (0, 0, 200))
    frames = np.zeros((4, 28, 28, 3), dtype=np.uint8)
    frames[2] = 255
    ids = processor.tokenizer("what colour", add_special_tokens=False)["input_ids"]
    groups = [train.Group(sample=dict(images=[shown], videos=[(frames, {})] if k == 0 else [], vllm_ids=ids,
                                      where=f"t.jsonl:{k + 1}", id=k),
                          completions=[train.Completion(index=0, token_ids=ids, sampler_logps=[0.0] * len(ids),
                                                        text="red", finish_reason="stop",
                                                        calls=[("<tool_call>...", None, None)], images=[crop],
                                                        rewards={"accuracy": 1.0}, total=1.0, advantage=0.5)])
              for k in range(3)]
    logs.log_completions(run, groups, step=4)   # not a logging step
    assert not (tmp_path / "completions.jsonl").exists()
    logs.log_completions(run, groups, step=5)
    rows = [json.loads(line) for line in open(tmp_path / "completions.jsonl")]
    assert [r["where"] for r in rows] == ["t.jsonl:1", "t.jsonl:2"] and rows[0]["prompt"] == "what colour"
    assert rows[0]["completion"] == "red"
    assert rows[0]["calls"] == [{"call": "<tool_call>...", "error": None, "kind": None}]
    assert rows[0]["rewards"] == {"accuracy": 1.0} and rows[0]["advantage"] == 0.5
    assert rows[0]["trajectory"] == "what colour"
    assert rows[0]["images"] == ["completions/step_5/0_0_prompt.png", "completions/step_5/0_1_video.png",
                                 "completions/step_5/0_2_tool.png"] and len(rows[1]["images"]) == 2
    assert Image.open(tmp_path / rows[0]["images"][0]).getpixel((0, 0)) == (200, 0, 0)
    sheet = Image.open(tmp_path / rows[0]["images"][1])
    assert sheet.size == (4 * 28, 28) and sheet.getpixel((2 * 28, 0)) == (255, 255, 255)
    assert sheet.getpixel((0, 0)) == (0, 0, 0)
    assert Image.open(tmp_path / rows[0]["images"][2]).getpixel((0, 0)) == (0, 0, 200)
    logs.log_completions(run, groups, step=10)
    run.wandb, run.wandb_failed, run.start = None, False, 5
    logs.open_logs(run, resumed=True)   # resumed from step 5: step 10 is trained and written again
    assert {json.loads(line)["step"] for line in open(tmp_path / "completions.jsonl")} == {5}
    run.wandb.finish()


def test_completions_keep_the_prompt_image_of_an_image_row_without_tools(tmp_path, tiny_default):
    """A grounding run (no tools, no video): completions.jsonl names the downscaled image the model saw, the one its
    boxes refer to, saved as PNG within the same --log_completions rows; a text-only row names none."""
    import json

    from PIL import Image
    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(tiny_default[0])
    args = train.parse_args(["--output_dir", str(tmp_path), "--log_completions_steps", "5", "--log_completions", "2"])
    run = types.SimpleNamespace(args=args, master=True, processor=processor, start=0)
    shown = Image.new("RGB", (56, 28), (0, 200, 0))
    ids = processor.tokenizer("where is the square", add_special_tokens=False)["input_ids"]
    groups = [train.Group(sample=dict(images=[shown] if k != 1 else [], vllm_ids=ids, where=f"t.jsonl:{k + 1}", id=k),
                          completions=[train.Completion(index=0, token_ids=ids, sampler_logps=[0.0] * len(ids),
                                                        text="[1, 2, 30, 20]", finish_reason="stop",
                                                        rewards={"iou": 0.5}, total=0.5, advantage=0.1)])
              for k in range(3)]
    logs.log_completions(run, groups, step=5)
    rows = [json.loads(line) for line in open(tmp_path / "completions.jsonl")]
    assert [r["images"] for r in rows] == [["completions/step_5/0_0_prompt.png"], []]
    saved = Image.open(tmp_path / rows[0]["images"][0])
    assert saved.size == (56, 28) and saved.getpixel((0, 0)) == (0, 200, 0)


def test_an_unscored_completion_reads_null_and_the_reward_that_failed(tmp_path, tiny_default):
    """completions.jsonl: a completion a reward could not score (a judge that timed out) has reward null, that
    reward null and the reason; never the placeholder 0.0 the loss leaves out."""
    import json

    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(tiny_default[0])
    args = train.parse_args(["--output_dir", str(tmp_path), "--log_completions_steps", "1", "--log_completions", "2"])
    run = types.SimpleNamespace(args=args, master=True, processor=processor, start=0)
    ids = processor.tokenizer("what colour", add_special_tokens=False)["input_ids"]
    groups = [train.Group(sample=dict(images=[], vllm_ids=ids, where=f"t.jsonl:{k + 1}", id=k),
                          completions=[train.Completion(index=0, token_ids=ids, sampler_logps=[0.0] * len(ids),
                                                        text="red", finish_reason="stop", total=0.5 * (1 - k),
                                                        rewards={"accuracy": 1.0, "judge": 0.0},
                                                        failed={"accuracy": False, "judge": k == 1})])
              for k in range(2)]
    logs.log_completions(run, groups, step=1)
    scored, unscored = [json.loads(line) for line in open(tmp_path / "completions.jsonl")]
    assert scored["reward"] == 0.5 and scored["rewards"] == {"accuracy": 1.0, "judge": 0.0}
    assert "unscored" not in scored
    assert unscored["reward"] is None and unscored["rewards"] == {"accuracy": 1.0, "judge": None}
    assert unscored["unscored"] == "judge failed"
