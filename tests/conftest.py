import contextlib
import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, "tools"))   # tools/bench.py and tools/gpu_check.py, imported by tests
os.environ.setdefault("OMP_NUM_THREADS", "1")


# Seconds the longest tests took under `make test` (two workers, a clean worktree of 520b36d, cold .cache): they
# start first, longest first, so that the run does not end on one of them started late beside an idle worker (in file
# order the ten kills, the longest, started at minute ~24 of 44; ordered so, the two workers ended 8 s apart).
LONGEST = {"test_ten_kills_then_resume_exactly": 478, "test_grounding_demo_learns": 434,
           "test_one_live_job_per_folder_and_ranks_do_not_outlive_the_command": 226,
           "test_preemption_checkpoints_the_step_and_exits_75": 179,
           "test_two_ranks_whose_trajectories_take_different_turns_stay_in_step": 144, "test_demo_learns": 142,
           "test_lora_resumes_exactly_after_a_kill_and_its_adapter_loads_in_peft_and_vllm": 141,
           "test_trajectories_agree_with_the_trainer_on_the_models_tokens[qwen3_5]": 130,
           "test_resume_exact_with_one_process_and_the_export_loads[qwen3_vl]": 121,
           "test_host_plan_within_15_percent_of_measured_rss[100m-2-0]": 115,
           "test_logged_numbers_do_not_depend_on_the_micro_batch": 112,
           "test_a_hang_up_checkpoints_the_step_and_exits_75": 101,
           "test_resume_exact_with_one_process_and_the_export_loads[qwen3_5]": 96, "test_two_process_run": 90,
           "test_resume_exact_with_one_process_and_the_export_loads[qwen3_vl_moe]": 90,
           "test_host_plan_within_15_percent_of_measured_rss[100m-1-0.04]": 82,
           "test_a_run_whose_tool_never_returns_is_preempted_and_ends": 150}


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: (-LONGEST.get(item.name, 0), item.get_closest_marker("launch") is None))


_status = []   # the session's exit status (pytest_sessionfinish), for pytest_unconfigure


def pytest_sessionfinish(session, exitstatus):
    _status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """The process ends here as train.py's ranks do (job.exit_now: job.at_exit's clean-up, without the interpreter's
    teardown): at exit each vLLM engine the session kept (llm_of) collected the whole heap again, ~10 s of
    test_vllm_agreement.py's 49. The report is written and the temp folders cleaned by now (pytest_sessionfinish; an
    xdist worker has sent its results). Not under coverage or cProfile, which write their data at the normal exit."""
    import job
    if _status and not job.watched():
        job.exit_now(_status[-1])


MOE_ARCHS = ["qwen3_vl_moe", "qwen3_5_moe"]   # the mixture-of-experts families (model.FAMILIES sparse_block)
ARCHS = ["qwen2_5_vl", "qwen3_vl", "qwen3_5", *MOE_ARCHS]   # tiny.ARCHS: the families, for tests parametrized over them


def tiny_of(arch="qwen2_5_vl"):
    """(model_dir, train_jsonl, val_jsonl) of the embedded colour task on the tiny model of `arch`,
    built once into .cache/tiny."""
    import tiny
    return tiny.ensure_default(os.path.join(ROOT, ".cache", "tiny"), arch=arch)


@pytest.fixture(scope="session")
def tiny_default():
    """(model_dir, train_jsonl, val_jsonl) of the embedded default, built once into .cache/tiny."""
    return tiny_of()


@pytest.fixture(scope="module")
def parts(tiny_default, world1):
    """(processor, args, 4 prepared samples, 16 prepared samples) of the colour task for the step's phase tests
    (tests/test_step.py's make_run): groups of 4, 4 prompts, one micro-batch of 8, no KL."""
    from transformers import AutoProcessor

    import data
    import train
    model_dir, train_jsonl, val_jsonl = tiny_default
    processor = AutoProcessor.from_pretrained(model_dir)
    args = train.parse_args(["--num_generations", "4", "--rollout_batch_size", "4",
                             "--per_device_train_batch_size", "8", "--beta", "0", "--report_to", "none"])
    pool = [data.prepare(r, processor, args) for r in data.read_jsonl(train_jsonl)[:16]]
    return processor, args, pool[:4], pool


