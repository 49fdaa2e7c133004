"""Memory: measure per phase, free, and say what to change when it runs out.

`measure()` reads GPU allocated/reserved/peak (where CUDA exists) and this process's host RSS
plus the node's available memory (always). train.py wraps every phase of a step in
`phase(name, log)`, which records `mem/<name>/...` and the phase time into the step's metrics.
`free()` is gc.collect() + empty_cache(), run after every offload and after vLLM sleeps.
Before loading anything, train.py asks the planner (planner.py; `python memory.py plan ...` prints
it) whether the run fits, and refuses one that would not. When memory does run out anyway,
`is_oom()` + `report_oom()` print the phase, the memory table so far and what to change.
Left out on purpose: allocator tuning (set PYTORCH_CUDA_ALLOC_CONF yourself), per-tensor tracing.
"""
import contextlib
import errno
import gc
import sys
import time

import psutil
import torch

import planner
import ranks

GB = 1024 ** 3


def measure():
    """-> {host_rss_gb, host_avail_gb, host_peak_gb, host_anon_gb, and with CUDA: gpu_device_gb,
    gpu_alloc_gb, gpu_reserved_gb, gpu_peak_gb, gpu_vllm_gb, host_pinned_gb} (gpu_figures)."""
    m = {"host_rss_gb": psutil.Process().memory_info().rss / GB,
         "host_avail_gb": psutil.virtual_memory().available / GB}
    m.update({f"host_{k}_gb": v / GB for k, v in proc_status().items()})
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        cumem = sys.modules.get("vllm.device_allocator.cumem")   # imported by vLLM when it can sleep
        vllm = getattr(getattr(cumem, "CuMemAllocator", None), "instance", None)
        m.update(gpu_figures(total - free, torch.cuda.memory_allocated(), torch.cuda.memory_reserved(),
                             torch.cuda.max_memory_allocated(), vllm.pointer_to_data if vllm else {},
                             torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)))
    return m


def gpu_figures(device, allocated, reserved, peak, vllm_allocations, pinned):
    """Bytes -> the GPU readings in GB: the device's used memory, torch's allocated, reserved and peak less vLLM's
    allocations (its pointer_to_data), what vLLM maps now, and torch's pinned host blocks. torch's counters include
    vLLM's pool, asleep or awake, because vLLM allocates through a torch MemPool."""
    held = sum(a.handle[1] for a in vllm_allocations.values())
    mapped = sum(a.handle[1] for a in vllm_allocations.values() if not a.is_asleep)
    return {"gpu_device_gb": device / GB, "gpu_alloc_gb": (allocated - held) / GB,
            "gpu_reserved_gb": (reserved - held) / GB, "gpu_peak_gb": (peak - held) / GB, "gpu_vllm_gb": mapped / GB,
            "host_pinned_gb": pinned / GB}


_peak_resets = [True]   # False once a reset was refused: VmHWM is then the process's lifetime peak, not a phase's


def proc_status():
    """Linux: this process's {"peak": VmHWM since reset_peak, "anon": RssAnon} in bytes, "peak" left out where
    reset_peak was refused; {} elsewhere."""
    try:
        with open("/proc/self/status") as f:
            st = dict(line.split(":", 1) for line in f if line.startswith(("VmHWM", "RssAnon")))
    except OSError:
        return {}
    kb = {k: int(v.split()[0]) * 1024 for k, v in st.items()}
    return {**({"peak": kb.get("VmHWM", 0)} if _peak_resets[0] else {}), "anon": kb.get("RssAnon", 0)}


def reset_peak():
    """Start a new peak-RSS window (Linux: writing 5 to /proc/self/clear_refs resets VmHWM)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:   # a kernel before 4.0 (clear_refs took "5" from then on), or a sandbox that refuses it
        _peak_resets[0] = False


def used_bytes():
    """-> the device's used bytes with CUDA (vLLM's pool included), else this process's RSS."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return total - free
    return psutil.Process().memory_info().rss


def collect():
    """gc.collect() -> bytes given back (used_bytes)."""
    before = used_bytes()
    gc.collect()
    return before - used_bytes()


def empty_cache():
    """torch.cuda.empty_cache(); -> bytes given back (device-level). Nothing to empty on CPU."""
    if not torch.cuda.is_available():
        return 0
    before = used_bytes()
    torch.cuda.empty_cache()
    return before - used_bytes()


def free():
    """gc.collect() and empty the CUDA cache -> the bytes given back. Not while vLLM sleeps (rollout.sleep)."""
    return collect() + empty_cache()


_open = []   # the peak RSS (bytes) seen so far by each phase open now, innermost last


