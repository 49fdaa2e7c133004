#!/usr/bin/env bash
# Visual math (geometry3k / R1-V style: {"image", "problem", "solution"}), accuracy checked with
# math-verify plus the think/answer format reward, Qwen2.5-VL-7B on 8x 80GB GPUs.
# 32 prompts / 8 GPUs = 4 prompts x 8 generations = 32 sequences per GPU = 4 micro-batches of 8.
deepspeed --num_gpus 8 train.py \
    --model Qwen/Qwen2.5-VL-7B-Instruct \
    --train_data data/geometry3k/train.parquet \
    --val_data data/geometry3k/test.parquet \
    --output_dir runs/geo3k_math_7b \
    --reward_funcs accuracy format \
    --reward_weights 1.0 0.5 \
    --num_generations 8 \
    --rollout_batch_size 32 \
    --per_device_train_batch_size 8 \
    --max_completion_length 1024 \
    --learning_rate 1e-6 \
    --beta 0.0 \
    --epsilon_high 0.28 \
    --bf16 \
    --vllm_gpu_memory_utilization 0.5 \
    --sleep_level 1 \
    --max_pixels 1003520 \
    --save_steps 50 \
    --report_to wandb --run_name geo3k_math_7b
