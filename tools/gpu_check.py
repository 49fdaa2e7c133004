"""`make gpu-check`: the first command on a GPU box. Runs the GPU-only path on the tiny model (or --model PATH),
one pass/fail line per item with its measured figures, into runs/gpu-check/report.json, and exits non-zero on any
failure. About 15 minutes on one GPU: each item that launches train.py takes a minute or two.

    python tools/gpu_check.py [--model PATH] [--out runs/gpu-check] [--only ITEM ...] [--list]

`--list` says what each item checks; docs/verification.md says what they cover. Without vLLM installed its items are
reported as skipped and the rest still run. On a machine without a GPU it says so and exits 0: the non-GPU parts are
covered by `make test`. On one with an NVIDIA GPU (/dev/nvidia*, nvidia-smi) whose torch has no CUDA (`make
gpu-check` picks .venv, the CPU stack of `make test`, when it exists) it names the interpreter and exits 2.
"""
import argparse
import contextlib
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the project's files sit one folder up, in the root
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
import torch  # noqa: E402

import grpo  # noqa: E402
import model as policy_model  # noqa: E402  (the name `model` is a local below)

GB = 1024 ** 3
ITEMS = {}
RUN_LAST = ("realsize",)   # after the vLLM items, whose import turns cuDNN attention off as in train.py


def item(fn):
    ITEMS[fn.__name__] = fn
    return fn


def device_gb():
    free, total = torch.cuda.mem_get_info()
    return (total - free) / GB


class Skip(Exception):
    pass


# ----------------------------------------------------------------------------- a GPU that torch cannot see
def find_gpu(dev="/dev", smi="nvidia-smi"):
    """Signs of an NVIDIA GPU on this machine, whatever torch says: its device files (dev/nvidia0, ...) and the
    GPUs that `smi -L` lists -> a short description, or None. The places to look are arguments so that a test can
    point them at a fake /dev and a fake nvidia-smi."""
    signs = sorted(p for p in glob.glob(os.path.join(dev, "nvidia*"))
                   if re.fullmatch(r"nvidia\d+", os.path.basename(p)))   # not nvidiactl, nvidia-uvm
    exe = shutil.which(smi)
    if exe:
        try:
            listed = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):   # a hung or broken driver tool is no sign either way
            listed = ""
        gpus = [line.strip() for line in listed.splitlines() if line.startswith("GPU ")]
        if gpus:
            signs.append(f"{exe} -L: {gpus[0]}" + (f" and {len(gpus) - 1} more" if len(gpus) > 1 else ""))
    return "; ".join(signs) or None


def why_no_cuda():
    """Why this interpreter's torch sees no CUDA device, in a few words."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__}, a build without CUDA"
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}), which finds no device: an NVIDIA driver older "
            f"than its CUDA needs (PyPI's torch 2.13.0 is a CUDA 13 build: R580 or newer), or CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}")


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
        policy_model.refuse_quantized(policy_model.on_disk(self.model))   # before anything loads it
        self.processor = AutoProcessor.from_pretrained(self.model)
        self.args = train.parse_args(["--model", self.model, "--max_prompt_length", "256", "--max_completion_length",
                                      "8", "--question_template", "{question}", "--rollout_batch_size", "2",
                                      "--num_generations", "4", "--per_device_train_batch_size", "4",
                                      "--reward_funcs", "accuracy", "--learning_rate", "1e-5"])
        # the smallest images the processor takes (the tiny task's: 4 tokens), so that a prompt fits 256 tokens
        lo, grid = self.processor.image_processor.size["shortest_edge"], image_grid(self.processor)
        self.args.min_pixels, self.args.max_pixels = lo, max(lo, 4 * grid ** 2)
        self.samples = [data.prepare(r, self.processor, self.args) for r in data.read_jsonl(train_jsonl)[:2]]
        self.banned = torch.tensor(__import__("rollout").checkpoint_banned_ids(self.model, self.processor.tokenizer))
        self.sampling = grpo.Sampling(banned=tuple(self.banned.tolist()))   # the distribution the log-probs are of
        seqs = [s for s in self.samples for _ in range(2)]
        self.batch = data.collate(seqs, [[5, 6, 7]] * len(seqs), self.processor.tokenizer.pad_token_id,
                                  self.banned.tolist())

    def engine(self, *flags, bf16=True, model=None):
        """A ZeRO-3 engine built exactly as train.setup builds it, with these flags (of `model`, default
        self.model)."""
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        import train
        args = train.parse_args(["--model", model or self.model, "--per_device_train_batch_size", "4",
                                 "--rollout_batch_size", "2", "--num_generations", "2", *flags])
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
        logps = engine(**{k: v.cuda() for k, v in self.batch.items()}, sampling=self.sampling).logps
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
    """DeepSpeed's FusedAdam loads (it JIT-compiles with nvcc unless prebuilt: model.check_fused_adam)."""
    import train
    args = train.parse_args(["--per_device_train_batch_size", "4", "--offload_optimizer"])
    cfg = policy_model.ds_config(args, 1, 1, bf16=True, cuda=True)
    t0 = time.time()
    return {"loaded": policy_model.check_fused_adam(cfg, cuda=True), "seconds": time.time() - t0}


@item
def zero3_bf16_steps(box):
    """Two ZeRO-3 bf16 optimizer steps, finite, with gradients accumulated in fp32."""
    engine, _, _ = box.engine()
    losses = [box.step(engine) for _ in range(2)]
    assert all(map(lambda x: x == x, losses)), losses
    assert engine.optimizer.gradient_accumulation_dtype == torch.float32
    return {"losses": losses, "grad_accum_dtype": str(engine.optimizer.gradient_accumulation_dtype),
            "device_gb": device_gb()}


