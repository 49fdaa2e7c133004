"""Checkpoints that can be trusted, in-process on one gloo rank with the real DeepSpeed engine (ZeRO-3 on a
Linear): a relaunch's flags against the checkpoint's, the manifest against damaged checkpoints, a full disk, a
whole checkpoint-<step>.tmp and the signals of a Ctrl-C and a closed terminal, and the per-rank state loaded with
weights_only. The launches that show the same end to end are in tests/test_resume.py."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

import checkpoint
import flags
import model
from conftest import ROOT, terminal_signals


def engine_of(*argv):
    """(DeepSpeed engine of a Linear under ZeRO-3 with the flags' optimizer and schedule, the flags)."""
    import deepspeed
    args = flags.parse_args(["--rollout_batch_size", "1", "--num_generations", "2", "--per_device_train_batch_size",
                             "2", "--lr_scheduler_type", "constant", *argv])
    net = torch.nn.Linear(4, 3)
    cfg = model.ds_config(args, flags.grad_accumulation_steps(args, 1), 1, bf16=False)
    engine, *_ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()), config=cfg,
                                      lr_scheduler=model.lr_schedule(args))
    return engine, args


class Stream:
    """Stands in for data.PromptStream: a data position and the rewards it remembers."""
    def __init__(self):
        self.st = {"epoch": 0, "cursor": 3, "skipped": 0, "history": {7: [0.0, 1.0]}, "empty_images": 0}

    def state(self):
        return dict(self.st)

    def load(self, st):
        self.st = st


def trained_and_saved(out_dir, steps, *argv):
    """An engine trained a step before each save of `steps` into out_dir; -> (engine, args)."""
    engine, args = engine_of("--output_dir", str(out_dir), "--save_total_limit", "5", *argv)
    for step in steps:
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
        checkpoint.save_checkpoint(engine, args, step, Stream(), "id", 0)
    return engine, args


# ----------------------------------------------------------------------------- a relaunch's flags
def test_a_relaunch_says_the_flags_it_applies_and_refuses_those_that_change_the_state():
    """Before: a relaunch resumed whatever its flags said. A change that steers the rest of the run is said
    and applied; one that changes what the saved state means is refused by name with the way out; another
    number of ranks is said (it was refused); a value set-up derives later is compared only where a launch gave it."""
    saved = vars(flags.parse_args(["--save_steps", "2"]))          # the tiny default: lr 1e-3, 16 generations
    saved["per_device_train_batch_size"] = 32                       # what set-up derived and trainer_state.json holds
    now = vars(flags.parse_args(["--save_steps", "5", "--learning_rate", "5e-4", "--max_steps", "400"]))
    said, refusal = flags.changed_flags(saved, now, 2, 2)
    assert refusal is None and said == ["[resume] --learning_rate 0.001 -> 0.0005: applied from here on",
                                        "[resume] --max_steps 300 -> 400: applied from here on",
                                        "[resume] --save_steps 2 -> 5: applied from here on"]
    other = {**saved, "num_generations": 8, "model": "other/model"}
    said, refusal = flags.changed_flags(saved, other, 2, 2, name="checkpoint-4")
    assert said == [] and refusal.startswith("error: this launch changes what the state in checkpoint-4 means:")
    assert "  --model None -> other/model: the model" in refusal
    assert "  --num_generations 16 -> 8: the group size" in refusal
    assert "choose another --output_dir" in refusal
    assert refusal.endswith("name the changes: --accept_changed_flags model num_generations")
    said, refusal = flags.changed_flags(saved, other, 2, 2, accept=["model", "num_generations"])
    assert refusal is None and "[resume] --num_generations 16 -> 8: accepted from here on" in said
    said, refusal = flags.changed_flags(saved, saved, 2, 1, name="checkpoint-4")   # another number of ranks: said
    assert refusal is None and said == ["[resume] checkpoint-4 was saved by 2 ranks and this launch has 1: its ZeRO-3 "
                                        "state loads through DeepSpeed's universal checkpoint, and the data position "
                                        "and random streams are carried over (docs/resilience.md, another number of "
                                        "GPUs)"]


