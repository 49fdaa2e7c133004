"""Can a model of this size read where the grounding task's square is at all? Supervised on the
TRUE boxes (no RL), greedy IoU on 32 validation images every 100 steps. A size that cannot learn
a layout even when told the boxes is not worth a GRPO run on it (docs/demos.md, the grounding demo).

    OMP_NUM_THREADS=2 .venv/bin/python tools/grounding_probe.py --size small --steps 400
--shift 3: the square sits 0-3 pixels into its patch (16 positions per patch), not at the
embedded task's one position per patch (4 possible boxes)."""
import argparse
import json
import os
import random
import sys
import tempfile

import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import reward  # noqa: E402
import tiny  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", choices=sorted(tiny.SIZES))
    p.add_argument("--shift", type=int, default=0, help="0: the embedded task's 4 boxes; 3: shifted 0-3 pixels")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--lr", type=float, default=1e-3)
    a = p.parse_args()
    from transformers import AutoModelForImageTextToText, AutoProcessor
    root = tempfile.mkdtemp(prefix="probe-")
    tiny.build_grounding_task(os.path.join(root, "task"), shift=a.shift)
    tiny.build_model(os.path.join(root, "model"), extra_words=tiny.GROUNDING_WORDS, size=a.size)
    proc = AutoProcessor.from_pretrained(os.path.join(root, "model"))
    model = AutoModelForImageTextToText.from_pretrained(os.path.join(root, "model"), dtype=torch.float32)
    load = lambda split: [json.loads(line) for line in open(os.path.join(root, "task", f"{split}.jsonl"))]  # noqa: E731
    image = lambda r: Image.open(os.path.join(root, "task", r["image"])).convert("RGB")  # noqa: E731
    train, val = load("train"), load("val")[:32]
    prompt, n_prompt = tiny.box_prompt(proc)
    rng, _ = random.Random(0), torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    for step in range(a.steps + 1):
        if step % 100 == 0:
            model.eval()
            with torch.no_grad():
                ious = []
                for r in val:
                    enc = proc(text=[prompt], images=[image(r)], return_tensors="pt")
                    out = model.generate(**enc, do_sample=False, max_new_tokens=14)
                    ious += reward.iou(proc.batch_decode(out[:, n_prompt:], skip_special_tokens=True), [r["solution"]])
            print(f"step {step}: greedy IoU {sum(ious) / len(ious):.2f}", flush=True)
            model.train()
        picks = rng.sample(train, 16)
        tiny.supervised_step(model, proc, opt, prompt, n_prompt, [image(r) for r in picks],
                             [tiny.box_text(r["solution"]) for r in picks])


if __name__ == "__main__":
    main()