@contextlib.contextmanager
def phase(name, log):
    """Time a phase of the step and record its memory at exit into `log` (the step's metrics)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    if _open:   # a phase inside another: fold the outer one's peak so far before the window resets
        _open[-1] = max(_open[-1], proc_status().get("peak", 0))
    _open.append(0)
    reset_peak()
    t0 = time.perf_counter()
    try:
        yield
    except BaseException as e:
        # Tag the innermost phase so report_oom() can say where memory ran out without being told.
        if not hasattr(e, "memory_phase"):
            e.memory_phase = name
        raise
    finally:
        # Recorded on failure too: after an OOM, the failed phase's row is the one diagnose() needs.
        # A phase entered again in the same step (dynamic sampling's extra rollouts) adds its time
        # and keeps the worst memory reading: the most used, the least available.
        log[f"time/{name}"] = ranks.Max(log.get(f"time/{name}", 0.0) + time.perf_counter() - t0)   # the slowest rank
        now = measure()   # host_peak_gb: the phase's peak RSS, phases inside it included
        peak = max(_open.pop(), int(now.get("host_peak_gb", 0) * GB))
        if "host_peak_gb" in now:
            now["host_peak_gb"] = peak / GB
        if _open:
            _open[-1] = max(_open[-1], peak)
        for k, v in now.items():
            key = f"mem/{name}/{k}"
            worst = ranks.Min if k.endswith("avail_gb") else ranks.Max   # over re-entries and over ranks: the fullest
            log[key] = worst(v if key not in log else (min if worst is ranks.Min else max)(log[key], v))


def summary(log):
    """One compact line of the step's memory: the max over phases of each quantity."""
    keys = ("gpu_device_gb", "gpu_peak_gb", "host_rss_gb", "host_avail_gb")
    parts = []
    for k in keys:
        vals = [v for name, v in log.items() if name.startswith("mem/") and name.endswith("/" + k)]
        if vals:
            parts.append(f"{k[:-3]}={(min if k == 'host_avail_gb' else max)(vals):.2f}G")
    return " ".join(parts)


# Lower-cased message fragments of torch's CPU allocator and of ENOMEM: host RAM, not the GPU.
_HOST_OOM = ("defaultcpuallocator", "can't allocate memory", "cannot allocate memory")
# torch >= 2.5 has torch.OutOfMemoryError, and torch.cuda.OutOfMemoryError is the same class.
_OOM_TYPES = (MemoryError, torch.cuda.OutOfMemoryError, getattr(torch, "OutOfMemoryError", MemoryError))


def is_oom(exc):
    """True for any out-of-memory error, GPU or host."""
    if isinstance(exc, _OOM_TYPES) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM):
        return True  # OSError ENOMEM: fork/mmap of a data or vLLM worker failed
    msg = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in msg or any(s in msg for s in _HOST_OOM))


def is_host_oom(exc):
    """True when host RAM ran out, not the GPU, a failed pinned allocation included."""
    return (isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM)
            or any(s in str(exc).lower() for s in _HOST_OOM) or is_pinned_oom(exc))


def is_pinned_oom(exc):
    """True when a pinned host allocation failed, whose CUDA error says "out of memory" though host RAM ran out;
    told by the raising frame: a statement with pin_memory, or vLLM's CuMemAllocator.sleep."""
    import linecache
    tb = exc.__traceback__
    while tb is not None:
        code, line = tb.tb_frame.f_code, tb.tb_lineno
        statement = "".join(linecache.getline(code.co_filename, n) for n in range(line, line + 6))
        if "pin_memory" in statement or (code.co_name == "sleep" and code.co_filename.endswith("cumem.py")):
            return "out of memory" in str(exc).lower()
        tb = tb.tb_next
    return False


_GEN = ["lower --vllm_gpu_memory_utilization (vLLM's weights + KV cache share the GPU with training)",
        "fewer --num_generations", "lower --max_pixels (fewer image tokens)", "lower --limit_images",
        "--sleep_level 1 or 2 (vLLM releases its GPU memory outside rollouts)"]
_TRAIN = ["smaller --per_device_train_batch_size (the micro-batch)",
          "--gradient_checkpointing (the default; recompute activations instead of keeping them)",
          "offload_optimizer / offload_param to cpu in ds_zero3.json",
          "smaller --logprob_chunk_tokens (float32 logits are built this many tokens at a time)",
          "shorter --max_completion_length"]