def test_a_relaunch_trains_at_its_own_learning_rate_and_weight_decay(world1, tmp_path):
    """Before: the optimizer's param groups and the scheduler's base rate came back from the checkpoint, so
    --learning_rate 5e-4 after a run at 1e-3 trained at 1e-3 (while trainer_state.json said 5e-4)."""
    trained_and_saved(tmp_path, [1], "--learning_rate", "1e-3", "--weight_decay", "0")
    engine, args = engine_of("--output_dir", str(tmp_path), "--learning_rate", "5e-4", "--weight_decay", "0.1")
    ckpt = checkpoint.pick_checkpoint(args, 0, 1)
    assert checkpoint.resume(engine, Stream(), args, 0, ckpt) == (str(tmp_path / "checkpoint-1"), 1)
    assert engine.get_lr() == [5e-4] and engine.optimizer.param_groups[0]["weight_decay"] == 0.1
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    assert engine.get_lr() == [5e-4]                  # and the scheduler's next step keeps it


# ----------------------------------------------------------------------------- a damaged checkpoint
DAMAGE = {   # what was done to checkpoint-2, and what the check says of it
    "cut short": (lambda d: os.truncate(d / "zero" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", 1000),
                  "zero/zero_pp_rank_0_mp_rank_00_optim_states.pt has 1000 bytes where its manifest says"),
    "optimizer deleted": (lambda d: os.remove(d / "zero" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                          "zero/zero_pp_rank_0_mp_rank_00_optim_states.pt is missing"),
    "model deleted": (lambda d: os.remove(d / "zero" / "zero_pp_rank_0_mp_rank_00_model_states.pt"),
                      "zero/zero_pp_rank_0_mp_rank_00_model_states.pt is missing"),
    "state deleted": (lambda d: os.remove(d / "trainer_state.json"), "trainer_state.json is missing"),
    "a byte changed": (lambda d: flip_a_byte(d / "rank0.pt"), "rank0.pt has the manifest's size but not its CRC32"),
}


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def test_a_damaged_checkpoint_is_named_and_the_newest_whole_one_used(world1, tmp_path, capsys):
    """Before: a cut shard crashed the resume ("PytorchStreamReader failed reading zip archive", naming
    neither file nor checkpoint), a deleted optimizer or model shard gave FileNotFoundError or a bare
    AssertionError, and a deleted trainer_state.json silently resumed from the checkpoint before."""
    saved = tmp_path / "saved"
    trained_and_saved(saved, [1, 2])
    assert checkpoint.damage(str(saved / "checkpoint-2")) == []
    for kind, (harm, said) in DAMAGE.items():
        out = tmp_path / kind.replace(" ", "_")
        shutil.copytree(saved, out)
        harm(out / "checkpoint-2")
        (wrong,) = checkpoint.damage(str(out / "checkpoint-2"))
        assert wrong.startswith(said), (kind, wrong)
        engine, args = engine_of("--output_dir", str(out))
        capsys.readouterr()
        ckpt = checkpoint.pick_checkpoint(args, 0, 1)
        log = capsys.readouterr().out
        assert ckpt == str(out / "checkpoint-1"), kind
        assert f"[resume] {out / 'checkpoint-2'} is not whole: {said}" in log, log
        assert f"[resume] {out / 'checkpoint-1'} is the newest whole checkpoint, used instead: its 6 files match " \
               f"its manifest" in log, log
        assert sorted(os.listdir(out)) == ["checkpoint-1", "checkpoint-2.damaged"]   # set aside, out of the way
        assert checkpoint.resume(engine, Stream(), args, 0, ckpt)[1] == 1
    for d in (tmp_path / "state_deleted", tmp_path / "cut_short"):   # nothing whole left: refused, not step 0
        shutil.rmtree(d / "checkpoint-1" / "zero")
        with pytest.raises(SystemExit, match=r"error: no whole checkpoint to resume from .*checkpoint-1: zero/"):
            checkpoint.pick_checkpoint(engine_of("--output_dir", str(d))[1], 0, 1)


# ----------------------------------------------------------------------------- a whole .tmp
def test_a_whole_tmp_is_kept_and_an_unfinished_one_removed(world1, tmp_path, capsys):
    """A kill after a save's last file and before its rename (Ctrl-C: DeepSpeed's launcher SIGKILLs 30 s
    later) left a whole checkpoint-<step>.tmp that no launch used: the finished steps were trained again.
    Now it is checked against its manifest and kept; an unfinished one is removed, and both are said."""
    trained_and_saved(tmp_path, [1, 2])
    os.rename(tmp_path / "checkpoint-2", tmp_path / "checkpoint-2.tmp")        # as the kill leaves it
    shutil.copytree(tmp_path / "checkpoint-2.tmp", tmp_path / "checkpoint-3.tmp")
    os.remove(tmp_path / "checkpoint-3.tmp" / "trainer_state.json")           # killed before its last file
    ckpt = checkpoint.pick_checkpoint(engine_of("--output_dir", str(tmp_path))[1], 0, 1)
    log = capsys.readouterr().out
    assert ckpt == str(tmp_path / "checkpoint-2") and sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-2"]
    assert "[resume] checkpoint-2.tmp is whole (a kill came after its last file and before its rename): kept as " \
           "checkpoint-2" in log and "[resume] removed checkpoint-3.tmp: a save that did not finish" in log
    first = tmp_path / "first"   # the first save, killed before its last file: the run starts over, as before
    shutil.copytree(tmp_path / "checkpoint-1", first / "checkpoint-1.tmp", ignore=shutil.ignore_patterns("trainer_*"))
    assert checkpoint.pick_checkpoint(engine_of("--output_dir", str(first))[1], 0, 1) is None
    assert os.listdir(first) == [] and "[resume] removed checkpoint-1.tmp" in capsys.readouterr().out


SIGNALS = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
import job
job.install_preemption_handler(0)
for s in sys.argv[1:]:
    os.kill(os.getpid(), getattr(signal, s))
    time.sleep(0.2)
    print("FLAGGED", [signal.Signals(x).name for x in job._signalled], flush=True)
"""


def test_ctrl_c_and_a_hang_up_finish_the_step_and_checkpoint(tmp_path):
    """Before: Ctrl-C raised KeyboardInterrupt wherever a rank was (a save included), and SIGHUP (a closed
    terminal, to the whole process group) killed every process at once, with no line in the log. Now both
    set the preemption flag (the step finishes, a checkpoint, exit 75) and a Ctrl-C says what it does and
    that the launcher gives it 30 s; a second Ctrl-C stops at once; nohup's ignored SIGHUP stays ignored."""
    code = SIGNALS.format(root=ROOT)
    r = subprocess.run([sys.executable, "-c", code, "SIGHUP", "SIGINT", "SIGINT"], capture_output=True, text=True,
                       timeout=120, preexec_fn=terminal_signals)
    assert "FLAGGED ['SIGHUP']\n" in r.stdout and "FLAGGED ['SIGHUP', 'SIGINT']\n" in r.stdout, r.stdout + r.stderr
    assert "[preempt] SIGHUP on rank 0: finishing this step, then checkpoint and exit 75" in r.stdout
    assert "[preempt] Ctrl-C: this step finishes, then a checkpoint and exit 75. DeepSpeed's launcher SIGKILLs the " \
           "ranks 30 s after a Ctrl-C" in r.stdout
    assert r.returncode != 0 and r.stderr.rstrip().endswith("KeyboardInterrupt")   # the second Ctrl-C
    nohup = subprocess.run([sys.executable, "-c", code, "SIGHUP"], capture_output=True, text=True, timeout=120,
                           preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    assert nohup.returncode == 0 and "FLAGGED []" in nohup.stdout, nohup.stdout + nohup.stderr


# ----------------------------------------------------------------------------- a full disk
def test_a_full_disk_is_said_with_the_last_good_checkpoint(world1, tmp_path, monkeypatch):
    """Before: a save that hit ENOSPC ended the run with "basic_ios::clear: iostream error" or "unexpected
    pos" and left checkpoint-N.tmp, and nothing said "disk full" or which checkpoint was the last good one.
    The stand-in for a full disk is the kernel's own: DeepSpeed's shards go to /dev/full, where every write
    fails with ENOSPC, through torch's real writer (no tmpfs or loop mount here); the free space that the
    message reports is patched to what a full disk shows."""
    engine, args = trained_and_saved(tmp_path, [1])
    real_save, full = engine.checkpoint_engine.save, []
    monkeypatch.setattr(engine.checkpoint_engine, "save",
                        lambda state_dict, path: full.append(path) or real_save(state_dict, "/dev/full"))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=4096 if full else usage.free))
    with pytest.raises(SystemExit) as stop:
        checkpoint.save_checkpoint(engine, args, 2, Stream(), "id", 0)
    assert str(stop.value).startswith(f"error: rank 0 could not write checkpoint-2: the disk of {tmp_path} is full "
                                      f"(0.0 MB free; RuntimeError: ")
    assert f"The last good checkpoint is {tmp_path / 'checkpoint-1'}: free some space and relaunch" in str(stop.value)
    assert (tmp_path / "checkpoint-2.tmp").is_dir()                       # the relaunch resumes from 1, and removes it
    assert checkpoint.pick_checkpoint(args, 0, 1) == str(tmp_path / "checkpoint-1")
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1"]


def test_a_save_without_room_first_removes_what_it_would_remove_after_or_stops(tmp_path, monkeypatch, capsys):
    """Before a save, the free space is compared with the last checkpoint's size. Here a disk of a fixed
    capacity stands in (disk_usage's free is the capacity less what the folder holds)."""
    for step in (2, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "shard").write_bytes(b"\0" * 1_000_000)
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    usage = shutil.disk_usage(tmp_path)
    capacity = []
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: usage._replace(free=capacity[0] - checkpoint.checkpoint_bytes(p)))
    capacity[:] = [3_200_000]   # room for a third with two kept: nothing to do
    assert checkpoint.make_room(str(tmp_path), 2, 6) is None and len(os.listdir(tmp_path)) == 2
    capacity[:] = [2_500_000]   # room only once checkpoint-2, which this save removes after it, goes first
    assert checkpoint.make_room(str(tmp_path), 2, 6) is None and os.listdir(tmp_path) == ["checkpoint-4"]
    assert "removed checkpoint-2 before saving checkpoint-6 (--save_total_limit 2 would remove it after)" in \
        capsys.readouterr().out
    capacity[:] = [1_800_000]   # the newest is never removed: the run stops before the save
    refusal = checkpoint.make_room(str(tmp_path), 2, 6)
    assert refusal.startswith(f"error: the disk of {tmp_path} has 0.8 MB free and a checkpoint takes ~1.1 MB") and \
        refusal.endswith(f"The last good checkpoint is {tmp_path / 'checkpoint-4'}: free some space and relaunch to "
                         f"resume from it")
    assert os.listdir(tmp_path) == ["checkpoint-4"]