@item
def offload_states_two_steps_and_after_resume(box):
    """--offload_optimizer --offload_model: the states leave the GPU and come back, twice, and again after a
    checkpoint is saved and loaded into a fresh engine (the offload buffers stay off it). On the embedded default it
    runs the 100M model of the same family, as the tiny model's states are below the device's 2 MiB granularity."""
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
    """The reference model's ZeRO-3 shards on the CPU with --ref_offload, on the GPU without."""
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
    """memory.measure's device-level figure sees a 1 GB tensor come and go."""
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
    return {"plan_gb": {ph: g / GB for ph, (g, _) in planner.peaks(pl).items()},
            "measured_update_device_gb": measured_update,
            "measured_update_torch_peak_gb": torch.cuda.max_memory_allocated() / GB}


def prefix_agreement(box, device, dtype):
    """One micro-batch of box's two prompts (a group of 4 completions, one of 2) through the standard forward
    (data.collate) and the shared-prefix one (data.collate_prefix) of box.model on `device` in `dtype`, gradient
    checkpointing on, and the gradients of one loss -> the largest log-prob difference, the largest gradient
    difference relative to its parameter's largest gradient, and the aten attention ops each path ran."""
    from torch.profiler import profile
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    import data
    unset_hf_deepspeed_config()   # an earlier item's config would make from_pretrained shard the model (zero.Init)
    model = policy_model.load_model(box.model, box.args, dtype).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    pad, banned = box.processor.tokenizer.pad_token_id, box.banned.tolist()
    comps = [[[11, 12, 13], [14], [15, 16, 17, 18], [19, 20]], [[30, 31], [32, 33, 34]]]
    seqs = [(s, c) for s, cs in zip(box.samples, comps) for c in cs]
    batches = {"standard": data.collate([s for s, _ in seqs], [c for _, c in seqs], pad, banned),
               "shared_prefix": data.collate_prefix(list(zip(box.samples, comps)), pad, banned)}
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0], device=device)
    out, ops = {}, {}
    for name, batch in batches.items():
        model.zero_grad(set_to_none=True)
        mask = batch["completion_mask"].to(device)
        with profile() as prof:
            logps = model(**{k: v.to(device) for k, v in batch.items()}, sampling=box.sampling).logps
            (-(logps * adv[:, None] * mask).sum() / mask.sum()).backward()
        ops[name] = sorted({e.key for e in prof.key_averages() if e.key.startswith("aten::") and "attention" in e.key})
        out[name] = logps.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()
                                             if p.grad is not None}
    (a, ga), (b, gb) = out["standard"], out["shared_prefix"]
    assert ga.keys() == gb.keys() and a.shape == b.shape == (6, 4), (a.shape, b.shape)
    grad = max(((ga[n] - gb[n]).abs().max() / ga[n].abs().max().clamp(min=1e-20)).item() for n in ga)
    return {"logp_diff_max": (a - b).abs().max().item(), "grad_rel_diff_max": grad, "attention_ops": ops}


@item
def shared_prefix_equals_standard(box):
    """--shared_prefix against the standard forward on this GPU, where sdpa picks its CUDA kernel by the mask
    (a group's completions share its prompt under a 4-D mask): log-probs and gradients of the same micro-batch
    both ways, fp32 asserted (1e-4 and 1e-3 relative), bf16 reported, and the attention ops each path ran."""
    from transformers import AutoConfig
    why = policy_model.shared_prefix_unsupported(AutoConfig.from_pretrained(box.model))
    if why:
        raise Skip(f"--shared_prefix falls back to the standard path on this model: {why}")
    fp32 = prefix_agreement(box, "cuda", torch.float32)
    assert fp32["logp_diff_max"] <= 1e-4 and fp32["grad_rel_diff_max"] <= 1e-3, fp32
    return {"float32": fp32, "bfloat16": prefix_agreement(box, "cuda", torch.bfloat16)}


# 8 images of a Qwen2.5-VL-7B's token counts (merged tokens, h x w: 1,036-1,296 each)
VISION_IMAGES = [(28, 37), (36, 36), (32, 40), (30, 36), (34, 34), (29, 40), (36, 31), (33, 38)]


