"""Never lose a run: a resumed run reproduces the uninterrupted one bitwise (CPU, fp32), after a
SIGKILL in the middle of a step and in the middle of a checkpoint save, with 2 and 1 processes."""
import os
import shutil
import signal
import subprocess
import sys
import time

from conftest import FAST, ROOT, command, launch, read_metrics

FLAGS = [*FAST, "--max_steps", "6", "--val_freq", "3", "--save_steps", "2", "--save_total_limit", "5",
         "--num_iterations", "2", "--report_to", "wandb"]
SAME = ("reward/mean", "reward/std", "train/loss", "train/kl", "train/grad_norm", "train/clip_frac",
        "completion/length", "val/reward")


def start_and_kill(out_dir, when, procs=2):
    """Start the run and SIGKILL its whole process group (launcher + ranks) once `when()` holds."""
    cmd, env = command(out_dir, FLAGS, procs)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "killed.log"), "a") as log:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 900
        while p.poll() is None and not when() and time.time() < deadline:
            time.sleep(0.001)
        assert p.poll() is None, "the run ended before the kill point"
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def logged(out_dir, step):
    path = os.path.join(out_dir, "metrics.jsonl")
    return os.path.exists(path) and any(r["step"] >= step for r in read_metrics(out_dir) if "reward/mean" in r)


def assert_same(a, b):
    assert [(r["step"], sorted(r)) for r in a if "val/reward" in r] == [(r["step"], sorted(r)) for r in b if "val/reward" in r]
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        for k in SAME:
            assert x.get(k) == y.get(k), (x["step"], k, x.get(k), y.get(k))   # bitwise: ==, not approx


def test_sigkill_mid_save_and_mid_step_then_resume_exactly(tmp_path, tiny_default):
    full, _ = launch(tmp_path / "full", *FLAGS)
    run = tmp_path / "run"
    # 1. killed while checkpoint-4 is being written: the partial .tmp must never be picked
    start_and_kill(run, lambda: os.path.isdir(run / "checkpoint-4.tmp"))
    assert not (run / "checkpoint-4").exists()
    # 2. resumed (from checkpoint-2), then killed in the middle of step 5
    start_and_kill(run, lambda: logged(run, 4) and (run / "checkpoint-4").is_dir())
    # 3. resumed from checkpoint-4 to the end
    rows, log = launch(run, *FLAGS)
    assert "[resume] from" in log and "checkpoint-4: step 4" in log
    assert_same(full, rows)
    run_ids = {d.rsplit("-", 1)[1] for d in os.listdir(run / "wandb") if d.startswith("offline-run-")}
    assert len(run_ids) == 1, run_ids                   # the resumed runs continued the same wandb run
    ckpts = sorted(d for d in os.listdir(run) if d.startswith("checkpoint"))
    assert ckpts == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]   # no .tmp left behind
    # the exported model loads in transformers, and in vLLM, which generates from an image with it
    from transformers import AutoModelForImageTextToText, AutoProcessor
    AutoModelForImageTextToText.from_pretrained(run / "final_model")
    assert AutoProcessor.from_pretrained(run / "final_model").chat_template
    r = subprocess.run([sys.executable, "-c", VLLM_GENERATE, str(run / "final_model")], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0 and "GENERATED" in r.stdout, (r.stdout + r.stderr)[-3000:]


VLLM_GENERATE = """
import os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from PIL import Image
from transformers import AutoProcessor
from vllm import LLM, SamplingParams
path = sys.argv[1]
proc = AutoProcessor.from_pretrained(path)
msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}]
ids = proc.tokenizer(proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))["input_ids"]
llm = LLM(model=path, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=256)
out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": [Image.new("RGB", (56, 56), "red")]}}],
                   SamplingParams(max_tokens=3, temperature=0.0))
assert len(out[0].outputs[0].token_ids) >= 1
print("GENERATED", repr(out[0].outputs[0].text))
"""


def test_resume_exact_with_one_process(tmp_path, tiny_default):
    flags = [*FAST, "--max_steps", "4", "--val_freq", "2", "--save_steps", "2", "--rollout_batch_size", "8",
             "--no-save_final_model"]
    full, _ = launch(tmp_path / "full", *flags, procs=1)
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoint-4")
    rows, log = launch(tmp_path / "cut", *flags, procs=1)
    assert "checkpoint-2: step 2" in log
    assert_same(full, rows)