def allocations(fn):
    """fn() under torch's profiler -> (its result, the bytes of torch CPU tensors allocated at each of its allocator
    events, counted from what was allocated before fn). CPU's allocator holds exactly the tensors a device's would:
    the tests of the planner's terms and of what a pass keeps read them here (peak: max, kept: the last)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    mem = sorted((e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"]) for e in events
                 if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0)
    return out, [total - (mem[0][1] - mem[0][2]) for _, total, _ in mem]


_PORTS = []   # [the open lock file that holds this process's block, the block's first port, the next to try]


def terminal_signals():
    """preexec_fn for a child that a signal test signals: SIGHUP and SIGINT as a terminal leaves them. A test run
    started under nohup hands its children both ignored (GNU timeout in between resets them), and
    job.install_preemption_handler rightly keeps an inherited ignore: a full make test of 3069859 started
    with nohup failed the two hang-up tests so (both fail under `nohup pytest ...` without this). The nohup case
    has a test of its own."""
    import signal
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def free_port():
    """A free port below the kernel's ephemeral range, from a block of 1,024 that this process alone holds.
    A port from bind(0) is ephemeral: between its release and the TCPStore's listen (seconds, while the
    ranks start) the kernel may give it to any outgoing connection, the other worker's gloo pairs included
    (the CI of 6f5c8e2 failed so: EADDRINUSE). A port below the range is only ever taken by an explicit
    bind, and no other pytest process (an xdist worker, or a second pytest run beside this one) picks from
    this block: each holds its block by a flock in the temp folder, released when its holder dies."""
    import fcntl
    import tempfile
    if not _PORTS:
        try:
            low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
        except OSError:
            low = 32768
        for block in range(8):   # 8 blocks under the range
            lock = open(os.path.join(tempfile.gettempdir(), f"vlm-grpo-test-ports-{block}.lock"), "w")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                continue
            first = max(1024, low - 8 * 1024) + block * 1024
            _PORTS[:] = [lock, first, first]
            break
        else:
            raise RuntimeError("eight live pytest processes hold the eight blocks of test ports")
    _, first, nxt = _PORTS
    for port in [first + (nxt - first + i) % 1024 for i in range(1024)]:
        _PORTS[2] = first + (port + 1 - first) % 1024
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:   # in use, or a connection on it in TIME_WAIT
                continue
    raise RuntimeError(f"no free port in {first}..{first + 1023}")


FORKED = """
import os, signal, sys, traceback
sys.path[:0] = [{root!r}, os.path.join({root!r}, "tests")]
from {module} import {name} as fn
sys.stdout.flush()
sys.stderr.flush()
pids = []
for rank in range({nprocs}):
    pid = os.fork()
    if pid == 0:
        log = os.open(os.path.join({logs!r}, f"rank{{rank}}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)   # each rank's output apart, as a process of its own would have it
        os.dup2(log, 2)
        code = 0
        try:
            fn(rank, *{args!r})
        except BaseException:
            traceback.print_exc()
            code = 1
        import job
        job.exit_now(code)   # as a rank of train.py ends: job.at_exit's clean-up (DeepSpeed's /dev/shm buffer)
    pids.append(pid)
failed = 0
while pids:   # a rank that fails takes the others down, as torch.multiprocessing.spawn does
    pid, status = os.wait()
    pids.remove(pid)
    if os.waitstatus_to_exitcode(status) != 0 and not failed:
        failed = 1
        for other in pids:
            os.kill(other, signal.SIGKILL)
sys.exit(failed)
"""


def forked_ranks(fn, *args, nprocs=2, timeout=600):
    """fn(rank, *args) on `nprocs` processes forked from one fresh Python that imported fn's module once (a rank's
    imports are most of its cost) -> (each rank's output, rank 0's after its parent's; the exit code: 0 when every
    rank returned, None when they were still running at `timeout`, killed). fn is a module-level function of tests/,
    args plain literals; fn makes its own process group."""
    import signal
    import tempfile
    with tempfile.TemporaryDirectory() as logs:
        code = FORKED.format(root=ROOT, module=fn.__module__, name=fn.__name__, nprocs=nprocs, args=args, logs=logs)
        p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, code = p.communicate(timeout=timeout)[0], p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, code = p.communicate()[0], None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)   # the forked ranks too
            p.wait()
        ranks = [open(path, errors="replace").read() if os.path.exists(path := os.path.join(logs, f"rank{r}.log"))
                 else "" for r in range(nprocs)]
    return [out + ranks[0], *ranks[1:]], code


@pytest.fixture(scope="session")
def world1():
    """torch.distributed with one gloo rank (no DeepSpeed): the step's collectives run as they do
    on rank 0 of a real run. vLLM's engine reuses this group, as it reuses DeepSpeed's in train.py."""
    import torch.distributed as dist
    if not dist.is_initialized():
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo")
    return dist


_ENGINES = {}


@pytest.fixture(scope="session")
def llm_of(world1):
    """-> llm_of(arch, path=None, flags): one vLLM engine per family (or model dir) for the whole session, created by
    rollout.create_engine exactly as train.py does on each rank (external_launcher, world of one, the
    dtype train.py picks on CPU). An engine cannot be torn down without destroying the process
    group, so each lives until pytest exits (several coexist in one process)."""
    def make(arch, path=None, flags=("--max_completion_length", "8")):
        path = path or tiny_of(arch)[0]
        if path not in _ENGINES:
            from transformers import AutoConfig

            import model
            import rollout
            import train
            args = train.parse_args([*flags, "--tiny_arch", arch])
            dtype = "bfloat16" if model.use_bf16(args, AutoConfig.from_pretrained(path), cuda=False) else "float32"
            if rollout.moe_model(path):
                expert_group()
            _ENGINES[path] = rollout.create_engine(path, args, dtype, max_num_seqs=64, rank=0)
        return _ENGINES[path]
    return make


def expert_group():
    """vLLM makes its parallel groups once per process, with the first engine, and an expert-parallel group only when
    that engine's model is a mixture of experts (vllm/distributed/parallel_state.py, initialize_model_parallel); a
    mixture-of-experts engine after a dense one in the same process then fails ("expert parallel group is not
    initialized"). train.py starts one engine per process; the tests keep several, so the group of one rank is made
    here as vLLM would have made it."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state as ps
    if ps.model_parallel_is_initialized() and ps._EP is None:
        world = ps.get_world_group()
        ps._EP = ps.init_model_parallel_group([[world.rank]], world.local_rank, dist.get_backend(world.device_group),
                                              group_name="ep")


@pytest.fixture(scope="session")
def llm(llm_of):
    """The default family's engine (llm_of)."""
    return llm_of("qwen2_5_vl")


DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")
ZERO3_SMALL = ["--ds_set", "zero_optimization.stage3_param_persistence_threshold=0"]  # partition every param
# For runs that test plumbing, not learning: 16 prompts x 4 and the reference model (the colour demo's own 32 prompts
# and beta 0 are for learning; flags.TINY_TASKS), so the KL, the reference's forward and its offload stay exercised.
FAST = ["--num_generations", "4", "--per_device_train_batch_size", "8", "--rollout_batch_size", "16", "--beta", "0.04"]


@contextlib.contextmanager
def mapped_elsewhere(path):
    """While open: another live process maps `path`, its file closed, as DeepSpeed's and vLLM's shm.cpp leave
    their /dev/shm segments (job.held_files finds it by /proc/<pid>/maps)."""
    holder = subprocess.Popen([sys.executable, "-c", "import mmap, sys, time\nf = open(sys.argv[1], 'r+b')\n"
                               "m = mmap.mmap(f.fileno(), 0)\nf.close()\nprint('mapped', flush=True)\ntime.sleep(60)",
                               str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        yield
    finally:
        holder.kill()


def command(out_dir, flags, procs, env=None, runner=False):
    """-> (argv, env) of a job on this node: DeepSpeed's per-node launcher with the arguments and environment
    the `deepspeed` runner gives it for one node (runner.py: world_info is base64 JSON of the node's ranks);
    with runner=True the user's own command, `deepspeed --num_gpus N train.py`, for the tests of that
    command (its signals, its exit code, the README's launch). The runner only starts the launcher and
    waits: 3 CPU-s of imports a launch, ~50 launches in `make test`."""
    import base64
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true", **(env or {}))
    if runner:
        head = [DEEPSPEED, "--num_gpus", str(procs), "--master_port", str(free_port())]
    else:
        world = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(procs))}).encode()).decode()
        head = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}",
                "--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    return [*head, "train.py", "--output_dir", str(out_dir), *ZERO3_SMALL, *flags], env


