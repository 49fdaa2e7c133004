"""memory.py: host-RAM preflight, OOM detection and diagnosis, and the per-phase measurements."""
import errno

import pytest
import torch

import memory

GB = 1024 ** 3
# The motivating run: 7B VLM, 8 ranks on one node, ZeRO-3 offloading both, vLLM level-1 sleep.
IMPOSSIBLE = dict(n_params=7_000_000_000, ranks_per_node=8, world_size=8, dtype_bytes=2, offload_param=True,
                  offload_optimizer=True, sleep_level=1, beta=0.04, ref_offload=True, cuda=True)


def test_estimate_hand_checked():
    est = memory.estimate_host_memory(**IMPOSSIBLE)
    n = 7_000_000_000
    # One node holding the whole world: ZeRO partitions add up to one full copy on this node.
    assert est["zero_params"] == n * 2                   # 14e9: bf16 params
    assert est["zero_optimizer"] == n * 16               # 112e9: fp32 master + 2 Adam moments + fp32 grads
    assert est["vllm_sleep_copy"] == n * 2 * 8           # 112e9: one full bf16 copy per rank
    assert est["ref_model"] == n * 2                     # 14e9
    assert est["rank_overhead"] == 8 * 3 * GB
    assert est["total"] == 14e9 + 112e9 + 112e9 + 14e9 + 24 * GB
    assert "vllm_weights" not in est


def test_estimate_partitions_across_nodes_and_drops_what_is_off():
    # 4 nodes of 8: ZeRO parts shrink 4x, vLLM's per-rank copy does not; level 2 keeps no copy.
    est = memory.estimate_host_memory(**{**IMPOSSIBLE, "world_size": 32})
    assert est["zero_optimizer"] == 16 * 7_000_000_000 // 4
    assert est["vllm_sleep_copy"] == 2 * 7_000_000_000 * 8
    est = memory.estimate_host_memory(**{**IMPOSSIBLE, "sleep_level": 2, "beta": 0.0, "offload_param": False})
    assert set(est) == {"zero_optimizer", "rank_overhead", "total"}
    est = memory.estimate_host_memory(**{**IMPOSSIBLE, "cuda": False, "sleep_level": 0})
    assert est["vllm_weights"] == 2 * 7_000_000_000 * 8 and "vllm_sleep_copy" not in est


def test_preflight_refuses_impossible_config():
    est = memory.estimate_host_memory(**IMPOSSIBLE)
    with pytest.raises(SystemExit) as info:
        memory.preflight(est, 251 * GB)
    msg = str(info.value.code)
    assert "--sleep_level 2" in msg and "--skip_memory_preflight" in msg
    assert "offload_optimizer" in msg and "--ref_offload off or --beta 0" in msg
    # Largest first: the sleep copy and CPU Adam tie (112e9 each; the cheaper fix wins), then the
    # 24 GiB of per-rank overhead, then params and ref (14e9 each, in that order).
    fixes = [line for line in msg.splitlines() if line.lstrip()[:2] in {f"{i}." for i in range(1, 10)}]
    assert ["--sleep_level 2" in fixes[0], "offload_optimizer" in fixes[1], "fewer ranks" in fixes[2],
            "offload_param" in fixes[3], "--ref_offload" in fixes[4], len(fixes)] == [True] * 5 + [5]
    assert "251.0" in msg  # the available memory is in the report


def test_preflight_passes_small_config():
    est = memory.estimate_host_memory(n_params=3_000_000_000, ranks_per_node=8, world_size=32, dtype_bytes=2,
                                      offload_param=True, offload_optimizer=True, sleep_level=2, beta=0.0,
                                      ref_offload=False, cuda=True)
    report = memory.preflight(est, 251 * GB)
    assert "zero_optimizer" in report and "total" in report and "available" in report


def test_preflight_allow_reports_but_does_not_stop():
    est = memory.estimate_host_memory(**IMPOSSIBLE)
    report = memory.preflight(est, 251 * GB, allow=True)
    assert "vllm_sleep_copy" in report and "over the limit" in report and "--skip_memory_preflight" in report


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


def test_device_level_memory_beside_torchs_and_in_the_advice(monkeypatch):
    """vLLM's pool and sleep are invisible to torch's counters: the device's own figure
    (total - free) is logged too, and the OOM advice reads it. No CUDA here: the counters are stand-ins."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (10 * GB, 80 * GB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 20 * GB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 25 * GB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 30 * GB)
    m = memory.measure()
    assert (m["gpu_device_gb"], m["gpu_reserved_gb"], m["gpu_alloc_gb"]) == (70, 25, 20)
    assert memory.used_bytes() == 70 * GB
    table = {f"mem/update/{k}": v for k, v in m.items()}
    advice = memory.diagnose(torch.OutOfMemoryError("CUDA out of memory"), "update", table)
    first = advice.split("try, in order:")[1].splitlines()[1]
    assert "45.0 GB of the device is held outside torch's allocator" in first and "gpu_device" in advice
    assert "gpu_device=70.00G" in memory.summary(table)
