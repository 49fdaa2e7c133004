"""A teacher for `make demo TASK=distill` (docs/demos.md): the embedded tiny colour model taught the task by
supervised fine-tuning on its gold answers, or with --untaught the same family at a random init of another seed,
saved as an HF folder that --teacher_model loads. The folder is a copy of the student's (the demo's own tiny model,
tiny.ensure_default), its weights replaced: the same config, tokenizer, processor and token ids. The prompts and
images are the launch's own (flags.parse_args and data.prepare, as the tiny defaults set them).

    OMP_NUM_THREADS=1 .venv/bin/python tools/teach.py --out runs/teacher-taught [--untaught] [--arch qwen3_vl]
Prints the teacher's greedy accuracy on the task's validation images (chance 0.25) and writes OUT/done."""
import argparse
import glob
import os
import random
import shutil
import sys
import tempfile

import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import data  # noqa: E402
import flags  # noqa: E402
import model as model_py  # noqa: E402
import reward  # noqa: E402
import tiny  # noqa: E402


def demo_args(arch):
    """The colour demo's args (no --model: the tiny defaults), its model and task files filled in."""
    args = flags.parse_args(["--tiny_arch", arch])
    args.model, args.train_data, args.val_data = tiny.ensure_default(os.path.join(ROOT, ".cache", "tiny"), arch=arch)
    return args


def samples(path, proc, args):
    """Every row of a task file, prepared as the launch prepares it (data.prepare)."""
    rows = data.Rows(path)
    return [data.prepare(rows[i], proc, args) for i in range(len(rows))]


def greedy_accuracy(model, proc, prepared):
    """The mean accuracy reward of the greedy first token after each prompt (the demo's answers are one token)."""
    hf = {k: torch.cat([s["hf"][k] for s in prepared]) for k in prepared[0]["hf"]}   # one length: no padding
    with torch.no_grad():
        ids = model(**hf).logits[:, -1].argmax(-1)   # (N,)
    answers = proc.tokenizer.batch_decode(ids[:, None])
    return sum(reward.accuracy(answers, [s["columns"]["solution"] for s in prepared])) / len(prepared)


def taught_batch(picks, tails):
    """Prepared samples -> (inputs, labels): each prompt (its data.prepare tensors) followed by the ids of its gold
    answer and <|im_end|> (`tails`: {answer: ids}), the prompt masked; what the processor makes of the same texts and
    images, without processing them again. One tail length: the demo's answers are one token."""
    tail = [tails[s["columns"]["solution"]] for s in picks]
    if len({len(t) for t in tail}) > 1:
        raise ValueError(f"teach: answers of {sorted({len(t) for t in tail})} tokens; the demo's are one token each")
    hf = [s["hf"] for s in picks]
    ids = torch.cat([torch.cat([h["input_ids"], torch.tensor([t])], 1) for h, t in zip(hf, tail)])   # (B, P + A)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "mm_token_type_ids": torch.nn.functional.pad(torch.cat([h["mm_token_type_ids"] for h in hf]),
                                                           (0, len(tail[0]))),
              "pixel_values": torch.cat([h["pixel_values"] for h in hf]),
              "image_grid_thw": torch.cat([h["image_grid_thw"] for h in hf])}
    labels = ids.clone()
    labels[:, :hf[0]["input_ids"].shape[1]] = -100
    return inputs, labels


def teach(out, arch="qwen2_5_vl", untaught=False, steps=500, batch=16, lr=1e-3, seed=0):
    """Write the teacher to `out` (the student's folder, its weights taught or re-drawn) -> its greedy accuracy on
    the validation images."""
    args = demo_args(arch)
    proc = AutoProcessor.from_pretrained(args.model)
    torch.manual_seed(seed + 1 if untaught else seed)
    if untaught:   # build_model's init, another seed
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(args.model)).to(torch.float32)
    else:
        model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.float32)
        train, rng = samples(args.train_data, proc, args), random.Random(seed)
        tails = {a: proc.tokenizer(a + "<|im_end|>", add_special_tokens=False)["input_ids"]
                 for a in {s["columns"]["solution"] for s in train}}
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        for _ in range(steps):   # next-token loss on the answers, as tiny.supervised_step
            inputs, labels = taught_batch(rng.sample(train, batch), tails)
            model(**inputs, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()
    model.eval()
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(args.model, out, ignore=shutil.ignore_patterns("*.safetensors*"))   # all but the weights
    with tempfile.TemporaryDirectory() as tmp:
        model_py.save_published_layout(model).save_pretrained(tmp, safe_serialization=True)   # as build_model saves
        for f in glob.glob(os.path.join(tmp, "*.safetensors*")):
            shutil.copy(f, out)
    return greedy_accuracy(model, proc, samples(args.val_data, proc, args))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the teacher's folder (replaced)")
    p.add_argument("--arch", default="qwen2_5_vl", choices=tiny.ARCHS, help="the student's family (--tiny_arch)")
    p.add_argument("--untaught", action="store_true", help="a random init of another seed, not taught (the control)")
    p.add_argument("--steps", type=int, default=500, help="supervised steps")
    p.add_argument("--batch", type=int, default=16, help="labelled images a step")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
    p.add_argument("--seed", type=int, default=0, help="the order of the images (and the untaught init: seed + 1)")
    a = p.parse_args()
    acc = teach(a.out, a.arch, a.untaught, a.steps, a.batch, a.lr, a.seed)
    print(f"[teach] {a.out}: greedy validation accuracy {acc:.2f} (chance 0.25)")
    open(os.path.join(a.out, "done"), "w").close()
