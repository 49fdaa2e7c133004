#!/usr/bin/env bash
# VLM-R1-style referring expression comprehension (RefCOCO/+/g, IoU reward), Qwen2.5-VL-3B,
# 8x A100/H100 80GB, num_generations 7. Data: VLM-R1's REC JSONL (conversations layout, box as
# solution) with COCO train2014 images under --image_root. The IoU is taken in the coordinates of
# the downscaled image the model sees (reward.py rescales the ground truth).
# 56 prompts / 8 GPUs = 7 prompts x 7 generations = 49 sequences per GPU = 7 micro-batches of 7.
deepspeed --num_gpus 8 train.py \
    --model Qwen/Qwen2.5-VL-3B-Instruct \
    --train_data data/rec/refcoco_train.jsonl \
    --val_data data/rec/refcoco_val.jsonl \
    --image_root data/coco/train2014 \
    --output_dir runs/vlm_r1_rec_3b \
    --reward_funcs iou format \
    --num_generations 7 \
    --rollout_batch_size 56 \
    --per_device_train_batch_size 7 \
    --max_prompt_length 1024 \
    --max_completion_length 512 \
    --learning_rate 1e-6 \
    --beta 0.04 \
    --bf16 \
    --gradient_checkpointing \
    --vllm_gpu_memory_utilization 0.4 \
    --sleep_level 1 \
    --max_pixels 401408 \
    --limit_images 1 \
    --save_steps 100 \
    --report_to wandb --run_name vlm_r1_rec_3b