def vision_tower_agreement(device, dtype, images=VISION_IMAGES, **widths):
    """A 2-block Qwen2.5-VL-7B vision tower (random init, one windowed block and one full) on `images` (merged
    tokens, h x w each), `widths` overriding the config's, forward and backward through transformers' sdpa loop and
    through model.vision_attention -> the largest relative difference of the output and of the gradients, and each
    path's attention calls (sdpa's and the varlen op's) and seconds (after a warm-up, without the profiler)."""
    from torch.profiler import profile
    from transformers import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    import planner
    cfg = Qwen2_5_VLVisionConfig(**{**planner.builtin_config("qwen2.5-vl-7b").vision_config.to_dict(),
                                    "depth": 2, "fullatt_block_indexes": [1], **widths})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    tower = Qwen2_5_VisionTransformerPretrainedModel(cfg).to(device=device, dtype=dtype)
    grids = torch.tensor([[1, 2 * h, 2 * w] for h, w in images], device=device)
    patches = torch.randn(int(grids.prod(-1).sum()), cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2,
                          device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run():
        tower.zero_grad(set_to_none=True)
        out = tower(patches, grid_thw=grids).pooler_output
        out.float().square().mean().backward()
        return out.detach().float(), {n: p.grad.float() for n, p in tower.named_parameters()}
    got = {}
    for path in ("loop", "one_call"):
        if path == "one_call":
            policy_model.install_vision_attention(tower)
        run()   # warm-up
        sync()
        t0 = time.time()
        out, grads = run()
        sync()
        seconds = time.time() - t0
        with profile() as prof:   # the calls, apart: the profiler's cost per op would weigh on the loop's time
            run()
        calls = {e.key: e.count for e in prof.key_averages()
                 if e.key in ("aten::scaled_dot_product_attention", "torch_attn::_varlen_attn")}
        got[path] = out, grads, calls, seconds
    (a, ga, *_), (b, gb, *_) = got["loop"], got["one_call"]
    return {"output_rel_diff": ((a - b).abs().max() / a.abs().max()).item(),
            "grad_rel_diff_max": max(((ga[n] - gb[n]).abs().max() / ga[n].abs().max().clamp(min=1e-20)).item()
                                     for n in ga),
            "calls": {path: v[2] for path, v in got.items()}, "seconds": {path: v[3] for path, v in got.items()},
            "patches": patches.shape[0]}


@item
def vision_attention_one_call(box):
    """The vision tower's attention as one call per layer (model.vision_attention) against transformers' sdpa loop,
    forward and backward, on a 7B-wide tower of 2 blocks with 8 images of a 7B's token counts: in bf16 through
    torch's varlen flash kernel (one call a block, within 5e-2 of the loop), in fp32 through the padded sdpa path
    (within 1e-4)."""
    bf16 = vision_tower_agreement("cuda", torch.bfloat16)
    assert bf16["calls"]["one_call"].get("torch_attn::_varlen_attn") == 2, bf16["calls"]
    assert bf16["output_rel_diff"] <= 5e-2 and bf16["grad_rel_diff_max"] <= 5e-2, bf16
    fp32 = vision_tower_agreement("cuda", torch.float32, images=VISION_IMAGES[:2])
    assert fp32["output_rel_diff"] <= 1e-4 and fp32["grad_rel_diff_max"] <= 1e-4, fp32
    return {"bfloat16": bf16, "float32": fp32}


@item
def qwen3_5_linear_attention_kernels(box):
    """The Gated DeltaNet and conv1d kernels transformers trains Qwen3.5 with (model.linear_attention_kernels).
    Fails on its PyTorch fallback, which is far slower: flash-linear-attention or causal-conv1d is missing from this
    interpreter (requirements.txt)."""
    from transformers import AutoConfig

    import tiny
    kernels = policy_model.linear_attention_kernels(AutoConfig.from_pretrained(tiny.ensure_default(arch="qwen3_5")[0]))
    if "fallback" in kernels:
        raise AssertionError(kernels)
    return {"kernels": kernels}


# ----------------------------------------------------------------------------- the update at a published shape
# bf16 dense peak of a GPU, TFLOPS (the vendors' data sheets), for the MFU (6 x params x tokens / seconds / peak)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "B200": 2250.0, "L40S": 362.0}
# A 7B's long-prompt workload: 8 prompts of 1,157-1,430 tokens with one image of all but 121-134 of them, 8 completions
# each of 200-500 tokens (random ids: the memory and the time do not depend on them)
REALSIZE = dict(model="qwen2.5-vl-7b", prompts=8, generations=8, prompt_tokens=(1157, 1430), text_tokens=(121, 134),
                completion_tokens=(200, 500))


def realsize_groups(config, prompts, generations, prompt_tokens, text_tokens, completion_tokens, seed=0):
    """Random train.Group records at a real shape for `config` (a Qwen2.5-VL or Qwen3-VL one): each prompt of
    `prompt_tokens` (lo, hi) tokens, all but `text_tokens` of them one image on the model's grid, its patches random;
    `generations` completions of `completion_tokens` each. Lengths drawn uniformly, seeded."""
    import random

    import train
    rng, v = random.Random(seed), config.vision_config
    gen = torch.Generator().manual_seed(seed)
    vocab = min(config.get_text_config().vocab_size, config.vision_start_token_id)   # ids below the special tokens
    groups = []
    for _ in range(prompts):
        P = rng.randint(*prompt_tokens)
        want = P - rng.randint(*text_tokens) - 2                     # merged image tokens, between the vision start/end
        gh = max(1, int(want ** 0.5))
        gw = max(1, want // gh)
        m = v.spatial_merge_size
        image = gh * gw
        ids = torch.randint(0, vocab, (1, P), generator=gen)
        ids[0, 1], ids[0, 2 + image] = config.vision_start_token_id, config.vision_end_token_id
        ids[0, 2:2 + image] = config.image_token_id
        types_ = torch.zeros(1, P, dtype=torch.long)
        types_[0, 2:2 + image] = 1
        pixels = torch.randn(image * m * m, v.in_channels * v.temporal_patch_size * v.patch_size ** 2, generator=gen)
        sample = {"hf": {"input_ids": ids, "mm_token_type_ids": types_, "pixel_values": pixels,
                         "image_grid_thw": torch.tensor([[1, gh * m, gw * m]])}}
        comps = [train.Completion(index=k, token_ids=torch.randint(0, vocab, (rng.randint(*completion_tokens),),
                                                                   generator=gen).tolist(),
                                  sampler_logps=[], text="", finish_reason="stop") for k in range(generations)]
        groups.append(train.Group(sample=sample, completions=comps))
    return groups


def cuda_peak(fn):
    """fn() -> (its result, the most torch's allocator held above what it held before, bytes)."""
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - start


@contextlib.contextmanager
def plain_linear():
    """torch's own F.linear while the update is measured. A ZeRO-3 model built earlier in this process leaves
    DeepSpeed's zero3_linear_wrap in its place, under which lm_head's chunk gradients add up in place: one V x h
    less than the plain module that planner.update_bytes counts."""
    saved = torch.nn.functional.linear
    torch.nn.functional.linear = torch._C._nn.linear
    try:
        yield
    finally:
        torch.nn.functional.linear = saved


def realsize_update(config, cases, groups, device="cuda", dtype=torch.bfloat16, peak=cuda_peak, fits=None):
    """The trainer's update at `config`'s shape on one device as a plain module (random weights, sdpa, no ZeRO-3, no
    optimizer step): for each (layout, checkpointing) of `cases`, train.micro_batches' layout of `groups`, then per
    micro-batch learner.completion_logps, the GRPO loss and backward, gradients accumulating in the model's dtype.
    -> {case: figures}: seconds, tokens, MFU (where the device's peak is known), and the peak above the weights and
    their gradients beside planner.update_bytes' terms for the micro-batch that peaked. A case that `fits(plan
    bytes)` rejects is reported, not run, so that it cannot end the check in an OOM."""
    import types

    import learner
    import planner
    import train
    with tempfile.TemporaryDirectory() as d:   # the plan's shape of this config (planner.model_shape reads a dir)
        config.save_pretrained(d)
        s = planner.model_shape(d)
    p = torch.empty(0, dtype=dtype).element_size()
    states = 2 * s["n"] * p   # the weights and, from the first backward on, their gradients
    out, hf = {}, None
    for layout, gc in cases:
        name = f"{layout}, gradient checkpointing {'on' if gc else 'off'}"
        args = train.parse_args(["--per_device_train_batch_size", str(len(groups[0].completions)),
                                 "--shared_prefix" if layout == "shared_prefix" else "--no-shared_prefix"])
        run = types.SimpleNamespace(args=args, pad_id=0, sampling=grpo.Sampling(), device=torch.device(device), rank=0)
        batches = train.micro_batches(run, groups)

        def plan(b):
            x = b["inputs"]
            rows, tokens = x["input_ids"].shape[0], x["input_ids"].numel()
            images = int((x["mm_token_type_ids"] == 1).sum())
            masked = layout == "shared_prefix" or rows > 1   # a 4-D mask: the shared prefix, or padding
            kept, moments = planner.update_bytes(s, p, gc, rows, tokens, images, x["completion_mask"].numel(),
                                                 args.logprob_chunk_tokens, masked)
            return {"activations": kept, **{f"backward: {k}": v for k, v in moments.items()},
                    "total": kept + max(moments.values())}
        worst = max(plan(b)["total"] for b in batches)
        if fits is not None and not fits(states + worst):
            out[name] = {"skipped": f"the plan needs {(states + worst) / GB:.1f} GB here", "plan_gb": worst / GB}
            continue
        if hf is None:   # built as train.py loads its policy: its attention, the vision tower's one call per layer
            with policy_model.outside_zero3(), torch.device(device):
                hf = policy_model.load_model(None, args, dtype, config=config)
            hf.train()
        if gc:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            hf.gradient_checkpointing_disable()

        def step(b):
            ts = learner.completion_logps(hf, b, run, with_entropy=True, with_kept=True)
            cmask = b["inputs"]["completion_mask"].to(device)
            adv = torch.linspace(-1, 1, cmask.shape[0], device=device)
            loss, _ = grpo.grpo_loss(ts.logps, ts.logps.detach(), adv, cmask)
            loss.backward()
        with plain_linear():   # a plain module's update, whatever ZeRO-3 engine this process built before
            if device == "cuda":   # warm-up: kernels and workspaces load; the gradients exist then
                step(min(batches, key=lambda b: b["inputs"]["input_ids"].numel()))
            else:   # a CPU loads nothing a pass keeps: the gradients alone, as the warm-up would leave them
                for q in hf.parameters():
                    q.grad = torch.zeros_like(q)
            peaks = []
            sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
            sync()
            t0 = time.perf_counter()
            for b in batches:
                peaks.append(peak(lambda: step(b))[1])
            sync()
            seconds = time.perf_counter() - t0
        k = max(range(len(batches)), key=peaks.__getitem__)
        tokens = sum(b["inputs"]["input_ids"].numel() for b in batches)
        name_of = torch.cuda.get_device_name(0) if device == "cuda" else ""
        gpu = next((v for key, v in PEAK_TFLOPS.items() if key in name_of), None)
        x = batches[k]["inputs"]
        out[name] = {"seconds": seconds, "tokens": tokens, "micro_batches": len(batches), "attention": attention_of(hf),
                     "achieved_tflops": 6 * s["n"] * tokens / seconds / 1e12,
                     "mfu": 6 * s["n"] * tokens / seconds / (gpu * 1e12) if gpu else None,
                     "peak_micro_batch": {"rows": x["input_ids"].shape[0], "tokens": x["input_ids"].numel(),
                                          "completions": list(x["completion_mask"].shape),
                                          "image_tokens": int((x["mm_token_type_ids"] == 1).sum())},
                     "measured_gb": peaks[k] / GB, "plan_gb": {t: v / GB for t, v in plan(batches[k]).items()},
                     "plan_seconds": planner.compute_seconds(s, s["n_active"], tokens, sum(
                         int((b["inputs"]["mm_token_type_ids"] == 1).sum()) for b in batches), gc)
                     + len(batches) * (2 + gc) * planner.COST["pass_overhead_s"]}
        hf.zero_grad(set_to_none=True)
    return out


def attention_of(hf):
    """What attention a model built by model.load_model runs: the text model's and the vision tower's
    attn_implementation, whether the tower runs model.vision_attention, and torch's sdpa backends turned on now."""
    visual = hf.model.visual
    b = torch.backends.cuda
    return {"text": hf.config.get_text_config()._attn_implementation, "vision": visual.config._attn_implementation,
            "vision_one_call": any(getattr(m.forward, "__func__", None) is policy_model.vision_attention
                                   for m in visual.modules()),
            "sdpa_backends": {"cudnn": b.cudnn_sdp_enabled(), "flash": b.flash_sdp_enabled(),
                              "mem_efficient": b.mem_efficient_sdp_enabled(), "math": b.math_sdp_enabled()}}


@item
def realsize(box):
    """The update at Qwen2.5-VL-7B's shape (planner.builtin_config, random weights) on this GPU as a plain module
    built by model.load_model, bf16, with train.py's attention and, where vLLM is installed, its settings (it runs
    last): REALSIZE's 8 prompts x 8 completions in the shared-prefix and the standard layout, gradient checkpointing
    on and off. Per case the time, MFU, the attention that ran, and the peak above weights and gradients beside the
    plan's terms; a case the plan says cannot fit here is reported, not run."""
    import planner
    try:   # as in train.py once its engine started: vLLM's CUDA platform turns cuDNN attention off
        from vllm.platforms import current_platform
        current_platform.device_type
    except ImportError:
        pass
    config = planner.builtin_config(REALSIZE["model"])
    groups = realsize_groups(config, REALSIZE["prompts"], REALSIZE["generations"], REALSIZE["prompt_tokens"],
                             REALSIZE["text_tokens"], REALSIZE["completion_tokens"])
    total = torch.cuda.get_device_properties(0).total_memory
    cases = [("shared_prefix", True), ("shared_prefix", False), ("standard", True), ("standard", False)]
    return realsize_update(config, cases, groups, fits=lambda need: need < 0.9 * total)


# ------------------------------------------------------------------------ items with vLLM: train.py under the launcher
def free_port():
    import socket
    with socket.socket() as sock:   # a child's own torch.distributed port
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SHORT = ["--max_steps", "2", "--save_steps", "0", "--no-save_final_model", "--val_freq", "0", "--report_to", "none"]
# The train.py flags of each run an item launches (the embedded default, whatever --model says; each parses with
# train.parse_args and passes check_args: tests/test_gpu_check.py). No LoRA or frozen run takes --offload_model:
# DeepSpeed 0.19.8's offload_states lays every parameter's ds_tensor over a buffer sized from the trainable ones
# only, and train.py refuses it beside a frozen part (frozen_vision_tower_offload checks that it says so).
RUNS = {
    "production": ["--bf16", "--sleep_level", "1", "--zero_offload", "none", "--offload_optimizer", "--offload_model",
                   *SHORT],
    "lora_merged": ["--bf16", "--use_peft", "--lora_sync", "merged", "--beta", "0.04", "--sleep_level", "1", *SHORT],
    "lora_adapter": ["--bf16", "--use_peft", "--lora_sync", "adapter", "--beta", "0.04", "--sleep_level", "1", *SHORT],
    "frozen_tower": ["--bf16", "--freeze_vision_tower", "--zero_offload", "none", "--offload_optimizer",
                     "--sleep_level", "1", *SHORT],
    "frozen_tower_offload_model": ["--bf16", "--freeze_vision_tower", "--zero_offload", "none", "--offload_model",
                                   *SHORT],   # to be refused
    "qwen3_5": ["--bf16", "--tiny_arch", "qwen3_5", "--sleep_level", "1", *SHORT],
    "tools": ["--bf16", "--tiny_task", "zoom", "--sleep_level", "1", *SHORT],   # --tools crop, 2 turns at most
    "video": ["--bf16", "--tiny_task", "motion", "--sleep_level", "1", *SHORT],   # --limit_videos 1
    "video_fp32": ["--no-bf16", "--tiny_task", "motion", "--sleep_level", "1", *SHORT],
}
PRODUCTION = RUNS["production"]   # the production cycle's flags (tests/test_memory.py plans them)
# transformers' warning when a function runs its PyTorch reference code for want of a kernel package
FALLBACK_WARNING = "falling back to its reference PyTorch implementation"


def launch_command(run_dir, flags, port):
    """train.py under DeepSpeed's launcher on one GPU, started by this interpreter: a `deepspeed` script found on
    PATH may belong to another Python (the CPU stack's .venv, say), and the launcher starts the ranks with its own."""
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(port),
            "train.py", "--output_dir", run_dir, *flags]


def launch(box, name, env=None):
    """train.py with RUNS[name], in box.out/name -> (exit code, its output); the output is kept in name.log."""
    run_dir = os.path.join(box.out, name)
    r = subprocess.run(launch_command(run_dir, RUNS[name], free_port()), capture_output=True, text=True, timeout=900,
                       cwd=ROOT, env={**os.environ, **(env or {})})
    with open(os.path.join(box.out, f"{name}.log"), "w") as f:
        f.write(r.stdout + r.stderr)
    return r.returncode, r.stdout + r.stderr


def refusals(log, flag):
    """The error lines of a train.py output that name `flag` (check_args exits with "error: ...")."""
    return [line.strip() for line in log.splitlines() if "error" in line.lower() and flag in line]


def training_rows(rows):
    """One row per training step of metrics.jsonl: a validation row (val/reward) is not a step, step 0's (run
    before any training) included, and a step's later row (the last step's validation and checkpoint phases,
    written after the loop) is not a second one."""
    out = {}
    for r in rows:
        if r.get("step", 0) > 0 and "val/reward" not in r:
            out.setdefault(r["step"], r)
    return list(out.values())


def trained(box, name, env=None):
    """launch() that must train: exit 0, --max_steps training steps, each with a finite loss and gradient norm.
    -> (the training rows of its metrics.jsonl, its output); else an error with the output's tail."""
    import train
    rc, log = launch(box, name, env)
    if rc != 0:
        raise RuntimeError(f"train.py {' '.join(RUNS[name])} exited {rc}: {log[-3000:]}")
    rows = training_rows([json.loads(line) for line in open(os.path.join(box.out, name, "metrics.jsonl"))])
    want = train.parse_args(RUNS[name]).max_steps
    assert [r["step"] for r in rows] == list(range(1, want + 1)), ([r["step"] for r in rows], want)
    bad = [r["step"] for r in rows
           if not all(math.isfinite(r.get(k, math.nan)) for k in ("train/loss", "train/grad_norm"))]
    assert not bad, f"steps {bad}: loss or gradient norm not finite"
    return rows, log


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
    import psutil

    import planner
    import tiny
    import train
    rows, _ = trained(box, "production")
    args = train.parse_args(RUNS["production"])
    args.model = tiny.ensure_default()[0]
    cluster = planner.Cluster(1, 1, torch.cuda.get_device_properties(0).total_memory / GB,
                              psutil.virtual_memory().total / GB)
    return {"steps": len(rows), "phases": plan_vs_measured(planner.plan(args, cluster), rows[-1])}


@item
def lora_sync_merged(box):
    """--use_peft --lora_sync merged in bf16 under the launcher, two steps with sleep level 1 and the reference
    as the base model with the adapter off (--beta 0.04): W + scale B A sent bucket by bucket, plain vLLM layers."""
    return lora_run(box, "lora_merged")


def lora_run(box, name):
    """A LoRA item's run -> its steps, losses and the megabytes each sync sent."""
    need_vllm()
    rows, _ = trained(box, name)
    return {"steps": len(rows), "losses": [r["train/loss"] for r in rows],
            "sync_sent_mb": [r.get("sync/sent_mb") for r in rows]}


@item
def lora_sync_adapter(box):
    """--use_peft --lora_sync adapter in bf16, as lora_sync_merged: the base weights once, then the adapter alone
    into vLLM's LoRA layers, whose Punica kernels warm up on a dummy LoRA at engine start and take bf16 or fp16
    only (--no-bf16 is refused on CUDA: rollout.engine_kwargs)."""
    return lora_run(box, "lora_adapter")


@item
def frozen_vision_tower_offload(box):
    """--freeze_vision_tower with the during-rollout lever that works beside frozen parameters, --offload_optimizer
    (--zero_offload none): two steps; and --offload_model beside the frozen tower refused by train.py with a line
    that names it (DeepSpeed 0.19.8's offload_states sizes its buffer from the trainable parameters only)."""
    need_vllm()
    rows, _ = trained(box, "frozen_tower")
    rc, log = launch(box, "frozen_tower_offload_model")
    said = refusals(log, "--offload_model")
    assert rc != 0 and said, f"--offload_model beside a frozen tower: exit {rc}, no error naming it: {log[-2000:]}"
    return {"steps": len(rows), "offload_freed_gb": [r.get("offload/freed_gb") for r in rows],
            "offload_model_refused": said[0][:300]}


@item
def qwen3_5_training_and_vllm(box):
    """The tiny Qwen3.5 (Gated DeltaNet and gated attention layers) under the launcher, two bf16 steps with sleep
    level 1: vLLM's GDN kernels in generation (the prefill kernel it chose is reported) and transformers' in
    training, which must not fall back to its PyTorch reference code. FlashInfer's prefill kernel JIT-compiles on
    first use; --vllm_gdn_prefill_backend triton avoids it."""
    need_vllm()
    try:
        rows, log = trained(box, "qwen3_5", env={"VLLM_LOGGING_LEVEL": "INFO"})   # INFO: vLLM's kernel choice
    except RuntimeError as e:
        if "flashinfer" in str(e).lower():
            raise RuntimeError(f"{e}\n(FlashInfer's GDN prefill JIT-compiles on first use and may need a CUDA "
                               f"toolkit: --vllm_gdn_prefill_backend triton avoids it)") from e
        raise
    fallback = sorted({line.strip() for line in log.splitlines() if FALLBACK_WARNING in line})
    assert not fallback, fallback
    return {"steps": len(rows), "losses": [r["train/loss"] for r in rows],
            "vllm_gdn_prefill": sorted(set(re.findall(r"Using [^\n]*? GDN prefill kernel[^\n]*", log))),
            "training_kernels": [line.strip() for line in log.splitlines()
                                 if "linear attention in training" in line][:1]}   # the set-up log's line


@item
def tools_multi_turn(box):
    """--tools on this GPU: the zoom task in bf16 with sleep level 1 under the launcher, two steps: every live
    trajectory a turn per generate call, the crop's image back into vLLM between turns (its processor cache sized
    for a step), the multi-turn log-probs in training. Fails unless every step's trajectories called the tool and
    took a second turn (tools/turns_max 2)."""
    need_vllm()
    rows, _ = trained(box, "tools")
    figures = {k: [r.get(k) for r in rows] for k in ("tools/calls_mean", "tools/failure_frac", "tools/turns_max",
                                                      "rollout/logp_diff_max", "train/loss")}
    assert all(r["tools/turns_max"] == 2 and r["tools/calls_mean"] > 0 for r in rows), figures
    return {"steps": len(rows), **figures}


@item
def video_with_vllm(box):
    """Videos on this GPU: the motion task (one video a prompt, data.load_video) under the launcher, two steps in
    bf16 and two in fp32 with sleep level 1: vLLM's video path beside training's M-RoPE positions of the same frames
    (model.rope_index). Fails unless both train and the fp32 run's vLLM and trainer log-probs agree within 1e-3;
    bf16's gap is reported."""
    need_vllm()
    out = {}
    for name in ("video", "video_fp32"):
        rows, _ = trained(box, name)
        out[name] = {k: [r.get(k) for r in rows] for k in ("rollout/logp_diff_max", "rollout/logp_diff_mean",
                                                           "train/loss")}
    assert max(out["video_fp32"]["rollout/logp_diff_max"]) <= 1e-3, out
    return out


# routing_replay's runs: the tiny mixture-of-experts families in bf16 under the launcher, each with and without
# --routing_replay (tests/test_moe.py parses them). Every completion must end by a stop token, as a real model's do:
# only then does the last one to finish leave a batch that vLLM's async scheduling had already queued, the case that
# crashed the second step (rollout.engine_kwargs turns async scheduling off). At 8,192 tokens the chance that one of a
# step's completions runs to its end is below 1e-4 (tests/test_moe.py); micro-batches of 4 keep the plan in hand.
REPLAY_MAX_TOKENS = 8192
ROUTING_REPLAY_RUNS = {f"{arch}{'_replay' if on else ''}": ["--bf16", "--tiny_arch", arch, "--max_completion_length",
                                                              str(REPLAY_MAX_TOKENS),
                                                              "--per_device_train_batch_size", "4",
                                                              *(["--routing_replay"] if on else []), *SHORT]
                       for arch in ("qwen3_vl_moe", "qwen3_5_moe") for on in (False, True)}


@item
def routing_replay(box):
    """--routing_replay on the tiny Qwen3-VL-MoE and Qwen3.5-MoE in bf16 under the launcher, each beside the same run
    without it: vLLM returns each completion's routed experts and the update's forward replays them; each step's
    rollout/logp_diff_max and _mean are reported both ways. Fails if a run does not train, if the replay does not cut
    the first step's rollout/logp_diff_max by REPLAY_CUT (replay_verdict), or if a first-step completion ran to its
    length instead of ending by a stop token (then the queued-batch case went untested)."""
    need_vllm()
    import train
    out = {}
    for name, flags in ROUTING_REPLAY_RUNS.items():
        run_dir = os.path.join(box.out, f"routing_replay_{name}")
        r = subprocess.run(launch_command(run_dir, flags, free_port()), capture_output=True, text=True, timeout=900,
                           cwd=ROOT)
        with open(f"{run_dir}.log", "w") as f:
            f.write(r.stdout + r.stderr)
        if r.returncode != 0:
            raise RuntimeError(f"train.py {' '.join(flags)} exited {r.returncode}: {(r.stdout + r.stderr)[-3000:]}")
        rows = training_rows([json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))])
        assert len(rows) == train.parse_args(flags).max_steps and all(math.isfinite(r["train/loss"]) for r in rows)
        out[name] = {k: [r[f"rollout/logp_diff_{k}"] for r in rows] for k in ("max", "mean")}
        out[name]["truncated"] = [r["completion/truncated"] for r in rows]
        assert rows[0]["completion/truncated"] == 0, f"{name}: {rows[0]['completion/truncated']:.2%} of step 1's " \
            f"completions ran to --max_completion_length {REPLAY_MAX_TOKENS} (the queued-batch case needs stop tokens)"
    for arch in ("qwen3_vl_moe", "qwen3_5_moe"):
        why = replay_verdict(out[arch]["max"][0], out[f"{arch}_replay"]["max"][0])
        assert why is None, f"{arch}: {why}"
    return out


