"""`make gpu-check`: the first command on a GPU box. Runs the GPU-only path on the tiny model (or
--model PATH), one pass/fail line per item with the measured figures, in runs/gpu-check/report.json;
exits non-zero on any failure. Under 10 minutes on one GPU.

    python gpu_check.py [--model PATH] [--out runs/gpu-check]

Without vLLM installed (e.g. a box where only DeepSpeed could be built) its items are reported as
skipped and the rest still runs: FusedAdam, ZeRO-3 bf16 steps with fp32 gradient accumulation,
offload_states/reload_states over two steps and again after a resume, the reference model's
placement, device-level memory per lever (freed GB), gc after offload, the planner's prediction
next to the measured device memory. With vLLM: engine start with sleep mode, and for sleep levels 1
and 2: sleep -> wake weights -> bucketed sync -> wake KV -> generate, vLLM vs trainer log-probs
(fp32 <= 1e-4; bf16 reported), the memory each level frees, the thread count after engine start.
On a machine without a GPU it says so and exits 0: the non-GPU parts are covered by `make test`.
"""
import argparse
import json
import os
import sys
import time
import traceback

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
import torch

import model as policy_model  # noqa: E402  (the name `model` is a local below)

GB = 1024 ** 3
ITEMS = {}


def item(fn):
    ITEMS[fn.__name__] = fn
    return fn


def device_gb():
    free, total = torch.cuda.mem_get_info()
    return (total - free) / GB


class Skip(Exception):
    pass


# ----------------------------------------------------------------------------- set-up shared by the items
class Box:
    """What the items share: the model dir, a real micro-batch from the tiny task, engine factory."""
    def __init__(self, model, out):
        from transformers import AutoProcessor

        import data
        import tiny
        import train
        from model import image_grid
        self.out = out
        default, train_jsonl, _ = tiny.ensure_default()
        self.model = model or default
        self.processor = AutoProcessor.from_pretrained(self.model)
        self.args = train.parse_args(["--model", self.model, "--max_prompt_length", "256", "--max_completion_length", "8",
                                      "--question_template", "{question}",
                                      "--rollout_batch_size", "2", "--num_generations", "4", "--per_device_train_batch_size", "4",
                                      "--reward_funcs", "accuracy", "--learning_rate", "1e-5"])
        # the smallest images the processor takes (the tiny task's: 4 tokens), so that a prompt fits 256 tokens
        lo, grid = self.processor.image_processor.size["shortest_edge"], image_grid(self.processor)
        self.args.min_pixels, self.args.max_pixels = lo, max(lo, 4 * grid ** 2)
        self.samples = [data.prepare(r, self.processor, self.args) for r in data.read_jsonl(train_jsonl)[:2]]
        self.banned = torch.tensor(__import__("rollout").checkpoint_banned_ids(self.model, self.processor.tokenizer))
        seqs = [s for s in self.samples for _ in range(2)]
        self.batch = data.collate(seqs, [[5, 6, 7]] * len(seqs), self.processor.tokenizer.pad_token_id, self.banned.tolist())

    def engine(self, *flags, bf16=True, model=None):
        """A ZeRO-3 engine built exactly as train.setup builds it, with these flags (of `model`, default self.model)."""
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        import train
        args = train.parse_args(["--model", model or self.model, "--per_device_train_batch_size", "4", "--rollout_batch_size", "2",
                                 "--num_generations", "2", *flags])
        gas = train.grad_accumulation_steps(args, 1)
        cfg = policy_model.ds_config(args, gas, 1, bf16=bf16)
        policy_model.check_fused_adam(cfg)
        keep = HfDeepSpeedConfig(cfg)
        model = policy_model.load_model(args.model, args, torch.bfloat16 if bf16 else torch.float32)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                          lr_scheduler=policy_model.lr_schedule(args))
        engine._keep_config = keep
        return engine, args, cfg

    def step(self, engine):
        """One optimizer step (one micro-batch per step) -> the loss."""
        logps = engine(**{k: v.cuda() for k, v in self.batch.items()}, banned=self.banned.cuda()).logps
        loss = -(logps * self.batch["completion_mask"].cuda()).sum() / self.batch["completion_mask"].sum()
        engine.backward(loss)
        engine.step()
        return loss.item()


def states_devices(engine, kinds):
    from deepspeed.runtime.zero.offload_states import get_state_devices
    return {k.name: sorted(str(d) for d in get_state_devices(engine, k) if d is not None) for k in kinds}


