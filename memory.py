"""Memory: measure per phase, free, and say what to change when it runs out.

`measure()` reads GPU allocated/reserved/peak (where CUDA exists) and this process's host RSS
plus the node's available memory (always). train.py wraps every phase of a step in
`phase(name, log)`, which records `mem/<name>/...` and the phase time into the step's metrics.
`free()` is gc.collect() + empty_cache(), run after every offload and after vLLM sleeps.
Before loading anything, `estimate_host_memory()` + `preflight()` refuse a run whose ZeRO CPU
offload and vLLM sleep copies would not fit in the node's host RAM. When memory does run out,
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

GB = 1024 ** 3


def measure():
    """-> {gpu_device_gb, gpu_alloc_gb, gpu_reserved_gb, gpu_peak_gb (CUDA only), host_rss_gb, host_avail_gb}.

    gpu_device_gb is what the device holds (total - free, cudaMemGetInfo): vLLM allocates its
    weights and KV cache in its own CUDA memory pool and sleep unmaps that memory behind torch's
    back, so torch's allocated/reserved counters neither show all of it nor drop when it sleeps."""
    m = {"host_rss_gb": psutil.Process().memory_info().rss / GB,
         "host_avail_gb": psutil.virtual_memory().available / GB}
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        m.update(gpu_device_gb=(total - free) / GB, gpu_alloc_gb=torch.cuda.memory_allocated() / GB,
                 gpu_reserved_gb=torch.cuda.memory_reserved() / GB,
                 gpu_peak_gb=torch.cuda.max_memory_allocated() / GB)
    return m


def used_bytes():
    """What this process holds: the device's used memory with CUDA (vLLM's pool included), else RSS."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return total - free
    return psutil.Process().memory_info().rss


def collect():
    """gc.collect(); -> bytes given back (device-level with CUDA, else RSS)."""
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
    """gc.collect() and empty the CUDA cache, after an offload; -> bytes given back (device-level
    with CUDA, else RSS). Not while vLLM sleeps: see rollout.sleep."""
    return collect() + empty_cache()


@contextlib.contextmanager
def phase(name, log):
    """Time a phase of the step and record its memory at exit into `log` (the step's metrics)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
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
        log[f"time/{name}"] = log.get(f"time/{name}", 0.0) + time.perf_counter() - t0
        for k, v in measure().items():
            key = f"mem/{name}/{k}"
            log[key] = v if key not in log else (min if k.endswith("avail_gb") else max)(log[key], v)


def summary(log):
    """One compact line of the step's memory: the max over phases of each quantity."""
    keys = ("gpu_device_gb", "gpu_peak_gb", "host_rss_gb", "host_avail_gb")
    parts = []
    for k in keys:
        vals = [v for name, v in log.items() if name.startswith("mem/") and name.endswith("/" + k)]
        if vals:
            parts.append(f"{k[:-3]}={(min if k == 'host_avail_gb' else max)(vals):.2f}G")
    return " ".join(parts)


# Host RAM per rank that no flag of ours controls: the Python interpreter and imported modules,
# the CUDA context and its host-side buffers, NCCL, vLLM's and DeepSpeed's own bookkeeping.
# A rough guess on the cautious side, not a measurement; it is why ranks per node matter.
RANK_OVERHEAD_BYTES = 3 * GB

# What to change for each component of the estimate, cheapest fix first where sizes tie.
HOST_FIX = {
    "vllm_sleep_copy": "--sleep_level 2 (drops vLLM's host copy of the weights)",
    "zero_optimizer": "more nodes (ZeRO partitions across them) or turn off offload_optimizer in ds_zero3.json",
    "zero_params": "more nodes (ZeRO partitions across them) or turn off offload_param in ds_zero3.json",
    "ref_model": "--ref_offload off or --beta 0",
    "vllm_weights": "fewer ranks per node (vLLM on CPU keeps every rank's weights in host RAM)",
    "rank_overhead": "fewer ranks per node",
}


def estimate_host_memory(n_params, ranks_per_node, world_size, dtype_bytes, offload_param, offload_optimizer,
                         sleep_level, beta, ref_offload, cuda):
    """Host RAM one node needs, in bytes, by component (only those that apply) plus 'total'.

    Why: a 7B VLM run on 8xH100 used 242 of 251 GB of host RAM, because every rank keeps its
    own ZeRO-3 CPU-offload partitions *and* its own vLLM level-1 sleep copy of the full weights.
    ZeRO's parts shrink with world_size; vLLM's copy does not (one per rank, TP=1 assumed).
    """
    share = ranks_per_node / world_size  # this node's share of anything ZeRO partitions
    est = {}
    if offload_param:  # 16-bit param partitions
        est["zero_params"] = n_params * dtype_bytes * share
    if offload_optimizer:  # CPU Adam: fp32 master + exp_avg + exp_avg_sq + fp32 grads = 16 B/param
        est["zero_optimizer"] = 16 * n_params * share
    if not cuda:  # vLLM on CPU: the weights live in host RAM whatever the sleep level
        est["vllm_weights"] = n_params * dtype_bytes * ranks_per_node
    elif sleep_level == 1:  # level 1 moves the whole (unpartitioned) weights to host RAM, per rank
        est["vllm_sleep_copy"] = n_params * dtype_bytes * ranks_per_node
    if beta > 0 and ref_offload:
        est["ref_model"] = n_params * dtype_bytes * share
    est["rank_overhead"] = RANK_OVERHEAD_BYTES * ranks_per_node
    est = {k: int(v) for k, v in est.items()}
    est["total"] = sum(est.values())
    return est


def preflight(estimate, available_bytes, allow=False):
    """-> a table of `estimate` against `available_bytes` (GB). Over 90% of it, SystemExit naming
    the flags to change, largest component first, unless `allow` (--skip_memory_preflight).
    The 7B run at 242 of 251 GB (see estimate_host_memory) would have stopped here, before loading."""
    # 10% headroom: page cache, pinned-memory rounding, data workers and images are not modelled.
    limit = 0.9 * available_bytes
    rows = [f"  {k:<16}{v / GB:8.1f}" for k, v in estimate.items() if k != "total"]
    rows += [f"  {'total':<16}{estimate['total'] / GB:8.1f}",
             f"  {'available':<16}{available_bytes / GB:8.1f}  (limit 90%: {limit / GB:.1f})"]
    report = "[memory] host RAM estimate per node (GB):\n" + "\n".join(rows)
    if estimate["total"] <= limit:
        return report
    if allow:
        return report + "\n[memory] over the limit; going on because of --skip_memory_preflight"
    order = list(HOST_FIX)
    ranked = sorted((k for k in estimate if k in HOST_FIX and estimate[k] > 0),
                    key=lambda k: (-estimate[k], order.index(k)))
    fixes = [f"  {i}. {HOST_FIX[k]}  [{k}: {estimate[k] / GB:.1f} GB]" for i, k in enumerate(ranked, 1)]
    raise SystemExit(report + f"\n[memory] refusing to start: {estimate['total'] / GB:.1f} GB needed > "
                     f"{limit / GB:.1f} GB (90% of available). Change, largest first:\n" + "\n".join(fixes)
                     + "\n  or pass --skip_memory_preflight if you know the estimate is wrong.")


# Lower-cased message fragments of torch's CPU allocator and of ENOMEM: host RAM, not the GPU.
_HOST_OOM = ("defaultcpuallocator", "can't allocate memory", "cannot allocate memory")
# torch >= 2.5 has torch.OutOfMemoryError, and torch.cuda.OutOfMemoryError is the same class.
_OOM_TYPES = (MemoryError, torch.cuda.OutOfMemoryError, getattr(torch, "OutOfMemoryError", MemoryError))


def is_oom(exc):
    """True for GPU or host out-of-memory errors, whichever way torch or Python reports them."""
    if isinstance(exc, _OOM_TYPES) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM):
        return True  # OSError ENOMEM: fork/mmap of a data or vLLM worker failed
    msg = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in msg or any(s in msg for s in _HOST_OOM))