# The factor by which --routing_replay must cut the first step's largest gap between vLLM's and the trainer's
# log-probs against the same run without it: a replay that does nothing is never further off than none.
REPLAY_CUT = 2.0


def replay_verdict(without, replay, cut=REPLAY_CUT):
    """The first step's rollout/logp_diff_max without and with --routing_replay -> None when the replay cut it by
    `cut` or more, else why not (a run without a gap to cut shows nothing either)."""
    if without <= 0:
        return f"rollout/logp_diff_max {without:.3g} without the replay: no gap to cut, the check shows nothing"
    if replay * cut <= without:
        return None
    return (f"rollout/logp_diff_max {replay:.3g} replayed against {without:.3g} without: cut "
            f"{without / replay:.3g}x, REPLAY_CUT asks {cut:g}x")


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
    out = {}
    for level, dtype in ((1, "float32"), (2, "float32"), (2, "bfloat16")):
        path = os.path.join(box.out, f"vllm_level{level}_{dtype}.json")
        r = subprocess.run([sys.executable, __file__, "--vllm_case", str(level), dtype, "--out", box.out,
                            "--model", box.model], capture_output=True, text=True, timeout=600,
                           env=dict(os.environ, MASTER_PORT=str(free_port())))
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
    sampling = grpo.Sampling(temperature=0.9, banned=box.sampling.banned)
    sps = [rollout.sampling_params(sampling, n=4, max_tokens=8, logprobs=0, seed=i) for i in range(len(box.samples))]
    reqs = [data.vllm_request(s) for s in box.samples]
    comps = [c for o in rollout.generate(llm, reqs, sps) for c in o.outputs]
    seqs = [s for s in box.samples for _ in range(4)]
    batch = data.collate(seqs, [list(c.token_ids) for c in comps], box.processor.tokenizer.pad_token_id,
                         box.banned.tolist())
    with torch.no_grad():
        logps = model(**{k: v.cuda() for k, v in batch.items()}, sampling=sampling).logps
    C = batch["completion_mask"].shape[1]   # completions right-aligned (data.collate)
    diff = max(abs(logps[i, C - len(c.logprobs) + t].item() - next(iter(d.values())).logprob)
               for i, c in enumerate(comps) for t, d in enumerate(c.logprobs))
    return {"logp_diff_max": diff, "device_gb_awake": awake, "device_gb_asleep": asleep,
            "sleep_freed_gb": awake - asleep,
            "gc_empty_cache_freed_gb": freed / GB, "torch_threads_after_engine_start": threads}