# ----------------------------------------------------------------------------- items without vLLM
@item
def fused_adam(box):
    import train
    args = train.parse_args(["--per_device_train_batch_size", "4", "--offload_optimizer"])
    cfg = policy_model.ds_config(args, 1, 1, bf16=True, cuda=True)
    t0 = time.time()
    return {"loaded": policy_model.check_fused_adam(cfg, cuda=True), "seconds": time.time() - t0}


@item
def zero3_bf16_steps(box):
    engine, _, _ = box.engine()
    losses = [box.step(engine) for _ in range(2)]
    assert all(map(lambda x: x == x, losses)), losses
    assert engine.optimizer.gradient_accumulation_dtype == torch.float32
    return {"losses": losses, "grad_accum_dtype": str(engine.optimizer.gradient_accumulation_dtype),
            "device_gb": device_gb()}


@item
def offload_states_two_steps_and_after_resume(box):
    """--offload_optimizer --offload_model: the states leave the GPU and come back, twice, and again
    after a checkpoint is saved and loaded into a fresh engine (the offload buffers stay off it). On the
    embedded default this runs the 100M model of the same family and tokenizer (~1.8 GB of states): the
    tiny model's states are below the device's 2 MiB granularity, where freed amounts compare nothing."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

    import checkpoint
    import memory
    import tiny
    big = box.model if box.model != tiny.ensure_default()[0] else tiny.ensure_default(size="100m")[0]
    kinds = [S.optim_states, S.hp_params, S.lp_grads, S.lp_params]
    engine, args, _ = box.engine("--offload_optimizer", "--offload_model", model=big)
    include = kinds + [S.contiguous_grad_buffer]
    figures = {}
    for k in range(2):
        box.step(engine)
        before = device_gb()
        engine.offload_states(include=include)
        freed_gc = memory.free() / GB
        off = states_devices(engine, kinds)
        after = device_gb()
        engine.reload_states()
        back = states_devices(engine, kinds)
        assert all(d == ["cpu"] for d in off.values()), off
        assert all(all(x.startswith("cuda") for x in d) for d in back.values()), back
        figures[f"step{k + 1}"] = {"device_gb_before": before, "device_gb_offloaded": after,
                                   "freed_gb": before - after, "gc_empty_cache_freed_gb": freed_gc}
    stream = argparse.Namespace(state=lambda: {})
    ck_args = argparse.Namespace(output_dir=os.path.join(box.out, "ckpt"), save_total_limit=1)
    path = checkpoint.save_checkpoint(engine, ck_args, 2, stream, "gpu-check", 0)
    del engine
    torch.cuda.empty_cache()
    fresh, _, _ = box.engine("--offload_optimizer", "--offload_model", model=big)
    fresh.load_checkpoint(path, tag="zero")
    dropped = checkpoint.drop_offload_buffers(fresh)
    before = device_gb()
    fresh.offload_states(include=include)
    memory.free()
    after = device_gb()
    off = states_devices(fresh, kinds)
    fresh.reload_states()
    box.step(fresh)
    assert all(d == ["cpu"] for d in off.values()), off
    assert not checkpoint.offload_buffers(fresh) or all(
        v.device.type == "cpu" for st, k in checkpoint.offload_buffers(fresh) for v in [st[k]])
    figures["after_resume"] = {"device_gb_before": before, "device_gb_offloaded": after, "freed_gb": before - after,
                               "buffers_dropped_after_load": dropped}
    assert figures["step1"]["freed_gb"] > 0.5, figures   # 100M x 18 B; a real --model frees more
    assert figures["after_resume"]["freed_gb"] > 0.5 * figures["step1"]["freed_gb"], figures
    return figures


@item
def reference_placement(box):
    engine, args, cfg = box.engine("--offload_model")
    out = {}
    for ref_offload in (True, False):
        ref = policy_model.load_reference(args, torch.bfloat16, policy_model.reference_config(cfg, ref_offload))
        devices = {p.ds_tensor.device.type for p in ref.module.parameters()}
        out[f"ref_offload={ref_offload}"] = sorted(devices)
        assert devices == ({"cpu"} if ref_offload else {"cuda"}), (ref_offload, devices)
        del ref
    return out


@item
def device_memory_accounting(box):
    import memory
    m = memory.measure()
    x = torch.empty(int(GB), dtype=torch.uint8, device="cuda")
    m2 = memory.measure()
    del x
    freed = memory.free()
    assert m2["gpu_device_gb"] - m["gpu_device_gb"] > 0.9, (m, m2)
    return {"before": m, "with_1gb": m2, "free_gb": freed / GB}


@item
def planner_next_to_measured(box):
    """The plan's GPU figures for one GPU next to what this box measured (calibration, not pass/fail)."""
    import planner
    args = argparse.Namespace(**{**vars(box.args), "offload_optimizer": True, "offload_model": True})
    cluster = planner.Cluster(1, 1, torch.cuda.get_device_properties(0).total_memory / GB, 64.0, cuda=True)
    pl = planner.plan(args, cluster)
    engine, _, _ = box.engine("--offload_optimizer", "--offload_model")
    torch.cuda.reset_peak_memory_stats()
    box.step(engine)
    measured_update = device_gb()
    return {"plan_gb": {ph: g / GB for ph, (g, _) in planner.peaks(pl).items()}, "measured_update_device_gb": measured_update,
            "measured_update_torch_peak_gb": torch.cuda.max_memory_allocated() / GB}