def node_commands(out_dir, flags, nodes=(1, 1), env=None):
    """-> [(argv, env)], one per simulated node of a job on this machine: DeepSpeed's per-node launcher with
    --node_rank n and nodes[n] local processes, one master address and port for all, as the `deepspeed` runner
    starts it on each host of a hostfile (multinode_runner.py, PDSHRunner.get_cmd). The simulated nodes share
    this machine's /dev/shm, /proc, hostname and folders (docs/resilience.md says what that cannot show)."""
    import base64
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true", **(env or {}))
    world = json.dumps({f"node{n}": list(range(k)) for n, k in enumerate(nodes)})
    head = [sys.executable, "-u", "-m", "deepspeed.launcher.launch",
            f"--world_info={base64.urlsafe_b64encode(world.encode()).decode()}", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}"]
    return [([*head, f"--node_rank={n}", "train.py", "--output_dir", str(out_dir), *ZERO3_SMALL, *flags], env)
            for n in range(len(nodes))]


def launch(out_dir, *flags, procs=2, timeout=1800, env=None, runner=False):
    """Run train.py under DeepSpeed's real launcher (command()); -> (metrics rows, log). Fails on rc != 0."""
    cmd, env = command(out_dir, flags, procs, env, runner)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    log = r.stdout + r.stderr
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "launch.log"), "a") as f:
        f.write(log)
    assert r.returncode == 0, log[-5000:]
    return read_metrics(out_dir), log


