#!/usr/bin/env bash
# The ms-swift-style recipe that fits Qwen2.5-VL-3B GRPO on 4 GPUs that OOM otherwise: vLLM at
# 0.5 of the GPU and asleep (level 1) between rollouts, trainer states offloaded during rollout,
# gc after every offload, at most 2 images per prompt, per-device batch 2, bf16, ZeRO-3.
# Gradient accumulation 4: 4 prompts / 4 GPUs = 1 prompt x 8 generations = 8 sequences per GPU
# = 4 micro-batches of 2 per optimizer step.
deepspeed --num_gpus 4 train.py \
    --model Qwen/Qwen2.5-VL-3B-Instruct \
    --train_data data/train.jsonl \
    --val_data data/val.jsonl \
    --output_dir runs/swift_3b_4gpu \
    --reward_funcs accuracy format \
    --num_generations 8 \
    --rollout_batch_size 4 \
    --per_device_train_batch_size 2 \
    --max_completion_length 1024 \
    --learning_rate 1e-6 \
    --bf16 \
    --vllm_gpu_memory_utilization 0.5 \
    --sleep_level 1 \
    --offload_optimizer \
    --offload_model \
    --gc_collect_after_offload \
    --limit_images 2 \
    --report_to wandb --run_name swift_3b_4gpu