PHASE_FIX = {
    "rollout": _GEN, "validation": _GEN, "sync": _GEN + ["smaller --sync_bucket_mb (gathered params per bucket)"],
    "update": _TRAIN, "old_ref_logps": _TRAIN,
    "teacher_logps": _TRAIN + ["--ref_offload (the teacher's and the reward model's shards in host RAM)"],
    "data": ["lower --max_pixels (images are decoded and resized here)", "lower --limit_images"],
    "checkpoint": ["free disk space under --output_dir and host RAM (the 16-bit model is gathered to save it)"],
    "sleep": ["--sleep_level 2 (vLLM drops its weights instead of pinning a host copy; each sync then sends them all)"],
}
_GENERAL = ["smaller --per_device_train_batch_size", "lower --vllm_gpu_memory_utilization",
            "lower --max_pixels", "shorter --max_completion_length",
            "see the table above for which phase grew"]
_HOST = ["--sleep_level 2 (level 1 keeps a pinned host copy of the weights per rank, in power-of-two blocks)",
         "fewer ranks per node (each holds its own offload partitions, vLLM copy and ~3 GB runtime)"]


def render_table(log):
    """Render the `mem/<phase>/<quantity>` entries of `log` as a phase x quantity table (GB)."""
    cells = {}
    for key, v in log.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "mem":
            cells.setdefault(parts[1], {})[parts[2].removesuffix("_gb")] = v
    if not cells:
        return "  (no memory measured yet)"
    cols = list(dict.fromkeys(q for row in cells.values() for q in row))
    lines = [f"  {'phase':<14}" + "".join(f"{q:>13}" for q in cols)]
    for ph, row in cells.items():
        lines.append(f"  {ph:<14}" + "".join(f"{row[q]:13.2f}" if q in row else f"{'-':>13}" for q in cols))
    return "\n".join(lines)


def diagnose(exc, phase, last_table):
    """-> what ran out, where, the memory per phase so far, and what to change, most likely fix first."""
    host = is_host_oom(exc)
    fixes = PHASE_FIX.get(phase, _GENERAL)
    if host:  # host advice first; offloading to (or sleeping into) host RAM would only make it worse
        fixes = _HOST + [f for f in fixes if "offload" not in f and "--sleep_level" not in f]
        if is_pinned_oom(exc):
            fixes = ["pinned host memory ran out, not the GPU (the CUDA error says 'out of memory' for both)"] + fixes
    else:     # what the device holds beyond the trainer's own cache: vLLM's pool (weights, KV cache), contexts
        row = {k.rsplit("/", 1)[1]: v for k, v in last_table.items() if k.startswith(f"mem/{phase}/")}
        vllm = row.get("gpu_vllm_gb", 0)
        outside = row.get("gpu_device_gb", 0) - row.get("gpu_reserved_gb", 0) - vllm
        if outside > 1:
            fixes = [f"{outside:.1f} GB of the device is held outside torch and vLLM (CUDA contexts, NCCL buffers, "
                     f"cuBLAS workspaces: about 1-3 GB per process; more ranks or TP groups per GPU add to it)"] + fixes
        if vllm > 1:
            rollout = phase in ("rollout", "validation")
            sleep = "" if rollout else ", or --sleep_level 1/2 so vLLM frees it outside rollouts"
            fixes = [f"vLLM holds {vllm:.1f} GB of the device in this phase (weights and KV cache): lower "
                     f"--vllm_gpu_memory_utilization{sleep}"] + fixes
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return "\n".join([f"[oom] {'host RAM' if host else 'GPU'} ran out in phase '{phase}'",
                      f"  {type(exc).__name__}: {first}", "last memory per phase (GB):", render_table(last_table),
                      "try, in order:"] + [f"  {i}. {f}" for i, f in enumerate(fixes, 1)])


@contextlib.contextmanager
def oom_report(table):
    """Around the training loop: an out-of-memory error exits with report_oom's diagnosis (exit code 3) instead of
    a traceback. `table()` gives the step's metrics so far."""
    try:
        yield
    except BaseException as e:
        if is_oom(e):
            sys.exit(report_oom(e, table=table()))
        raise


def report_oom(exc, phase=None, table=None):
    """Print diagnose() to stderr -> 3, the exit code. `phase` defaults to the one phase() tagged; `table` is the
    step's metrics so far."""
    phase = phase or getattr(exc, "memory_phase", "unknown")
    print(diagnose(exc, phase, table or {}), file=sys.stderr, flush=True)
    return 3


def main(argv):
    """`python memory.py plan [train.py's flags] --gpus_per_node 8 --gpu_gb 80 --host_gb 1024` -> the plan's exit
    code (planner.main)."""
    if argv[:1] != ["plan"]:
        sys.exit("usage: python memory.py plan [train.py's flags] --gpus_per_node N --gpu_gb G --host_gb H "
                 "[--nodes K] [--cpu]")
    return planner.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
