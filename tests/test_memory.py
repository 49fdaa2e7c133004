"""memory.py: OOM detection and diagnosis, and the per-phase measurements (the plan: test_planner.py)."""
import errno
import json
import mmap
import types

import pytest
import torch

import memory

GB = 1024 ** 3


def test_is_oom():
    assert memory.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert memory.is_oom(torch.cuda.OutOfMemoryError("x"))
    assert memory.is_oom(MemoryError())
    assert memory.is_oom(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 79.1 GiB total)"))
    assert memory.is_oom(RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes"))
    assert memory.is_oom(OSError(errno.ENOMEM, "Cannot allocate memory"))
    assert not memory.is_oom(RuntimeError("shape mismatch"))
    assert not memory.is_oom(ValueError("out of memory"))  # only RuntimeErrors are read by message
    assert not memory.is_oom(KeyboardInterrupt())


def test_real_cpu_allocator_failure_is_host_oom():
    # 256 TiB exceeds any address space, so the allocation fails at once without touching RAM.
    with pytest.raises(RuntimeError) as info:
        torch.empty(2 ** 48, dtype=torch.uint8)
    assert memory.is_oom(info.value) and memory.is_host_oom(info.value)
    text = memory.diagnose(info.value, "update", {})
    assert "host RAM" in text and "no memory measured yet" in text
    advice = text.split("try, in order:")[1]
    assert advice.index("--sleep_level 2") < advice.index("fewer ranks per node") < advice.index("per_device")
    assert "offload" not in advice.replace("offload partitions", "")  # never advise offloading into host RAM


TABLE = {"mem/rollout/host_rss_gb": 1.25, "mem/rollout/gpu_peak_gb": 61.5, "mem/update/gpu_peak_gb": 3.4,
         "time/rollout": 2.0, "reward/mean": 0.5}


def test_diagnose_rollout():
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB\nmore detail")
    text = memory.diagnose(exc, "rollout", TABLE)
    assert "'rollout'" in text and "OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB" in text
    assert "more detail" not in text
    assert "1.25" in text and "61.50" in text and "3.40" in text and "reward" not in text.split("try")[0]
    advice = text.split("try, in order:")[1].strip().splitlines()
    assert "--vllm_gpu_memory_utilization" in advice[0]
    assert "--num_generations" in advice[1]


def test_diagnose_update_and_unknown():
    exc = RuntimeError("CUDA out of memory. Tried to allocate 512.00 MiB")
    advice = memory.diagnose(exc, "update", TABLE).split("try, in order:")[1].strip().splitlines()
    assert "--per_device_train_batch_size" in advice[0] and "--gradient_checkpointing" in advice[1]
    assert "per_device_train_batch_size" in memory.diagnose(exc, "somewhere_else", {})


def test_render_table_is_phase_by_quantity():
    lines = memory.render_table(TABLE).splitlines()
    assert lines[0].split() == ["phase", "host_rss", "gpu_peak"]
    assert lines[1].split() == ["rollout", "1.25", "61.50"]
    assert lines[2].split() == ["update", "-", "3.40"]


def test_report_oom_uses_phase_tag(capsys):
    log = {}
    with pytest.raises(MemoryError) as info:
        with memory.phase("data", log):
            raise MemoryError("boom")
    assert info.value.memory_phase == "data" and "mem/data/host_rss_gb" in log  # recorded on failure too
    assert memory.report_oom(info.value, table=log) == 3
    err = capsys.readouterr().err
    assert "'data'" in err and "--max_pixels" in err and "--sleep_level 2" in err


def test_measure_free_phase():
    m = memory.measure()
    assert m["host_rss_gb"] > 0 and m["host_avail_gb"] > 0
    assert isinstance(memory.free(), int)
    log = {}
    with memory.phase("rollout", log):
        sum(range(1000))
    assert log["time/rollout"] >= 0 and log["mem/rollout/host_rss_gb"] > 0
    assert "host_rss=" in memory.summary(log)


def test_phase_entered_twice_adds_its_time_and_keeps_the_worst_memory():
    log = {"time/rollout": 2.0, "mem/rollout/host_rss_gb": 1e6, "mem/rollout/host_avail_gb": -1.0}
    with memory.phase("rollout", log):
        pass
    assert log["time/rollout"] >= 2.0                      # added, not overwritten
    assert log["mem/rollout/host_rss_gb"] == 1e6           # the most used is kept
    assert log["mem/rollout/host_avail_gb"] == -1.0        # the least available is kept


def vllm_pool(awake_gb, asleep_gb):
    """vLLM's CuMemAllocator allocations as cumem.py records them: vLLM's own AllocationData, handle
    (device, aligned size, device pointer, CUmemGenericAllocationHandle); the pointers are stand-ins."""
    from vllm.device_allocator import AllocationData
    pool = {1 << 40: AllocationData(handle=(0, awake_gb * GB, 1 << 40, 0), tag="weights")}
    if asleep_gb:
        pool[2 << 40] = AllocationData(handle=(0, asleep_gb * GB, 2 << 40, 0), tag="kv_cache", is_asleep=True)
    return pool


def test_device_memory_apart_from_vllms_pool_and_in_the_advice(monkeypatch):
    """vLLM allocates through a torch MemPool: torch's counters include vLLM's weights and KV cache, asleep
    or not. The trainer's figures leave vLLM's allocations out, vLLM's mapped bytes are their own column,
    and the advice tells vLLM's share from what neither holds (CUDA contexts, NCCL). No CUDA here: torch's
    counters are stand-ins, vLLM's allocation records its own class (before: alloc 35, reserved 40, and
    the "held outside torch" hint could never fire while vLLM was awake)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (10 * GB, 80 * GB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 35 * GB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 40 * GB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 45 * GB)
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: {"allocated_bytes.current": 32 * GB})
    from vllm.device_allocator.cumem import CuMemAllocator
    monkeypatch.setattr(CuMemAllocator, "instance", types.SimpleNamespace(pointer_to_data=vllm_pool(12, 3)))
    m = memory.measure()
    assert (m["gpu_device_gb"], m["gpu_alloc_gb"], m["gpu_reserved_gb"], m["gpu_peak_gb"]) == (70, 20, 25, 30)
    assert (m["gpu_vllm_gb"], m["host_pinned_gb"]) == (12, 32)
    assert memory.used_bytes() == 70 * GB
    table = {f"mem/update/{k}": v for k, v in m.items()}
    advice = memory.diagnose(torch.OutOfMemoryError("CUDA out of memory"), "update", table).split("try, in order:")[1]
    lines = advice.strip().splitlines()
    assert "vLLM holds 12.0 GB" in lines[0] and "--sleep_level 1/2" in lines[0]
    assert "33.0 GB of the device is held outside torch and vLLM" in lines[1]
    assert "gpu_device=70.00G" in memory.summary(table)


def test_a_failed_pinned_allocation_gets_host_advice():
    """cudaHostAlloc failing reads "CUDA error: out of memory", yet host RAM ran out: level-1 sleep pins a
    copy of vLLM's weights (cumem.py's sleep), DeepSpeed its offload buffers. The error is a stand-in (no
    CUDA here), raised from a statement that asks for pinned memory, as those do; the advice is the host's,
    without --sleep_level 1 or offloading, and the phase train.sleep now runs in is named."""
    def backup(size):
        raise RuntimeError("CUDA error: out of memory")   # torch.empty(size, dtype=torch.uint8, pin_memory=True)
    with pytest.raises(RuntimeError) as info:
        backup(1 << 30)
    assert memory.is_oom(info.value) and memory.is_pinned_oom(info.value) and memory.is_host_oom(info.value)
    text = memory.diagnose(info.value, "sleep", {})
    advice = text.split("try, in order:")[1]
    assert "host RAM ran out in phase 'sleep'" in text and "pinned host memory ran out" in advice
    assert "--sleep_level 2" in advice and "--sleep_level 1" not in advice
    assert "offload" not in advice.replace("offload partitions", "")
    gpu = memory.diagnose(RuntimeError("CUDA error: out of memory"), "sleep", {})   # raised elsewhere: the GPU
    assert "GPU ran out" in gpu and not memory.is_pinned_oom(RuntimeError("CUDA error: out of memory"))


def test_phase_peak_rss_sees_transients_and_nested_phases():
    log = {}
    with memory.phase("outer", log):
        # 200 MB mapped fresh, every page touched, then unmapped. Not a bytearray: malloc serves that from
        # free pages already in the heap when a long-lived worker has them, and RSS would not move.
        big = mmap.mmap(-1, 200 * 2 ** 20)
        big[::mmap.PAGESIZE] = b"\1" * (len(big) // mmap.PAGESIZE)
        big.close()
        with memory.phase("inner", log):
            pass
    if "mem/outer/host_peak_gb" not in log:
        pytest.skip("no /proc/self/status here")
    assert log["mem/outer/host_peak_gb"] - log["mem/inner/host_peak_gb"] > 0.15   # the freed 200 MB still counts
    assert log["mem/outer/host_peak_gb"] >= log["mem/outer/host_rss_gb"]


def test_a_refused_peak_reset_logs_no_phase_peak(monkeypatch):
    """Where /proc/self/clear_refs refuses the write, VmHWM is the process's lifetime peak: a phase logs no
    host_peak_gb rather than that under its name, and its other readings as before."""
    if not memory.proc_status():
        pytest.skip("no /proc/self/status here")

    def refusing(path, *a, **k):
        if path == "/proc/self/clear_refs":
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return open(path, *a, **k)
    monkeypatch.setattr(memory, "open", refusing, raising=False)
    monkeypatch.setattr(memory, "_peak_resets", [True])
    log = {}
    with memory.phase("rollout", log):
        pass
    assert "mem/rollout/host_peak_gb" not in log and log["mem/rollout/host_anon_gb"] > 0
    assert "mem/rollout/host_rss_gb" in log and "host_peak_gb" not in memory.measure()


def test_gpu_check_survives_an_item_that_exits(tmp_path):
    """make gpu-check: check_fused_adam exits (SystemExit, with advice) when FusedAdam will not build; that
    is one failed item, and the items after it still run (it escaped `except Exception` and ended the check)."""
    import gpu_check
    ran = []

    def exits(box):
        raise SystemExit("error: FusedAdam did not build")

    def passes(box):
        ran.append(box)
        return {"ok": 1}
    report = {"items": {}}
    assert gpu_check.run_items({"fused_adam": exits, "next": passes}, "box", report, str(tmp_path)) == 1
    saved = json.load(open(tmp_path / "report.json"))["items"]
    assert ran == ["box"] and saved["next"]["status"] == "pass"
    assert saved["fused_adam"]["status"] == "fail" and "FusedAdam did not build" in saved["fused_adam"]["error"]


def test_gpu_check_production_cycle_sets_the_plan_beside_each_measured_phase():
    """gpu_check.production_cycle runs train.py's own cycle (sleep level 1, offload during rollouts) and
    pairs each phase a step measures (metrics.jsonl's mem/<phase>/...) with the plan's phase of the same
    name: every phase the plan has after load is one train.py records, and its flags are valid."""
    import inspect

    import flags
    import gpu_check
    import planner
    import train
    src = inspect.getsource(train)
    assert all(f'memory.phase("{ph}"' in src for ph in planner.TRAINER if ph != "load")
    args = train.parse_args(gpu_check.PRODUCTION)
    flags.check_args(args, 1)
    args.model = "qwen2.5-vl-3b"   # the shape only: the pairing is the same for any model
    pl = planner.plan(args, planner.Cluster(1, 1, 80, 256, cuda=True))
    row = {"mem/update/gpu_device_gb": 12.0, "mem/update/host_pinned_gb": 3.0, "mem/sync/gpu_device_gb": 9.0,
           "mem/reward/host_peak_gb": 1.0, "train/loss": 0.1}
    out = gpu_check.plan_vs_measured(pl, row)
    assert set(out) == {"update", "sync"}
    assert out["update"]["gpu_device_gb"] == 12.0 and out["update"]["host_pinned_gb"] == 3.0
    assert out["update"]["plan_gpu_gb"] == planner.peaks(pl)["update"][0] / planner.GB