def is_host_oom(exc):
    """True when host RAM, not the GPU, ran out (MemoryError, ENOMEM, or torch's CPU allocator)."""
    return (isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM)
            or any(s in str(exc).lower() for s in _HOST_OOM))


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
    "data": ["lower --max_pixels (images are decoded and resized here)", "lower --limit_images"],
    "checkpoint": ["free disk space under --output_dir and host RAM (the 16-bit model is gathered to save it)"],
}
_GENERAL = ["smaller --per_device_train_batch_size", "lower --vllm_gpu_memory_utilization",
            "lower --max_pixels", "shorter --max_completion_length",
            "see the table above for which phase grew"]
_HOST = ["--sleep_level 2 (level 1 keeps a host copy of the weights per rank)",
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
    else:     # what the device holds beyond torch's own cache: vLLM's pool (weights, KV cache), contexts
        row = {k.rsplit("/", 1)[1]: v for k, v in last_table.items() if k.startswith(f"mem/{phase}/")}
        outside = row.get("gpu_device_gb", 0) - row.get("gpu_reserved_gb", 0)
        if outside > 1:
            fixes = [f"{outside:.1f} GB of the device is held outside torch's allocator (vLLM's weights and KV "
                     f"cache, CUDA contexts): lower --vllm_gpu_memory_utilization, or --sleep_level 1/2 so "
                     f"vLLM frees it outside rollouts"] + fixes
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return "\n".join([f"[oom] {'host RAM' if host else 'GPU'} ran out in phase '{phase}'",
                      f"  {type(exc).__name__}: {first}", "last memory per phase (GB):", render_table(last_table),
                      "try, in order:"] + [f"  {i}. {f}" for i, f in enumerate(fixes, 1)])


def report_oom(exc, phase=None, table=None):
    """Print diagnose() to stderr and return 3, the exit code. `phase` defaults to the one `phase()`
    tagged the exception with; `table` is the step's metrics so far (phases done, and the failed one)."""
    phase = phase or getattr(exc, "memory_phase", "unknown")
    print(diagnose(exc, phase, table or {}), file=sys.stderr, flush=True)
    return 3
