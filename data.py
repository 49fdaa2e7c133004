"""Data: samples -> the same downscaled images for vLLM and for training, and micro-batches.

Accepted sources (`--train_data`, `--val_data`):
- JSONL, one sample per line: {"image": "a.png" | ["a.png", "b.png"], "question": "...",
  "solution": "..."}; image paths relative to `--image_root` (default: the JSONL's folder);
- the VLM-R1 layout: {"image": ..., "conversations": [{"from": "human", "value": "<image>..."},
  {"from": "gpt", "value": "<answer>"}]}, and R1-V's {"problem", "solution"};
- a Hugging Face `datasets` directory (save_to_disk) or a parquet file with an image column
  (decoded images or {"bytes", "path"}), loaded from disk.
`--columns question=query solution=answer image=img` maps other column names onto ours. Every
other field is passed to the reward functions. Anything unusable (a bad line, a missing or
corrupt image, too many images, a prompt longer than --max_prompt_length) is reported with its
file and line (or row), counted, and skipped; prompts are never cut. A sample without an image is a
text-only prompt (mixed freely with image samples; train.py keeps ZeRO-3's vision-tower calls in
step on every rank). Left out: video, streaming.
"""
import contextlib
import io
import json
import math
import os
import sys

import numpy as np
import torch
from PIL import Image, ImageOps
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from model import image_grid


# ----------------------------------------------------------------------------- images
def downscale(img, min_pixels, max_pixels, factor):
    """Resize to the nearest (h, w) on the `factor` grid (model.image_grid: 28 px for Qwen2.5-VL, 32 for
    Qwen3-VL and Qwen3.5) with min_pixels <= h*w <= max_pixels, as the model's processor would."""
    h, w = smart_resize(img.height, img.width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    return img if (w, h) == img.size else img.resize((w, h), Image.BICUBIC)


def pixel_bounds(args, processor):
    """-> (min_pixels, max_pixels) of this run: the flags, or by default the processor's own minimum and
    flags.IMAGE_TOKENS merged tokens on the model's grid. Refused (SystemExit) outside the processor's
    bounds: it would resize the images again, and vLLM and training would see other pixels."""
    from flags import IMAGE_TOKENS
    size, grid = processor.image_processor.size, image_grid(processor)
    lo = size["shortest_edge"] if args.min_pixels is None else args.min_pixels
    hi = min(IMAGE_TOKENS * grid ** 2, size["longest_edge"]) if args.max_pixels is None else args.max_pixels
    if hi > size["longest_edge"] or lo < size["shortest_edge"] or lo > hi:
        sys.exit(f"error: --min_pixels/--max_pixels {lo}/{hi} lie outside the processor's {size['shortest_edge']}/"
                 f"{size['longest_edge']} (or min > max): it would resize again")
    return lo, hi


def load_image(source, min_pixels, max_pixels, factor, name=None):
    """Open, fix EXIF orientation and mode (RGBA on white, 16-bit scaled to 8), downscale once onto
    the model's `factor`-pixel grid.

    source: a path, the encoded bytes, or a PIL image (HF datasets decode images themselves).
    Raises ValueError naming the file (or `name`) for anything unreadable (missing, corrupt, a
    decompression bomb past PIL's limit)."""
    name = name or str(source)
    try:
        opened = not isinstance(source, Image.Image)
        im = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) if opened else source
        with im if opened else contextlib.nullcontext(im):
            size = im.size[::-1] if im.getexif().get(0x0112, 1) in (5, 6, 7, 8) else im.size  # as seen upright
            im.draft("RGB", (int(max_pixels ** 0.5) * 2,) * 2)  # JPEG: decode huge images at reduced size
            im = ImageOps.exif_transpose(im)
            if im.mode in ("F", "I"):   # 32-bit float or int (TIFF): scaled to 8 bits only where that is faithful
                lo, hi = im.getextrema()
                scale = {"F": 255.0 if hi <= 1.0 else 1.0 if hi <= 255.0 else None,
                         "I": 1 / 256 if hi > 255 else 1.0}[im.mode] if lo >= 0 and hi <= 65535 else None
                if scale is None or not math.isfinite(lo + hi):
                    raise ValueError(f"{im.mode} image with values {lo}..{hi}: no faithful 8-bit conversion (a float image "
                                     f"must hold 0..1 or 0..255, an int image 0..65535)")
                im = im.point(lambda v: v * scale).convert("L")
            if im.mode in ("I;16", "I;16B", "I;16L"):
                im = im.point(lambda v: v / 256).convert("L")    # 16-bit -> 8-bit, keep the range
            if im.mode in ("RGBA", "LA", "P", "PA"):
                im = im.convert("RGBA")
                bg = Image.new("RGBA", im.size, (255, 255, 255, 255))
                im = Image.alpha_composite(bg, im)
            im = im.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"image {name}: {type(e).__name__}: {e}") from None
    out = downscale(im, min_pixels, max_pixels, factor)
    out.info["original_size"] = size   # (w, h): box rewards rescale ground truth to out.size
    return out