def wait_for_group(p):
    """Wait until every process of p's group (launcher and ranks) is gone: after a signal the launcher
    exits at once and the ranks finish their step and checkpoint first."""
    import time
    while True:
        p.poll()   # reap the launcher: a zombie still counts in its process group
        try:
            os.killpg(p.pid, 0)
            time.sleep(0.1)
        except ProcessLookupError:
            return


def launch_until(out_dir, *flags, done, procs=2, timeout=3600):
    """Run train.py like launch(), but SIGTERM the job (the preemption path: the ranks finish the step,
    checkpoint and exit) as soon as done(metrics rows so far) holds; -> (rows, log). A learning test
    then costs the steps this machine needs to show the learning, not a fixed budget sized for the
    slowest seed. Fails if the run ends or times out before done() holds."""
    import signal
    import time
    cmd, env = command(out_dir, flags, procs)
    os.makedirs(out_dir, exist_ok=True)
    path, deadline, met = os.path.join(out_dir, "launch.log"), time.time() + timeout, False
    with open(path, "a") as log:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        while p.poll() is None and time.time() < deadline:
            time.sleep(2)
            try:
                met = done(read_metrics(out_dir))
            except (OSError, ValueError):   # no metrics yet, or a line being written
                continue
            if met:
                break
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM if met else signal.SIGKILL)
        wait_for_group(p)
    text = open(path).read()
    rows = read_metrics(out_dir)
    assert met or done(rows), text[-5000:]
    return rows, text


def read_metrics(out_dir):
    """metrics.jsonl's rows; a last line still being appended (no newline yet) is not one."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def wandb_records(path):
    """The protobuf records of an offline run's .wandb file (wandb 0.31 writes it from its Go core:
    LevelDB's log format, 32 KiB blocks of 7-byte-headed chunks, after a 7-byte W&B header)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb
    raw, pos, block, buf = open(path, "rb").read(), 7, 32768, b""
    while pos + 7 <= len(raw):
        room = block - pos % block
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7]) if room >= 7 else (0, 0, 0)
        if room < 7 or (length == 0 and kind == 0):   # block trailer or padding
            pos += room
            continue
        data, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        buf = data if kind in (1, 2) else buf + data   # FULL / FIRST start a record, MIDDLE / LAST continue it
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def wandb_history(out_dir):
    """{run id: {step: set of keys}} over every offline run directory of a run's wandb/ folder."""
    import glob
    runs = {}
    for path in glob.glob(os.path.join(out_dir, "wandb", "offline-run-*", "run-*.wandb")):
        run_id = os.path.basename(path)[4:-6]
        steps = runs.setdefault(run_id, {})
        for r in wandb_records(path):
            if r.WhichOneof("record_type") == "history":
                steps.setdefault(r.history.step.num, set()).update(
                    i.key or "/".join(i.nested_key) for i in r.history.item)
    return runs