# ----------------------------------------------------------------------------- items with vLLM
def free_port():
    import socket
    with socket.socket() as sock:   # a child's own torch.distributed port
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PRODUCTION = ["--bf16", "--sleep_level", "1", "--zero_offload", "none", "--offload_optimizer", "--offload_model",
              "--max_steps", "2", "--save_steps", "0", "--no-save_final_model", "--val_freq", "0", "--report_to", "none"]


def plan_vs_measured(pl, row):
    """Each phase of the plan next to what a step measured in the same phase (metrics.jsonl's
    mem/<phase>/...: the device's memory, torch's peak without vLLM's pool, the pinned host memory,
    the host RSS peak), for the phases a step records (not vllm_start and load, which run once)."""
    import planner
    out = {}
    for ph, (gpu, host) in planner.peaks(pl).items():
        got = {k.rsplit("/", 1)[1]: v for k, v in row.items() if k.startswith(f"mem/{ph}/")}
        if got:
            out[ph] = {"plan_gpu_gb": gpu / GB, "plan_host_gb": host / GB, **{k: got.get(k) for k in (
                "gpu_device_gb", "gpu_peak_gb", "gpu_vllm_gb", "host_pinned_gb", "host_peak_gb")}}
    return out


@item
def production_cycle(box):
    """The cycle train.py runs, once, under the deepspeed launcher on this GPU: ZeRO-3 gather -> bucketed
    sync -> sleep level 1 / wake with offload_states of the optimizer and the model, two steps of the
    embedded default (whatever --model says); each phase's measured device and pinned-host memory
    beside the plan's for the same flags."""
    need_vllm()
    import subprocess

    import planner
    import tiny
    import train
    run_dir = os.path.join(box.out, "production")
    r = subprocess.run(["deepspeed", "--num_gpus", "1", "--master_port", str(free_port()), "train.py",
                        "--output_dir", run_dir, *PRODUCTION], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError((r.stdout + r.stderr)[-3000:])
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    args = train.parse_args(PRODUCTION)
    args.model = tiny.ensure_default()[0]
    import psutil
    cluster = planner.Cluster(1, 1, torch.cuda.get_device_properties(0).total_memory / GB, psutil.virtual_memory().total / GB)
    return {"steps": len(rows), "phases": plan_vs_measured(planner.plan(args, cluster), rows[-1])}


def need_vllm():
    try:
        import vllm  # noqa: F401
    except Exception as e:
        raise Skip(f"vLLM not importable here ({type(e).__name__}); run `make gpu-check` where it is installed")


@item
def vllm_sleep_levels(box):
    """For sleep levels 1 and 2: sleep -> wake weights -> bucketed sync -> wake KV -> generate; vLLM's
    processed log-probs against the trainer's, and the memory each level frees. Each case in a fresh
    process: vLLM's CuMem pool takes one engine per process."""
    need_vllm()
    import subprocess
    out = {}
    for level, dtype in ((1, "float32"), (2, "float32"), (2, "bfloat16")):
        path = os.path.join(box.out, f"vllm_level{level}_{dtype}.json")
        r = subprocess.run([sys.executable, __file__, "--vllm_case", str(level), dtype, "--out", box.out, "--model", box.model],
                           capture_output=True, text=True, timeout=600, env=dict(os.environ, MASTER_PORT=str(free_port())))
        if r.returncode != 0:
            raise RuntimeError(f"level {level} {dtype}: {(r.stdout + r.stderr)[-2000:]}")
        out[f"level{level}_{dtype}"] = json.load(open(path))
    for key, f in out.items():
        if "float32" in key:
            assert f["logp_diff_max"] <= 1e-4, (key, f)
        assert f["sleep_freed_gb"] > 0.1, (key, f)
    return out


def vllm_case(box, level, dtype):
    """One engine with sleep mode at `level`: the cycle the trainer runs, measured. -> figures."""
    from vllm import SamplingParams

    import data
    import rollout
    torch_dtype = getattr(torch, dtype)
    args = argparse.Namespace(**{**vars(box.args), "sleep_level": level, "vllm_gpu_memory_utilization": 0.3})
    share = rollout.torch_threads_share(1)
    llm = rollout.create_engine(box.model, args, dtype, 16, 0)
    threads = rollout.restore_threads(share)
    model = policy_model.load_model(box.model, args, torch_dtype).cuda().eval()
    awake = device_gb()
    freed = rollout.sleep(llm, level, gc_collect=True)
    asleep = device_gb()
    rollout.wake(llm, level, ["weights"])
    rollout.sync_weights(llm, model, bucket_mb=0)
    rollout.wake(llm, level, ["kv_cache"])
    sps = [SamplingParams(n=4, max_tokens=8, temperature=0.9, logprobs=0, seed=i,
                          logit_bias=rollout.logit_bias(box.banned.tolist())) for i in range(len(box.samples))]
    reqs = [{"prompt_token_ids": s["vllm_ids"], "multi_modal_data": {"image": s["images"]}} for s in box.samples]
    comps = [c for o in rollout.generate(llm, reqs, sps) for c in o.outputs]
    seqs = [s for s in box.samples for _ in range(4)]
    batch = data.collate(seqs, [list(c.token_ids) for c in comps], box.processor.tokenizer.pad_token_id, box.banned.tolist())
    with torch.no_grad():
        logps = model(**{k: v.cuda() for k, v in batch.items()}, temperature=0.9, banned=box.banned.cuda()).logps
    C = batch["completion_mask"].shape[1]   # completions right-aligned (data.collate)
    diff = max(abs(logps[i, C - len(c.logprobs) + t].item() - next(iter(d.values())).logprob)
               for i, c in enumerate(comps) for t, d in enumerate(c.logprobs))
    return {"logp_diff_max": diff, "device_gb_awake": awake, "device_gb_asleep": asleep, "sleep_freed_gb": awake - asleep,
            "gc_empty_cache_freed_gb": freed / GB, "torch_threads_after_engine_start": threads}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model dir; default: the embedded tiny model")
    p.add_argument("--out", default="runs/gpu-check", help="report.json goes here")
    p.add_argument("--only", nargs="*", default=None, help="run these items only")
    p.add_argument("--vllm_case", nargs=2, default=None, help=argparse.SUPPRESS)   # LEVEL DTYPE, in a fresh process
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    report = {"device": None, "items": {}}
    if not torch.cuda.is_available():
        report["device"] = "no GPU"
        report["items"] = {name: {"status": "skipped", "why": "no GPU on this machine"} for name in ITEMS}
        json.dump(report, open(os.path.join(a.out, "report.json"), "w"), indent=1)
        print("[gpu-check] no GPU here: nothing to check (the non-GPU parts are covered by `make test`)")
        return 0
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29591"))
    import deepspeed
    deepspeed.init_distributed()
    report["device"] = torch.cuda.get_device_name(0)
    box = Box(a.model, a.out)
    if a.vllm_case:
        level, dtype = int(a.vllm_case[0]), a.vllm_case[1]
        json.dump(vllm_case(box, level, dtype), open(os.path.join(a.out, f"vllm_level{level}_{dtype}.json"), "w"))
        return 0
    failed = run_items({k: v for k, v in ITEMS.items() if not a.only or k in a.only}, box, report, a.out)
    print(f"[gpu-check] report: {os.path.join(a.out, 'report.json')}")
    return 1 if failed else 0


def run_items(items, box, report, out):
    """Each item once, its pass/fail/skip line printed and report.json rewritten after it. A failing item,
    SystemExit included (check_fused_adam exits with advice when FusedAdam will not build), is one
    failed line, not the end of the check. -> the number that failed."""
    failed = 0
    for name, fn in items.items():
        t0 = time.time()
        try:
            figures = fn(box)
            entry = {"status": "pass", "figures": figures}
        except Skip as e:
            entry = {"status": "skipped", "why": str(e)}
        except (Exception, SystemExit) as e:   # one failing item must not hide the others
            failed += 1
            entry = {"status": "fail", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        entry["seconds"] = round(time.time() - t0, 1)
        report["items"][name] = entry
        print(f"[gpu-check] {entry['status']:<7} {name} ({entry['seconds']} s)"
              + (f": {entry.get('error') or entry.get('why')}" if entry["status"] != "pass" else ""), flush=True)
        json.dump(report, open(os.path.join(out, "report.json"), "w"), indent=1, default=str)
    return failed


if __name__ == "__main__":
    sys.exit(main())