def read_jsonl(path):
    """Rows of a JSONL file; a bad line is reported with its line number and skipped."""
    rows = []
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig").strip()   # -sig: a byte-order mark (Windows editors) is not JSON
                if not line:
                    continue
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(f"a JSON {type(row).__name__}, not an object {{...}}")
                rows.append(dict(row, _where=f"{path}:{i}", _id=len(rows)))
            except (UnicodeDecodeError, ValueError) as e:   # json.JSONDecodeError is a ValueError
                print(f"[data] {path}:{i}: skipped, {type(e).__name__}: {e}")
    if not rows:
        sys.exit(f"error: {path} has no usable samples")
    return rows


class Rows:
    """Random access to the samples of a JSONL, parquet or HF datasets source, normalised to our
    column names. HF rows are read (and their images decoded) only when asked for."""
    def __init__(self, path, columns=(), image_root=None):
        self.path, self.mapping = path, dict(c.split("=", 1) for c in columns)
        self.image_root = image_root or (path if os.path.isdir(path) else os.path.dirname(path))
        if os.path.isdir(path) or path.endswith(".parquet"):
            import datasets
            ds = datasets.load_from_disk(path) if os.path.isdir(path) else \
                datasets.load_dataset("parquet", data_files=path, split="train")
            self.rows = ds["train"] if isinstance(ds, datasets.DatasetDict) else ds
            if len(self.rows) == 0:
                sys.exit(f"error: {path} has no usable samples")
        else:
            self.rows = read_jsonl(path)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = dict(self.rows[int(i)])
        row.setdefault("_where", f"{self.path}[{i}]")
        row["_id"] = int(i)   # the sample's stable id: its row in the source, the same on every rank and epoch
        for ours, theirs in self.mapping.items():
            if theirs in row:
                row[ours] = row.pop(theirs)
        if "conversations" in row and "question" not in row:   # VLM-R1 / LLaVA layout
            turns = row.pop("conversations")
            row["question"] = next(t["value"] for t in turns if t.get("from") in ("human", "user")).replace("<image>", "").strip()
            row.setdefault("solution", next((t["value"] for t in turns if t.get("from") in ("gpt", "assistant")), None))
        if "problem" in row and "question" not in row:         # R1-V / geometry3k layout
            row["question"] = row.pop("problem")
        row["_image_root"] = self.image_root
        return row