# (top_k, top_p) pairs: the nucleus alone, top-k alone, both (top-k first, then the nucleus of the rest: vLLM's order)
TRUNCATIONS = ((0, 0.9), (0, 0.5), (5, 1.0), (5, 0.8), (50, 0.95))


def sampler_agreement(box, llm, model, device, truncations=TRUNCATIONS, n=8, max_tokens=8):
    """vLLM's processed log-prob of each token it sampled under top-k / top-p against the trainer's log-prob of the
    same token under the same grpo.Sampling record, truncated as the trainer mirrors the sampler (logps - log_kept)
    -> per (top_k, top_p) the largest and mean gap and the tokens compared. `model` on `device`, eval."""
    import data
    import rollout
    out = {}
    reqs = [data.vllm_request(s) for s in box.samples]
    for top_k, top_p in truncations:
        sampling = grpo.Sampling(temperature=0.9, top_k=top_k, top_p=top_p, banned=box.sampling.banned)
        sps = [rollout.sampling_params(sampling, n=n, max_tokens=max_tokens, logprobs=0, seed=100 + i)
               for i in range(len(reqs))]
        comps = [c for o in rollout.generate(llm, reqs, sps) for c in o.outputs]
        seqs = [s for s in box.samples for _ in range(n)]
        batch = data.collate(seqs, [list(c.token_ids) for c in comps], box.processor.tokenizer.pad_token_id,
                             box.banned.tolist())
        with torch.no_grad():
            ts = model(**{k: v.to(device) for k, v in batch.items()}, sampling=sampling, with_kept=True)
        mine = (ts.logps - ts.log_kept).float().cpu()                                        # (B, C)
        C = mine.shape[1]   # completions right-aligned (data.collate)
        gaps = [abs(mine[i, C - len(c.logprobs) + t].item() - next(iter(d.values())).logprob)
                for i, c in enumerate(comps) for t, d in enumerate(c.logprobs)]
        out[f"top_k={top_k},top_p={top_p}"] = {"logp_diff_max": max(gaps), "logp_diff_mean": sum(gaps) / len(gaps),
                                               "tokens": len(gaps)}
    return out


