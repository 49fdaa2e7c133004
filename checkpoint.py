"""Checkpoints: full state written atomically, found again, and an HF-format export.

A checkpoint is output_dir/checkpoint-<step>: DeepSpeed's own save_checkpoint (ZeRO-3 shards,
optimizer, scheduler) under zero/, one rank<r>.pt per rank (RNG states, data position) and
trainer_state.json (step, flags, wandb run id). It is written as checkpoint-<step>.tmp and
renamed last, so a crash mid-save never leaves a directory that resume would take as complete.
"""
import json
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist


def rng_state():
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st):
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st:
        torch.cuda.set_rng_state_all(st["cuda"])


def save_checkpoint(engine, args, step, stream, run_id, rank):
    """Full state in output_dir/checkpoint-<step>: ZeRO-3 shards with optimizer and scheduler
    (DeepSpeed's save_checkpoint), every rank's RNG and data position, step, flags, wandb id.
    Written to checkpoint-<step>.tmp and renamed last, so a crash mid-save never leaves a
    directory that resume would pick as complete."""
    final = os.path.join(args.output_dir, f"checkpoint-{step}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    engine.save_checkpoint(tmp, tag="zero")
    torch.save({"rng": rng_state(), "stream": stream.state()}, os.path.join(tmp, f"rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({"step": step, "wandb_id": run_id, "args": vars(args)}, f, indent=1)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)   # the commit point
        for old in list_checkpoints(args.output_dir)[:-args.save_total_limit or None]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def list_checkpoints(output_dir):
    """Complete checkpoints (renamed from .tmp, with trainer_state.json), oldest first."""
    found = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        if m and os.path.exists(os.path.join(output_dir, name, "trainer_state.json")):
            found.append((int(m.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]


def export_model(engine, processor, out_dir, master):
    """HF-format model (safetensors + processor + chat template) that transformers and vLLM load.
    The full state dict is gathered from the ZeRO-3 shards onto rank 0 (a collective)."""
    state_dict = engine._zero3_consolidated_16bit_state_dict()
    if master:
        engine.module.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
        processor.save_pretrained(out_dir)
    dist.barrier()