def prepare(row, processor, args):
    """One sample -> the same downscaled images for vLLM and for training. Raises ValueError
    naming the sample for anything that cannot be trained on."""
    where = row["_where"]
    images = row.get("image", row.get("images"))
    images = [] if images is None or images == "" else list(images) if isinstance(images, (list, tuple)) else [images]
    for im in images:   # a path, encoded bytes, a decoded image, or HF's {"bytes", "path"}
        if isinstance(im, bool) or not isinstance(im, (str, bytes, dict, Image.Image)):
            raise ValueError(f"{where}: image field holds {type(im).__name__} {im!r}; expected a path, a list of paths, "
                             f"or an HF datasets image")
        if isinstance(im, dict) and not im.get("bytes") and not im.get("path"):
            raise ValueError(f"{where}: image field holds {im!r}: an HF datasets image with neither bytes nor a path")
        if isinstance(im, str) and "://" in im:
            raise ValueError(f"{where}: image {im!r} is a URL; URLs are not fetched: download the images, give their paths")
    solution = row.get("solution")
    if isinstance(solution, float) and not math.isfinite(solution):
        raise ValueError(f"{where}: solution is {solution}, not a finite number (accuracy would score 'nan' right)")
    if len(images) > args.limit_images:
        raise ValueError(f"{where}: {len(images)} images > --limit_images {args.limit_images}")
    base = row.get("_image_root") or os.path.dirname(where.rsplit(":", 1)[0])

    def source(im):   # a path, or what HF datasets store: a decoded PIL image or {"bytes", "path"}
        if isinstance(im, dict):
            return im["bytes"] if im.get("bytes") else os.path.join(base, im["path"])
        return os.path.join(base, im) if isinstance(im, str) else im
    try:
        pil = [load_image(source(im), args.min_pixels, args.max_pixels, image_grid(processor),
                          name=source(im) if isinstance(im, str) else f"#{k}") for k, im in enumerate(images)]
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    try:
        question = args.question_template.format(**row)
    except (KeyError, IndexError) as e:
        raise ValueError(f"{where}: no field {e} that --question_template {args.question_template!r} needs; "
                         f"the sample has {sorted(k for k in row if not k.startswith('_'))}") from None
    content = [{"type": "image"} for _ in pil] + [{"type": "text", "text": question}]
    messages = ([{"role": "system", "content": args.system_prompt}] if args.system_prompt else []) + \
        [{"role": "user", "content": content}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    hf = processor(text=[text], images=pil or None, return_tensors="pt")
    if hf["input_ids"].shape[1] > args.max_prompt_length:
        raise ValueError(f"{where}: prompt has {hf['input_ids'].shape[1]} tokens (with image tokens) > "
                         f"--max_prompt_length {args.max_prompt_length}; raise it or lower --max_pixels")
    # vLLM takes ONE <|image_pad|> per image and expands it itself.
    vllm_ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    columns = {k: v for k, v in row.items() if k not in ("image", "images", "_where", "_image_root", "_id")}
    if pil:   # for box rewards: the ground truth is in original pixels, the model saw pil[0].size
        columns.setdefault("image_size", list(pil[0].info["original_size"]))
        columns.setdefault("seen_size", list(pil[0].size))
    # an image field present but empty (a parquet cell of None, "image": ""): trained text-only, and counted
    empty = not pil and any(k in row for k in ("image", "images"))
    return dict(images=pil, vllm_ids=vllm_ids, hf=hf, columns=columns, where=where, id=row.get("_id"), empty_image=empty)


class PromptStream:
    """This rank's endless, reproducible stream of prepared samples: epoch e is a seeded
    permutation, rank r reads every world-th entry. Bad samples are reported, counted, skipped.
    `history` maps a sample's id to its group's rewards the last time it was rolled out, on any rank
    (train.score keeps it; a curriculum in train.select_prompts reads it); it is checkpointed with
    the position."""
    def __init__(self, rows, processor, args, rank, world):
        self.rows, self.processor, self.args, self.rank, self.world = rows, processor, args, rank, world
        self.epoch, self.cursor, self.skipped, self.history, self.empty_images = 0, 0, 0, {}, 0

    def state(self):
        return {"epoch": self.epoch, "cursor": self.cursor, "skipped": self.skipped, "history": self.history,
                "empty_images": self.empty_images}

    def load(self, st):
        self.epoch, self.cursor, self.skipped = st["epoch"], st["cursor"], st["skipped"]
        self.history, self.empty_images = st.get("history", {}), st.get("empty_images", 0)

    def next(self, n):
        out = []
        while len(out) < n:
            order = np.random.default_rng(self.args.seed + self.epoch).permutation(len(self.rows))[self.rank::self.world]
            if self.cursor >= len(order):
                self.epoch, self.cursor = self.epoch + 1, 0
                continue
            row = self.rows[order[self.cursor]]
            self.cursor += 1
            try:
                out.append(prepare(row, self.processor, self.args))
                if out[-1]["empty_image"]:
                    self.empty_images += 1
                    if self.empty_images == 1:
                        print(f"[data] rank {self.rank}: {out[-1]['where']}: the image field is empty (None or \"\"): "
                              f"trained as a text-only prompt; such samples are counted in data/empty_images")
            except ValueError as e:
                if self.args.overlong_prompt == "error" and "--max_prompt_length" in str(e):
                    sys.exit(f"error: {e} (--overlong_prompt error)")
                self.skipped += 1
                print(f"[data] rank {self.rank}: skipped {e}")
                if self.skipped > 100 and self.skipped > 10 * len(out):
                    sys.exit(f"error: {self.skipped} samples skipped; check the data and the flags above")
        return out


def validation_samples(args, processor, rank, world):
    """This rank's share of --val_data (every world-th row), prepared once; bad rows skipped by name."""
    rows, out = Rows(args.val_data, args.columns, args.image_root), []
    for i in range(rank, len(rows), world):
        try:
            out.append(prepare(rows[i], processor, args))
        except ValueError as e:
            print(f"[data] validation: skipped {e}")
    return out


def reward_columns(samples):
    """The samples' fields as the reward functions take them: {field: [value per sample]}."""
    return {k: [s["columns"].get(k) for s in samples] for k in (samples[0]["columns"] if samples else {})}


def collate(samples, completions, pad_id, banned):
    """Left-pad each prompt + completion to the longest -> one micro-batch for the training forward.

    completions[i] (list of token ids) belongs to samples[i]. Returns tensors with input_ids (B, T),
    attention_mask (B, T), completion_mask (B, C): T the longest prompt + completion (not the longest
    prompt + the longest completion: length-sorted micro-batches pad little), C the longest completion.
    A row's completion fills its last len(completion) positions: every (B, C) tensor of the step
    (completion_mask, the sampler's and the trainer's log-probs) is right-aligned with input_ids[:, -C:]."""
    C = max(max(len(c) for c in completions), 1)
    T = max(s["hf"]["input_ids"].shape[1] + len(c) for s, c in zip(samples, completions))
    B = len(samples)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    mm_types = torch.zeros((B, T), dtype=torch.long)
    cmask = torch.zeros((B, C), dtype=torch.float32)
    for i, (s, c) in enumerate(zip(samples, completions)):
        pl, n = s["hf"]["input_ids"].shape[1], len(c)
        ids[i, T - n - pl:T - n], attn[i, T - n - pl:] = s["hf"]["input_ids"][0], 1
        mm_types[i, T - n - pl:T - n] = s["hf"]["mm_token_type_ids"][0]
        c = torch.tensor(c, dtype=torch.long)
        ok = ~torch.isin(c, torch.tensor(sorted(banned), dtype=torch.long))  # control tokens: out of input and loss
        ids[i, T - n:] = torch.where(ok, c, torch.tensor(pad_id))
        cmask[i, C - n:] = ok.float()
    return dict(input_ids=ids, attention_mask=attn, mm_token_type_ids=mm_types, completion_mask=cmask, **images_of(samples))


def images_of(samples):
    """The samples' images as one batch's model inputs (pixel_values, image_grid_thw), in order; {} for text only."""
    if not any("pixel_values" in s["hf"] for s in samples):
        return {}
    return {k: torch.cat([s["hf"][k] for s in samples if k in s["hf"]]) for k in ("pixel_values", "image_grid_thw")}


def collate_prefix(parts, pad_id, banned):
    """Shared-prefix micro-batch (--shared_prefix): each part, (sample, [completion ids, ...]) of one group,
    is one row, its prompt (text and image) once and then its completions one after another, left-padded to
    the longest row. -> the tensors of collate, laid out for model.logps_forward's shared-prefix path:
    input_ids, mm_token_type_ids (R, T); attention_mask (R, 1, T, T) bool: a prompt token sees the prompt
    before it, a completion token the whole prompt and its own completion before it, never another
    completion (a pad token sees itself alone: no row of the mask is empty); prompt_mask (R, T): the prompt
    tokens (their rotary positions are the prompt's own, a completion's continue after them, as in
    separate sequences); and per completion, N in all: completion_mask (N, C) right-aligned as collate's,
    targets (N, C) and the flat index (N, C) of the hidden state that predicts each target."""
    comps = [c for _, cs in parts for c in cs]
    C = max(max(len(c) for c in comps), 1)
    lengths = [s["hf"]["input_ids"].shape[1] + sum(len(c) for c in cs) for s, cs in parts]
    R, T, N = len(parts), max(lengths), len(comps)
    ids = torch.full((R, T), pad_id, dtype=torch.long)
    mm_types = torch.zeros((R, T), dtype=torch.long)
    prompt = torch.zeros((R, T), dtype=torch.bool)
    offset = torch.zeros((R, T), dtype=torch.long)                             # a completion token's place in it, from 1
    attn = torch.eye(T, dtype=torch.bool).repeat(R, 1, 1, 1)                   # (R, 1, T, T)
    cmask, targets, index = torch.zeros((N, C)), torch.full((N, C), pad_id, dtype=torch.long), torch.zeros((N, C), dtype=torch.long)
    stop = torch.tensor(sorted(banned), dtype=torch.long)
    n = 0
    for r, ((s, cs), L) in enumerate(zip(parts, lengths)):
        start, P = T - L, s["hf"]["input_ids"].shape[1]
        ids[r, start:start + P], mm_types[r, start:start + P] = s["hf"]["input_ids"][0], s["hf"]["mm_token_type_ids"][0]
        prompt[r, start:start + P] = True
        attn[r, 0, start:start + P, start:start + P] = torch.ones(P, P, dtype=torch.bool).tril()
        at = start + P
        for c in cs:
            c = torch.tensor(c, dtype=torch.long)
            k, ok = len(c), ~torch.isin(c, stop)                                 # control tokens: out of input and loss
            ids[r, at:at + k] = torch.where(ok, c, torch.tensor(pad_id))
            attn[r, 0, at:at + k, start:start + P] = True
            attn[r, 0, at:at + k, at:at + k] = torch.ones(k, k, dtype=torch.bool).tril()
            index[n] = r * T + start + P - 1                                     # outside the completion: any valid row
            if k:
                index[n, C - k:] = r * T + torch.cat([torch.tensor([start + P - 1]), torch.arange(at, at + k - 1)])
                targets[n, C - k:], cmask[n, C - k:] = ids[r, at:at + k], ok.float()
                offset[r, at:at + k] = torch.arange(1, k + 1)
            at, n = at + k, n + 1
    return dict(input_ids=ids, attention_mask=attn, mm_token_type_ids=mm_types, completion_mask=cmask,
                prompt_mask=prompt, offset=offset, targets=targets, index=index, **images_of([s for s, _ in parts]))
