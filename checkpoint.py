"""Never lose a run: checkpoints written atomically and found again, an HF-format export, logs
rewritten atomically, what killed launches leave behind, and preemption.

A checkpoint is output_dir/checkpoint-<step>: DeepSpeed's own save_checkpoint (ZeRO-3 shards,
optimizer, scheduler) under zero/, one rank<r>.pt per rank (RNG states, data position) and
trainer_state.json (step, flags, wandb run id). It is written as checkpoint-<step>.tmp and
renamed last, so a crash mid-save never leaves a directory that resume would take as complete.
Every other file rewritten in place (metrics.jsonl on resume, the wandb run id) goes through
write_atomic. A killed launch can leave a JIT-op lock and its /dev/shm allreduce buffers (both
cleared at the next start when no live process holds them). An output folder belongs to one live
job (claim_output_dir): a second launch into it is refused, naming the owner, and the job that
takes it removes the temp files of write_atomic that a kill left.
"""
import json
import os
import random
import re
import secrets
import shutil
import signal
import time

import numpy as np
import torch
import torch.distributed as dist


def rng_state():
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st):
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st:
        torch.cuda.set_rng_state_all(st["cuda"])


def save_checkpoint(engine, args, step, stream, run_id, rank):
    """Full state in output_dir/checkpoint-<step>: ZeRO-3 shards with optimizer and scheduler
    (DeepSpeed's save_checkpoint), every rank's RNG and data position, step, flags, wandb id.
    Written to checkpoint-<step>.tmp and renamed last, so a crash mid-save never leaves a
    directory that resume would pick as complete."""
    final = os.path.join(args.output_dir, f"checkpoint-{step}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    aside = [(state, key, state.pop(key)) for state, key in offload_buffers(engine)]
    try:
        # frozen weights (LoRA's base model, a frozen vision tower) are the checkpoint's they were loaded
        # from: left out, a LoRA checkpoint is adapter-sized, and a resume keeps them as loaded
        engine.save_checkpoint(tmp, tag="zero", exclude_frozen_parameters=has_frozen(engine))
    finally:   # offload_states reuses them at the next offload
        for state, key, buf in aside:
            state[key] = buf
    torch.save({"rng": rng_state(), "stream": stream.state()}, os.path.join(tmp, f"rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({"step": step, "wandb_id": run_id, "args": vars(args)}, f, indent=1)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)   # the commit point
        for old in list_checkpoints(args.output_dir)[:-args.save_total_limit or None]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def offload_buffers(engine):
    """[(state dict, key)] of DeepSpeed offload_states' host copies of Adam's moments: it keeps them
    in the optimizer state as <key>_offload_buffer (runtime/zero/offload_states.py), so a checkpoint
    would save them and load_state_dict would move them to the GPU, after which every offload
    "offloads" into GPU memory. Kept out of checkpoints (save_checkpoint) and dropped after a load."""
    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return [(state, key) for state in getattr(opt, "state", {}).values() for key in list(state)
            if key.endswith("_offload_buffer")]


def drop_offload_buffers(engine):
    """After load_checkpoint: offload_states makes fresh pinned host buffers at its next call. -> count."""
    found = offload_buffers(engine)
    for state, key in found:
        del state[key]
    return len(found)


def resume(engine, stream, args, rank):
    """Load --resume (auto: the newest complete checkpoint; none; or a path): weights, optimizer,
    scheduler, this rank's data position and RNG. -> (the checkpoint or None, its step or 0)."""
    ckpt = {"auto": (list_checkpoints(args.output_dir) or [None])[-1], "none": None}.get(args.resume, args.resume)
    if not ckpt:
        return None, 0
    engine.load_checkpoint(ckpt, tag="zero", load_module_strict=not has_frozen(engine))   # frozen ones were left out
    drop_offload_buffers(engine)   # older checkpoints carry offload_states' host buffers
    rate_of_this_schedule(engine)
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        step = json.load(f)["step"]
    mine = torch.load(os.path.join(ckpt, f"rank{rank}.pt"), weights_only=False)
    set_rng_state(mine["rng"])
    stream.load(mine["stream"])
    if rank == 0:
        print(f"[resume] from {ckpt}: step {step}")
    return ckpt, step


def has_frozen(engine):
    """Whether some weights train not (LoRA's base, a frozen vision tower): checkpoints leave them out."""
    return any(not p.requires_grad for p in engine.module.parameters())


def rate_of_this_schedule(engine):
    """After load_checkpoint the optimizer holds the rate the saving run's schedule set; a relaunch with
    another --max_steps (the decay's length) trained its first step at it (0 after a finished cosine).
    It is set again from this run's schedule at the restored step, as the scheduler's own step would."""
    sched = engine.lr_scheduler
    for group, base, factor in zip(engine.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * factor(sched.last_epoch)


def list_checkpoints(output_dir):
    """Complete checkpoints (renamed from .tmp, with trainer_state.json), oldest first."""
    found = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        if m and os.path.exists(os.path.join(output_dir, name, "trainer_state.json")):
            found.append((int(m.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]


def export_model(engine, processor, out_dir, master, merged=False):
    """HF-format model (safetensors + processor + chat template) that transformers and vLLM load.
    The full state dict is gathered from the ZeRO-3 shards onto rank 0 (a collective). With LoRA
    (--use_peft) the adapter alone, in PEFT's format (adapter_model.safetensors + adapter_config.json
    naming the base model), which PEFT, transformers and vLLM load on top of the base; `merged`
    (--export_merged): also the merged model, in out_dir + "_merged"."""
    if hasattr(engine.module, "peft_config"):
        from model import adapter_state
        state_dict = adapter_state(engine.module)
        if master:
            # the base's embeddings are unchanged: PEFT would otherwise add them when lm_head has an adapter
            engine.module.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True, save_embedding_layers=False)
            processor.save_pretrained(out_dir)
        if merged:
            export_merged(engine.module, processor, out_dir + "_merged", master)
        dist.barrier()
        return
    state_dict = engine._zero3_consolidated_16bit_state_dict()
    if master:
        engine.module.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
        processor.save_pretrained(out_dir)
    dist.barrier()


def export_merged(model, processor, out_dir, master):
    """A PeftModel as the plain HF model it stands for: W + scale x B A under the base names, gathered one
    bucket of whole layers at a time and merged as the merged weight sync does (rollout.hf_weights), onto
    rank 0's host (as the full model's export gathers it). The GPU never holds the model merged whole."""
    import deepspeed

    from rollout import hf_weights, lora_layers, sync_buckets
    lora, state = lora_layers(model), {}
    for bucket in sync_buckets(model, 1024):
        with deepspeed.zero.GatheredParameters([p for _, p in bucket]):
            state.update((n, t.detach().to("cpu", copy=True)) for n, t in hf_weights(bucket, lora) if master)
    if master:
        model.get_base_model().save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        processor.save_pretrained(out_dir)


# ----------------------------------------------------------------------------- files that survive a kill
def write_atomic(path, text):
    """Replace `path` with `text` at once: a kill at any instant leaves the old file or the new one."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def trim_metrics(path, step):
    """Keep the rows of metrics.jsonl up to `step` (the checkpoint resumed from; later steps are
    trained and logged again) and return them. A line torn by a kill mid-append is dropped."""
    if not os.path.exists(path):
        return []
    rows = []
    for i, line in enumerate(open(path), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"[resume] {path}:{i}: dropped a torn line (killed mid-write)")
    keep = [r for r in rows if r["step"] <= step]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in keep))
    return keep


def wandb_run_id(output_dir, fresh=False):
    """One wandb run per output_dir: its id is written there on the first launch, before any step,
    so a relaunch continues the same run even when the first kill came before the first checkpoint."""
    path = os.path.join(output_dir, "wandb_run_id")
    if fresh or not os.path.exists(path):
        write_atomic(path, secrets.token_hex(4))   # wandb's id alphabet; not `random`, which is seeded
    return open(path).read().strip()


# ----------------------------------------------------------------------------- what a killed launch leaves behind
def clear_stale_locks(ext_dir, settle_s=0.5):
    """torch builds and loads JIT ops (DeepSpeed's shm_comm on CPU, FusedAdam on GPU) under a lock
    file in TORCH_EXTENSIONS_DIR (torch.utils.file_baton.FileBaton) and waits, forever, while one
    exists. A process killed while holding it leaves it behind and every later launch hangs. The
    holder keeps the file open, so a lock that no live process has open is stale: removed, and said.
    Linux (/proc); elsewhere nothing is removed. -> the paths removed."""
    locks = [os.path.join(ext_dir, d, "lock") for d in (os.listdir(ext_dir) if os.path.isdir(ext_dir) else [])]
    locks = [p for p in locks if os.path.exists(p)]
    if not locks or not os.path.isdir("/proc/self/fd"):
        return []
    removed = []
    for p in unheld(locks, settle_s):   # twice: a holder between releasing (close) and removing its file is left alone
        try:
            os.remove(p)
            removed.append(p)
            print(f"[setup] removed stale lock {p}: no live process holds it (a launch was killed while building "
                  f"or loading a JIT op); without this every launch would wait on it forever")
        except FileNotFoundError:
            pass
    return removed


def held_files(mapped=False):
    """Real paths of every file some process of ours has open (/proc/<pid>/fd), and with `mapped` also
    mapped (/proc/<pid>/maps)."""
    held = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:   # gone, or not ours: skipped
                held.update(os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
                if mapped:
                    with open(f"/proc/{pid}/maps") as f:
                        held.update(parts[5].strip() for parts in (line.split(None, 5) for line in f) if len(parts) == 6)
            except OSError:
                pass
    return held


def unheld(paths, settle_s, mapped=False):
    """The paths no live process holds (held_files), looked at twice, settle_s apart: one held for a
    moment only (a lock being released, a buffer created but not yet mapped) is left alone."""
    for attempt in range(2):
        held = held_files(mapped)
        paths = [p for p in paths if os.path.exists(p) and os.path.realpath(p) not in held]
        if attempt == 0 and paths:
            time.sleep(settle_s)
    return paths


def clear_stale_shm_buffers(shm="/dev/shm", settle_s=0.5):
    """This user's DeepSpeed allreduce buffers (remove_shm_buffer) that no live process has open or
    mapped: left by a SIGKILLed rank (~70 MB each), removed at the next launch, and said. A buffer of
    another live job on this machine is mapped by its ranks and left alone. -> the paths removed."""
    prefix = f"deepspeed_allreduce_buffer_{os.getuid()}_"
    paths = [os.path.join(shm, f) for f in (os.listdir(shm) if os.path.isdir(shm) else []) if f.startswith(prefix)]
    if not paths or not os.path.isdir("/proc/self/fd"):
        return []
    removed = []
    for p in unheld(paths, settle_s, mapped=True):
        try:
            os.remove(p)
            removed.append(p)
        except FileNotFoundError:
            pass
    if removed:
        print(f"[setup] removed {len(removed)} DeepSpeed /dev/shm buffer(s) no live process holds (left by a killed rank)")
    return removed


def remove_shm_buffer(rank):
    """DeepSpeed's CPU shared-memory allreduce creates /dev/shm/deepspeed_allreduce_buffer_<uid>_
    <master addr>_<master port>_<rank> (ops/csrc/cpu/comm/shm.cpp, shm_initialize) and never removes
    it: ~70 MB per rank per launch. Each rank removes its own at exit (a SIGKILLed one cannot)."""
    name = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_" \
           f"{os.environ.get('MASTER_PORT')}_{rank}"
    if os.path.exists(name):
        os.remove(name)


# ----------------------------------------------------------------------------- one job per output folder
OWNER = ".owner.json"   # in output_dir: the live job that writes there (host, pid, process start, launch time)


def _process_start(pid):
    """A process's start time in clock ticks since boot (/proc/<pid>/stat field 22): with the pid it
    names one process, not a later one that reused the pid. None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def claim_output_dir(output_dir):
    """Rank 0 at start: the output folder belongs to one live job. -> None when this job now owns it,
    else the refusal, naming the live owner (host, pid, start). A folder whose owner on this host is
    dead (SIGKILL leaves the file) is taken over and said. An owner on another host cannot be checked
    from here: its file is trusted while it is younger than OWNER_STALE_S, kept fresh by heartbeat()."""
    import socket
    path, me = os.path.join(output_dir, OWNER), socket.gethostname()
    try:
        with open(path) as f:
            owner = json.load(f)
    except (OSError, ValueError):
        owner = None
    if owner:
        here = owner.get("host") == me
        alive = _process_start(owner.get("pid", -1)) == owner.get("start") if here else \
            time.time() - os.path.getmtime(path) < OWNER_STALE_S
        if alive and owner.get("pid") != os.getpid():
            return (f"error: --output_dir {output_dir} is in use by a live job: host {owner.get('host')}, pid "
                    f"{owner.get('pid')}, started {owner.get('launched')}. Two jobs would write into one folder; stop "
                    f"that one (kill -TERM {owner.get('pid')} checkpoints and exits 75) or choose another --output_dir")
        print(f"[setup] {output_dir}: taking over from a job that is gone (host {owner.get('host')}, pid {owner.get('pid')})")
    write_atomic(path, json.dumps({"host": me, "pid": os.getpid(), "start": _process_start(os.getpid()),
                                   "launched": time.strftime("%Y-%m-%d %H:%M:%S")}))
    # write_atomic's temp files (<name>.tmp<pid>) that a kill left: no live job writes here but this one
    torn = [f for f in os.listdir(output_dir) if re.fullmatch(r".+\.tmp\d+", f) and os.path.isfile(os.path.join(output_dir, f))]
    for f in torn:
        os.remove(os.path.join(output_dir, f))
    if torn:
        print(f"[setup] {output_dir}: removed {len(torn)} half-written temp file(s) a killed job left: {', '.join(sorted(torn))}")
    return None


OWNER_STALE_S = 600


def heartbeat(output_dir, every_s=60):
    """Rank 0: keep the owner file's time fresh while this job lives (a daemon thread)."""
    import threading

    def beat():
        while True:
            time.sleep(every_s)
            try:
                os.utime(os.path.join(output_dir, OWNER))
            except OSError:
                pass
    threading.Thread(target=beat, daemon=True).start()


def release_output_dir(output_dir):
    """Rank 0 at a normal or preempted end: the folder is free for the next launch."""
    path = os.path.join(output_dir, OWNER)
    try:
        with open(path) as f:
            if json.load(f).get("pid") == os.getpid():
                os.remove(path)
    except (OSError, ValueError):
        pass


# ----------------------------------------------------------------------------- preemption
PREEMPTED = 75   # exit code of a preempted run (EX_TEMPFAIL: try again), checkpoint written
_signalled = []


def sibling_died():
    """True when a rank on this node has already exited: DeepSpeed's per-node launcher (our parent)
    then SIGTERMs the others (launch.py, sigkill_handler), which is no preemption."""
    try:
        import psutil
        local = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))
        return len(psutil.Process(os.getppid()).children()) < local
    except Exception:   # noqa: BLE001  (in a signal handler: never raise)
        return False


def install_preemption_handler(rank):
    """SIGTERM (clusters, SLURM's default) and SIGUSR1 (SLURM --signal=USR1@<seconds>) only set a
    flag; the step in progress finishes on every rank, then train.py checkpoints and exits. A SIGTERM
    that DeepSpeed's launcher sends because another rank died is said as such, and sets no flag."""
    def handler(signum, frame):   # nothing that can fail: it may run at any instant, shutdown included
        if signum == signal.SIGTERM and not _signalled and sibling_died():
            print(f"[launcher] SIGTERM on rank {rank}: another rank on this node has exited (its code is in the "
                  f"launcher's line 'exits with return code'), so DeepSpeed's launcher stops the others. Not a "
                  f"preemption: no checkpoint of this step; a relaunch resumes from the last one", flush=True)
            return
        if not _signalled:
            print(f"[preempt] {signal.Signals(signum).name} on rank {rank}: finishing this step, "
                  f"then checkpoint and exit {PREEMPTED}", flush=True)
        _signalled.append(signum)
    for s in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, handler)
    watch_launch_command(rank)


def watch_launch_command(rank, every_s=2.0):
    """The ranks do not outlive the command the user ran. Signalling (or closing the terminal of) the
    `deepspeed` command stops only that process: DeepSpeed's per-node launcher and the ranks go on,
    unsupervised, and a relaunch would write into the same folder. Each rank watches the launcher's
    parent (the command) from a daemon thread; once it is gone, the rank acts as on SIGTERM: this
    step finishes, a checkpoint, exit 75. -> the watched pid, or None (not under DeepSpeed's launcher)."""
    import threading

    import psutil
    try:
        launcher = psutil.Process(os.getppid())
        if "deepspeed.launcher.launch" not in " ".join(launcher.cmdline()):
            return None
        command = launcher.parent()
        if command is None or command.pid == 1:
            return None
        pid, created, name = command.pid, command.create_time(), " ".join(command.cmdline()[:3])
    except psutil.Error:
        return None

    def gone():
        try:
            p = psutil.Process(pid)
            return p.create_time() != created or p.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            return True

    def watch():
        while not gone():
            time.sleep(every_s)
        if not _signalled:
            print(f"[preempt] the command that launched this job (pid {pid}: {name}) is gone: rank {rank} finishes "
                  f"this step, then checkpoint and exit {PREEMPTED}", flush=True)
        _signalled.append(signal.SIGHUP)
    threading.Thread(target=watch, daemon=True).start()
    return pid


def preemption_requested(device):
    """True on every rank when any rank was signalled (a collective: call it at the same point on all)."""
    flag = torch.tensor([float(bool(_signalled))], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
