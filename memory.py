"""Memory: measure per phase, free, and say what to change when it runs out.

`measure()` reads GPU allocated/reserved/peak (where CUDA exists) and this process's host RSS
plus the node's available memory (always). train.py wraps every phase of a step in
`phase(name, log)`, which records `mem/<name>/...` and the phase time into the step's metrics.
`free()` is gc.collect() + empty_cache(), run after every offload and after vLLM sleeps.
Left out on purpose: allocator tuning (set PYTORCH_CUDA_ALLOC_CONF yourself), per-tensor tracing.
"""
import contextlib
import gc
import time

import psutil
import torch

GB = 1024 ** 3


def measure():
    """-> {gpu_alloc_gb, gpu_reserved_gb, gpu_peak_gb (CUDA only), host_rss_gb, host_avail_gb}."""
    m = {"host_rss_gb": psutil.Process().memory_info().rss / GB,
         "host_avail_gb": psutil.virtual_memory().available / GB}
    if torch.cuda.is_available():
        m.update(gpu_alloc_gb=torch.cuda.memory_allocated() / GB,
                 gpu_reserved_gb=torch.cuda.memory_reserved() / GB,
                 gpu_peak_gb=torch.cuda.max_memory_allocated() / GB)
    return m


def free():
    """gc.collect() and empty the CUDA cache; returns bytes given back (reserved GPU, else RSS)."""
    before = torch.cuda.memory_reserved() if torch.cuda.is_available() else psutil.Process().memory_info().rss
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        return before - torch.cuda.memory_reserved()
    return before - psutil.Process().memory_info().rss


@contextlib.contextmanager
def phase(name, log):
    """Time a phase of the step and record its memory at exit into `log` (the step's metrics)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    yield
    log[f"time/{name}"] = time.perf_counter() - t0
    for k, v in measure().items():
        log[f"mem/{name}/{k}"] = v


def summary(log):
    """One compact line of the step's memory: the max over phases of each quantity."""
    keys = ("gpu_peak_gb", "gpu_reserved_gb", "host_rss_gb", "host_avail_gb")
    parts = []
    for k in keys:
        vals = [v for name, v in log.items() if name.startswith("mem/") and name.endswith("/" + k)]
        if vals:
            parts.append(f"{k[:-3]}={(min if k == 'host_avail_gb' else max)(vals):.2f}G")
    return " ".join(parts)