# ----------------------------------------------------------------------------- rank<r>.pt with weights_only
class Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_the_per_rank_state_loads_without_running_code(world1, tmp_path, monkeypatch):
    """rank<r>.pt (RNG states, data position) is loaded with weights_only=True: the RNG states' numpy types
    are allowed by name, and a file that would run code on load is refused without running it."""
    engine, args = trained_and_saved(tmp_path / "run", [1])
    stream = Stream()
    assert checkpoint.resume(engine, stream, args, 0, str(tmp_path / "run" / "checkpoint-1"))[1] == 1
    assert stream.st["history"] == {7: [0.0, 1.0]}
    torch.save({"rng": Evil(), "stream": {}}, tmp_path / "run" / "checkpoint-1" / "rank0.pt")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="rank0.pt would build more than tensors and plain data when it is loaded "
                                         r"\(a call of posix.system\): loading it could run code") as e:
        checkpoint.resume(engine, stream, args, 0, str(tmp_path / "run" / "checkpoint-1"))
    assert "do not turn this check off" in str(e.value) and not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("name", ["zero/zero_pp_rank_0_mp_rank_00_model_states.pt",
                                  "zero/zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_deepspeeds_files_are_loaded_without_running_code(world1, tmp_path, monkeypatch, name):
    """A pickle payload in DeepSpeed's zero/ files ran at a resume without a word (DeepSpeed loads them with
    torch.load(weights_only=False)), and its manifest, rewritten by whoever changed the file, matched. Every .pt file
    of the checkpoint is now unpickled with weights_only (its tensors memory-mapped) before anything loads it: such a
    file is refused by name, and nothing runs; DeepSpeed's own loads of this engine go through weights_only too. A
    checkpoint this code wrote passes (ZeroStageEnum and LossScaler are the only types beside tensors and plain data
    in DeepSpeed 0.19.8's optimizer states)."""
    engine, args = trained_and_saved(tmp_path / "run", [1])
    ckpt = tmp_path / "run" / "checkpoint-1"
    assert checkpoint.pick_checkpoint(args, 0, 1) == str(ckpt)
    state = torch.load(ckpt / name, weights_only=False)
    torch.save({**state, "evil": Evil()}, ckpt / name)
    saved = json.loads((ckpt / "trainer_state.json").read_text())
    (ckpt / "trainer_state.json").write_text(json.dumps({**saved, "files": checkpoint.manifest(str(ckpt))}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=f"error: {ckpt / name} would build more than tensors and plain data") as e:
        checkpoint.pick_checkpoint(args, 0, 1)
    assert "(a call of posix.system)" in str(e.value) and not (tmp_path / "pwned").exists()
    with pytest.raises(SystemExit, match=f"error: {ckpt / name} would build"):   # past the check: DeepSpeed's own load
        checkpoint.resume(engine, Stream(), args, 0, str(ckpt))
    assert not (tmp_path / "pwned").exists()


def test_a_checkpoint_from_before_manifests_is_taken_as_whole(world1, tmp_path, capsys):
    trained_and_saved(tmp_path, [1])
    state = json.loads((tmp_path / "checkpoint-1" / "trainer_state.json").read_text())
    del state["files"], state["world"]
    (tmp_path / "checkpoint-1" / "trainer_state.json").write_text(json.dumps(state))
    args = engine_of("--output_dir", str(tmp_path))[1]
    assert checkpoint.pick_checkpoint(args, 0, 1) == str(tmp_path / "checkpoint-1")
    assert "saved before checkpoints had a manifest, its files are not checked" in capsys.readouterr().out


def test_the_manifest_is_written_last_in_the_state(world1, tmp_path):
    trained_and_saved(tmp_path, [1])
    state = json.loads((tmp_path / "checkpoint-1" / "trainer_state.json").read_text())
    files = {os.path.relpath(os.path.join(d, f), tmp_path / "checkpoint-1")
             for d, _, fs in os.walk(tmp_path / "checkpoint-1") for f in fs} - {"trainer_state.json"}
    assert set(state["files"]) == files and state["world"] == 1 and state["step"] == 1
    assert all(size == os.path.getsize(tmp_path / "checkpoint-1" / f) for f, (size, _) in state["files"].items())
    assert types.SimpleNamespace(**state["args"]).learning_rate == 1e-3


# ----------------------------------------------------------------------------- items 4 and 5: other ranks, other data
def stream_of(path, rank=0, world=1, took=0, monkeypatch=None):
    """A real data.PromptStream over the JSONL `path` (text rows: no processor needed) that has taken `took` rows."""
    import data
    stream = data.PromptStream(data.Rows(str(path)), None, flags.parse_args([]), rank, world)
    if took:
        monkeypatch.setattr(data, "prepare", lambda r, processor, args, *rest: {"id": r["_id"], "empty_image": False})
        stream.history.update((s["id"], [1.0]) for s in stream.next(took))
    return stream


def text_rows(path, n, first=0):
    with open(path, "a") as f:
        f.writelines(json.dumps({"question": f"What is {i} + {i}?", "solution": str(2 * i)}) + "\n"
                     for i in range(first, first + n))


@pytest.mark.parametrize("change", ["append", "shuffle"])
def test_changed_data_is_refused_by_name_or_starts_a_fresh_epoch(world1, tmp_path, capsys, monkeypatch, change):
    """20 lines appended to a 2,000-line file, or the file shuffled, resumed without a word,
    the position a cursor into a shuffle of the old row count. Now the checkpoint keeps the file's fingerprint:
    the resume is refused naming the file, or with --accept_changed_data a fresh epoch starts, said; the history
    keeps its entries by sample identity, which a shuffle does not change."""
    import random
    path = tmp_path / "train.jsonl"
    text_rows(path, 2000)
    engine, args = engine_of("--output_dir", str(tmp_path / "run"), "--train_data", str(path))
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    saved = stream_of(path, took=64, monkeypatch=monkeypatch)
    checkpoint.save_checkpoint(engine, args, 1, saved, "id", 0)
    assert json.load(open(tmp_path / "run" / "checkpoint-1" / "trainer_state.json"))["data"]["rows"] == 2000
    assert checkpoint.pick_checkpoint(args, 0, 1) == str(tmp_path / "run" / "checkpoint-1")   # unchanged: no word
    if change == "append":
        text_rows(path, 20, first=2000)
    else:
        lines = path.read_text().splitlines(True)
        random.Random(0).shuffle(lines)
        path.write_text("".join(lines))
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        checkpoint.pick_checkpoint(args, 0, 1)
    assert str(refused.value).startswith(f"error: --train_data {path} changed since checkpoint-1 was saved "
                                         "(2000 rows, ")
    assert "--accept_changed_data" in str(refused.value)
    args.accept_changed_data = True
    ckpt = checkpoint.pick_checkpoint(args, 0, 1)
    assert f"[resume] --train_data {path} changed since checkpoint-1" in capsys.readouterr().out
    stream = stream_of(path)
    assert checkpoint.resume(engine, stream, args, 0, ckpt)[1] == 1
    assert (stream.epoch, stream.cursor) == (1, 0)
    assert "--accept_changed_data, epoch 1 starts afresh" in capsys.readouterr().out
    rows = stream.rows
    now = {rows[i]["_id"]: rows[i]["question"] for i in range(len(rows))}
    before = {saved.rows[i]["_id"]: saved.rows[i]["question"] for i in range(len(saved.rows))}
    assert stream.history == saved.history and all(now[k] == before[k] for k in stream.history)   # the same samples


def gathered(engine):
    """(every parameter, the fp32 master and Adam's moments) of a one-rank ZeRO-3 engine, as plain tensors."""
    import deepspeed
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().clone() for p in engine.module.parameters()]
    opt = engine.optimizer
    flat = opt.fp32_partitioned_groups_flat[0]
    return params + [flat.detach().clone(), opt.optimizer.state[flat]["exp_avg"].clone(),
                     opt.optimizer.state[flat]["exp_avg_sq"].clone()]


def test_a_checkpoint_of_two_ranks_resumes_on_one_through_the_universal_checkpoint(world1, tmp_path, capsys,
                                                                                   monkeypatch):
    """Another number of ranks, in-process on one gloo rank: a checkpoint whose trainer_state.json says 2 ranks (its
    rank1.pt that of a second data stream) resumes on 1. pick_checkpoint converts it with DeepSpeed's ds_to_universal
    into checkpoint-1/universal once (a .tmp that a killed conversion left is made again, and so is a damaged one), its
    manifest still verifies, and resume loads the weights, Adam's moments, the step and the schedule exactly as a load
    on the same number of ranks does; the data goes on where both ranks were, and rank 0's random streams go on. Before,
    this was refused."""
    import functools
    monkeypatch.setattr(checkpoint, "to_universal", functools.partial(checkpoint.to_universal, poll_s=0.05))
    path = tmp_path / "train.jsonl"
    text_rows(path, 40)
    engine, args = engine_of("--output_dir", str(tmp_path / "run"), "--train_data", str(path), "--learning_rate", "0.1")
    for _ in range(2):
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
    ranks = [stream_of(path, r, 2, took=5 + 2 * r, monkeypatch=monkeypatch) for r in range(2)]
    ckpt = tmp_path / "run" / "checkpoint-2"
    checkpoint.save_checkpoint(engine, args, 2, ranks[0], "id", 0)
    saved_rng = checkpoint.rank_state(str(ckpt), 0)["rng"]
    torch.save({"rng": checkpoint.rng_state(), "stream": ranks[1].state()}, ckpt / "rank1.pt")  # not in its manifest
    state = json.loads((ckpt / "trainer_state.json").read_text())
    (ckpt / "trainer_state.json").write_text(json.dumps({**state, "world": 2}))
    (ckpt / "universal.tmp").mkdir()   # a conversion killed midway
    (ckpt / "universal.tmp" / "half").write_text("x")
    want = gathered(engine)
    fresh, args = engine_of("--output_dir", str(tmp_path / "run"), "--train_data", str(path), "--learning_rate", "0.1")
    capsys.readouterr()
    assert checkpoint.pick_checkpoint(args, 0, 1) == str(ckpt)
    log = capsys.readouterr().out
    assert "[resume] checkpoint-2 was saved by 2 ranks and this launch has 1" in log
    assert f"[resume] converting {ckpt}/zero to DeepSpeed's universal checkpoint" in log
    assert not (ckpt / "universal.tmp").exists() and checkpoint.damage(str(ckpt / "universal")) == []
    assert checkpoint.damage(str(ckpt)) == []   # the checkpoint's own manifest still verifies
    stream = stream_of(path)
    assert checkpoint.resume(fresh, stream, args, 0, str(ckpt)) == (str(ckpt), 2)
    assert "[resume] 2 ranks saved it and 1 resume it" in capsys.readouterr().out
    assert all(torch.equal(a, b) for a, b in zip(want, gathered(fresh)))
    assert fresh.global_steps == engine.global_steps and fresh.get_lr() == engine.get_lr()
    assert stream.epoch == 0 and stream.consumed[0] == {i for s in ranks for i in range(40)
                                                         if s.rows[i]["_id"] in s.history}
    assert stream.history == {**ranks[0].history, **ranks[1].history} and random.getstate() == saved_rng["python"]
    os.remove(next((ckpt / "universal" / "zero" / "zero").glob("*/exp_avg.pt")))   # damaged: made again
    assert checkpoint.to_universal(str(ckpt), 0) == str(ckpt / "universal")
    assert "universal is not whole: made again" in capsys.readouterr().out
    assert checkpoint.damage(str(ckpt / "universal")) == []


def test_the_random_streams_of_another_number_of_ranks():
    """A rank that saved goes on with its own python, numpy and torch streams; a new rank gets streams of its own,
    seeded from saved rank 0's and its rank: the same at every relaunch, another for every rank."""
    saved = []
    for seed in (1, 2):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        saved.append(checkpoint.rng_state())
    assert checkpoint.rng_of_rank(saved, 1)["python"] == saved[1]["python"]
    assert torch.equal(checkpoint.rng_of_rank(saved, 0)["torch"], saved[0]["torch"])
    new = [checkpoint.rng_of_rank(saved, r) for r in (2, 3)]
    assert new[0]["python"] != new[1]["python"] and not torch.equal(new[0]["torch"], new[1]["torch"])
    assert new[0]["python"] == checkpoint.rng_of_rank(saved, 2)["python"]
    assert all(not torch.equal(n["torch"], s["torch"]) for n in new for s in saved)


def test_a_failed_conversion_stops_every_rank_with_its_log(world1, tmp_path, monkeypatch):
    """DeepSpeed's converter failing (a checkpoint it cannot convert) stops the launch with the end of its log and the
    way out, and leaves no universal/ that a later resume would take as made."""
    (tmp_path / "zero").mkdir()
    monkeypatch.setattr(checkpoint, "universal_command", lambda ckpt, out: [
        sys.executable, "-c", "import sys; print('NotImplementedError: cannot convert this'); sys.exit(3)"])
    with pytest.raises(SystemExit) as stop:
        checkpoint.to_universal(str(tmp_path), 0, poll_s=0.05)
    assert "conversion of" in str(stop.value) and "failed (exit 3)" in str(stop.value)
    assert "NotImplementedError: cannot convert this" in str(stop.value)
    assert "Launch the number of ranks that saved it" in str(stop.value) and not (tmp_path / "universal").exists()


# ----------------------------------------------------------------------------- a fork's own state
def test_run_state_and_the_updates_are_saved_with_each_checkpoint_and_resumed(world1, tmp_path, monkeypatch):
    """run.state (plain data and tensors) goes to state.pt, listed in the manifest, and the update count to
    trainer_state.json; run_state gives both back (run.updates restarted at 0 on resume before). A checkpoint saved
    without them resumes with {} and one update a step. A state that differs between ranks is refused by name."""
    engine, args = engine_of("--output_dir", str(tmp_path))
    state = {"beta": 0.05, "pass_rate": {"sha1:ab": [1, 4], 7: [0, 4]}, "t": torch.arange(3.0)}
    ckpt = checkpoint.save_checkpoint(engine, args, 3, Stream(), "id", 0, state=state, updates=5)
    assert "state.pt" in json.load(open(os.path.join(ckpt, "trainer_state.json")))["files"]
    got, updates = checkpoint.run_state(ckpt, 3)
    assert updates == 5 and got["beta"] == 0.05 and got["pass_rate"] == state["pass_rate"]
    assert torch.equal(got["t"], state["t"])
    old = checkpoint.save_checkpoint(engine, args, 4, Stream(), "id", 0)
    assert checkpoint.run_state(old, 4) == ({}, 4) and checkpoint.run_state(None, 0) == ({}, 0)
    monkeypatch.setattr(checkpoint, "_from_everyone", lambda obj: [obj, obj + 1])   # rank 1's state differs
    with pytest.raises(RuntimeError, match="run.state must be the same on every rank"):
        checkpoint.save_state(state, str(tmp_path / "state.pt"), 0)


def test_a_relaunch_may_change_beta_while_the_kl_controller_owns_it():
    """--kl_target: the live beta is in run.state and resumes from the checkpoint, so a relaunch's other --beta (its
    starting value) is said and not refused; without the controller it changes the loss and is refused."""
    saved = vars(flags.parse_args(["--beta", "0.04", "--kl_target", "0.01"]))
    said, refusal = flags.changed_flags(saved, {**saved, "beta": 0.08}, 1, 1)
    assert refusal is None and said == ["[resume] --beta 0.04 -> 0.08: --kl_target's beta goes on from the "
                                        "checkpoint's"]
    plain = vars(flags.parse_args(["--beta", "0.04"]))
    assert "--beta 0.04 -> 0.08" in flags.changed_flags(plain, {**plain, "beta": 0.08}, 1, 1)[1]