def sampler_case(box, dtype):
    """In a fresh process (one engine per process, as vllm_case): the engine and the trainer's model of box.model in
    `dtype` on this GPU, the same weights from the same checkpoint -> sampler_agreement's figures."""
    import rollout
    args = argparse.Namespace(**{**vars(box.args), "sleep_level": 0, "vllm_gpu_memory_utilization": 0.3})
    llm = rollout.create_engine(box.model, args, dtype, 64, 0)
    model = policy_model.load_model(box.model, args, getattr(torch, dtype)).cuda().eval()
    return sampler_agreement(box, llm, model, "cuda")


@item
def sampler_top_k_top_p(box):
    """Top-k and top-p on vLLM's GPU sampler (a Triton pivot search, not the sort grpo._log_kept mirrors): for each
    truncation of TRUNCATIONS, vLLM's processed log-prob of every token it drew against the trainer's truncated
    log-prob of it at the same weights, fp32 asserted (1e-4), bf16 reported. A kept set that differs between the two
    (a tie or a rounding at the cut) shows as a gap."""
    need_vllm()
    out = {}
    for dtype in ("float32", "bfloat16"):
        path = os.path.join(box.out, f"sampler_{dtype}.json")
        r = subprocess.run([sys.executable, __file__, "--sampler_case", dtype, "--out", box.out, "--model", box.model],
                           capture_output=True, text=True, timeout=600,
                           env=dict(os.environ, MASTER_PORT=str(free_port())))
        if r.returncode != 0:
            raise RuntimeError(f"{dtype}: {(r.stdout + r.stderr)[-2000:]}")
        out[dtype] = json.load(open(path))
    bad = {k: f for k, f in out["float32"].items() if f["logp_diff_max"] > 1e-4}
    assert not bad, bad
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model dir; default: the embedded tiny model")
    p.add_argument("--out", default="runs/gpu-check", help="report.json goes here")
    p.add_argument("--only", nargs="*", default=None, help="run these items only")
    p.add_argument("--list", action="store_true", help="print the items, one line each, and exit")
    p.add_argument("--dev", default="/dev", help=argparse.SUPPRESS)   # where find_gpu looks for nvidia0 (tests: a fake)
    p.add_argument("--vllm_case", nargs=2, default=None, help=argparse.SUPPRESS)   # LEVEL DTYPE, in a fresh process
    p.add_argument("--sampler_case", default=None, help=argparse.SUPPRESS)   # DTYPE, in a fresh process
    a = p.parse_args(argv)
    if a.list:
        for name, fn in ITEMS.items():
            print(f"{name}: {' '.join((fn.__doc__ or '').split())}")
        return 0
    if set(a.only or ()) - set(ITEMS):
        p.error(f"--only {sorted(set(a.only) - set(ITEMS))}: no such item; --list shows them")
    os.makedirs(a.out, exist_ok=True)
    report = {"device": None, "items": {}}
    if not torch.cuda.is_available():
        gpu = find_gpu(a.dev)
        why = "this interpreter's torch cannot use the GPU" if gpu else "no GPU on this machine"
        report["device"] = f"a GPU ({gpu}) that {sys.executable} cannot use: {why_no_cuda()}" if gpu else "no GPU"
        report["items"] = {name: {"status": "skipped", "why": why} for name in ITEMS}
        json.dump(report, open(os.path.join(a.out, "report.json"), "w"), indent=1)
        if gpu:
            print(f"[gpu-check] FAIL: this machine has an NVIDIA GPU ({gpu}), but {sys.executable} runs "
                  f"{why_no_cuda()}.\n  Run the check with the GPU stack's interpreter (pip install -r "
                  f"requirements.txt there: docs/verification.md): make gpu-check GPU_PY=/path/to/gpu-env/bin/python"
                  f"\n  (the Makefile takes .venv, the CPU stack of `make test`, when it exists)", flush=True)
            return 2
        print("[gpu-check] no GPU here: nothing to check (the non-GPU parts are covered by `make test`)")
        return 0
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29591"))
    import deepspeed
    deepspeed.init_distributed()
    report["device"] = torch.cuda.get_device_name(0)
    box = Box(a.model, a.out)
    if a.sampler_case:
        json.dump(sampler_case(box, a.sampler_case), open(os.path.join(a.out, f"sampler_{a.sampler_case}.json"), "w"))
        return 0
    if a.vllm_case:
        level, dtype = int(a.vllm_case[0]), a.vllm_case[1]
        json.dump(vllm_case(box, level, dtype), open(os.path.join(a.out, f"vllm_level{level}_{dtype}.json"), "w"))
        return 0
    failed = run_items({k: ITEMS[k] for k in run_order(a.only)}, box, report, a.out)
    print(f"[gpu-check] report: {os.path.join(a.out, 'report.json')}")
    return 1 if failed else 0


def run_order(only=None):
    """The names of ITEMS (or of `only`'s) in the order they run: those of RUN_LAST at the end."""
    return sorted((k for k in ITEMS if not only or k in only), key=lambda k: k in RUN_LAST)   # stable sort


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
