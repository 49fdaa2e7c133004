"""Tools the policy may call during a rollout (`--tools crop`, several turns: train.py's rollout_groups).

A tool is a plain function and one line in TOOLS, like a reward in reward.py (or, in a file of your own, a line of
its TOOLS: --plugins, flags.load_plugins, docs/plugins.md). Its first parameter, `sample`,
is the prepared sample its trajectory belongs to (data.prepare: its images, the originals they came from, its
fields), given by the rollout; the others are what the model passes, with type hints and a Google-style
docstring, from which transformers' get_json_schema makes the schema the chat template shows (`schemas`). It
returns text, an image (PIL), or a list of both. What goes wrong (a malformed call, an unknown tool, bad
arguments, an exception, a call past TOOL_TIME_S) becomes a tool message that says so (`run_call`), counted,
never a crash. The calls follow Qwen's (Hermes) format, which the Qwen chat templates teach:

    <tool_call>
    {"name": "crop", "arguments": {"x1": 10, "y1": 10, "x2": 40, "y2": 40}}
    </tool_call>

Left out: parallel calls in one turn (the first call of a turn runs), tools that keep state between calls,
tools that run code or reach the network.
"""
import concurrent.futures
import functools
import inspect
import json
import os
import re

import torch

import data
import reward

TOOL_TIME_S = 10.0    # a call that takes longer is answered with a message; its thread is left to finish
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
MAX_TEXT_CHARS = 300  # a tool's text (or error) is cut here: the trajectory's token budget is the model's


def opened(source):
    """data.open_image, kept for the few sources (paths, bytes) last opened: a turn's calls come a sample's
    trajectories at a time, and each decoded the same original again (0.09 s of a 0.32 s step in make bench's
    multi-turn rollout). A PIL image (HF datasets decode them) is decoded already, and unhashable."""
    return _opened(source) if isinstance(source, (str, bytes, os.PathLike)) else data.open_image(source)


@functools.lru_cache(maxsize=4)
def _opened(source):
    return data.open_image(source)


# A box's units as a tool's schema tells the model, by its family's convention (model.FAMILIES norm_bbox): schemas()
# puts the second phrase where a docstring says the first.
BOX_UNITS = {"none": "in pixels of the image as you see it",
             "norm1000": "from 0 to 1000 across the image as you see it"}


def crop(sample, x1: int, y1: int, x2: int, y2: int):
    """Zoom in: crop a region of the image and see it at a higher resolution.

    Args:
        x1: left edge of the region, in pixels of the image as you see it
        y1: top edge of the region, in pixels of the image as you see it
        x2: right edge of the region, in pixels of the image as you see it
        y2: bottom edge of the region, in pixels of the image as you see it
    """
    if not sample["images"]:
        raise ValueError("this question has no image to crop")
    seen, norm = sample["images"][0], sample.get("norm_bbox", "none")   # the box in the family's convention
    w, h = (seen.width, seen.height) if norm == "none" else (1000, 1000)
    if not (0 <= x1 < x2 <= w and 0 <= y1 < y2 <= h):
        raise ValueError(f"the box ({x1}, {y1}, {x2}, {y2}) is not inside the image, which is "
                         + (f"{w} x {h} pixels" if norm == "none" else "0 to 1000 across and down")
                         + ", with x1 < x2 and y1 < y2")
    box = reward.box_in_pixels([x1, y1, x2, y2], norm, seen.size)
    original = opened(sample["sources"][0])   # before the downscale: the detail is still there
    sx, sy = original.width / seen.width, original.height / seen.height
    left, top = round(box[0] * sx), round(box[1] * sy)   # at least one original pixel, however small the box
    region = original.crop((left, top, max(round(box[2] * sx), left + 1), max(round(box[3] * sy), top + 1)))
    return data.downscale(region, *sample["pixel_bounds"])   # the same path as every image: vLLM and training see it


TOOLS = {"crop": crop}   # --tools: name -> function


MARK = "<<the model's turn>>"


def response(processor, parts):
    """The template's text between a model turn that ended in a tool call and the model's next turn: the end of
    its turn, the tool message holding `parts` (text and PIL images, in order), the next turn's header."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts]
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": MARK}, {"role": "tool", "content": content}]
    text = processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return text[text.index(MARK) + len(MARK):]


def schemas(names, norm_bbox="none"):
    """{name: JSON schema} of the named tools as the chat template takes them (`tools=`; data.prepare shows them):
    transformers' get_json_schema of each function as the model calls it, its first parameter (`sample`) left out.
    `norm_bbox`: the model family's box convention (model.FAMILIES); a docstring's BOX_UNITS["none"] says it."""
    from transformers.utils import get_json_schema
    out = {}
    for name in names:
        fn = TOOLS[name]
        params = list(inspect.signature(fn).parameters.values())[1:]

        def visible():
            pass
        visible.__name__, visible.__doc__ = fn.__name__, fn.__doc__
        visible.__signature__ = inspect.Signature(params)
        visible.__annotations__ = {p.name: p.annotation for p in params}
        out[name] = json.loads(json.dumps(get_json_schema(visible)).replace(BOX_UNITS["none"], BOX_UNITS[norm_bbox]))
    return out


def response_tokens(max_pixels, grid=28):
    """The most tokens one tool message can take: a crop's image of at most `max_pixels` on the model's `grid`
    (28 px per token at the finest), its text cut at MAX_TEXT_CHARS (a character a token at worst), and the
    template's own tokens."""
    return max_pixels // grid ** 2 + MAX_TEXT_CHARS + 64


def trajectory_tokens(args, max_pixels, grid=28):
    """The most tool-message tokens one trajectory holds beside the model's own: a message after each turn but the
    last (--max_turns); 0 without --tools. vLLM's context and KV budget and the planner count them."""
    return (args.max_turns - 1) * response_tokens(max_pixels, grid) if getattr(args, "tools", None) else 0


def processor_cache_gb(args, prompts, max_pixels):
    """vLLM's processor cache (GB of host RAM) for an engine that generates for `prompts` prompts a step: with --tools
    every turn sends each trajectory's prompt images again, and a cache of one step's of them, processed (at most
    max_pixels each, 24 bytes a pixel: Qwen's fp32 pixel values, 3 channels x 2 frames of a still image, and
    --limit_images a prompt), leaves the HF processor the new tool images alone. 0 without tools: each prompt's
    image is processed once a step, and a cache would only grow host RAM."""
    return prompts * args.limit_images * max_pixels * 24 / 2 ** 30 if getattr(args, "tools", None) else 0


def parse_call(text):
    """The first tool call of a turn's text -> (name, arguments); ValueError saying what is wrong with it."""
    found = CALL.search(text)
    if not found:
        raise ValueError("no <tool_call>...</tool_call> in the turn")
    try:
        call = json.loads(found.group(1))
    except json.JSONDecodeError as e:
        raise ValueError(f"the call is not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(call.get("arguments", {}), dict):
        raise ValueError('the call must be {"name": <tool name>, "arguments": {...}}')
    return call["name"], call.get("arguments", {})


_pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="tool")


def run_call(text, sample, names, time_s=TOOL_TIME_S):
    """Run the tool call in a turn's text for `sample`, allowed tools `names` -> (result, error): result is a
    list of text and PIL images (the tool message's content), error a short reason when the call failed (the
    result then says it to the model)."""
    try:
        name, arguments = parse_call(text)
        if name not in names:
            raise ValueError(f"there is no tool {name!r}; the tools are {', '.join(names)}")
        fn = TOOLS[name]
        try:
            inspect.signature(fn).bind(sample, **arguments)
        except TypeError as e:
            raise ValueError(f"bad arguments for {name}: {e}") from None
        future = _pool.submit(fn, sample, **arguments)
        try:
            out = future.result(timeout=time_s)
        except concurrent.futures.TimeoutError:
            raise ValueError(f"{name} took longer than {time_s:g} s") from None
        except Exception as e:   # the tool's own failure: the model is told, the run goes on
            raise ValueError(f"{name} failed: {type(e).__name__}: {e}") from None
    except ValueError as e:
        reason = str(e)[:MAX_TEXT_CHARS]
        return [f"Error: {reason}"], reason
    parts = out if isinstance(out, list) else [out]
    return [p[:MAX_TEXT_CHARS] if isinstance(p, str) else p for p in parts], None


def rollout(samples, n, processor, args, generate, any_live):
    """n trajectories per sample (--tools): every live trajectory advances one turn per `generate(requests,
    keys, budgets, stops, n)` call (all of them batched, never one request at a time). A turn ends at the end of a tool
    call (`</tool_call>`, a stop token), at the end of the answer, or at the budget: --max_completion_length
    counts every model token of a trajectory, --max_turns its model turns. After a call the tool runs and the
    template's tool message (response) is appended; the next turn continues from the tokens already there:
    tokens are appended, never re-tokenized, so the sampler's log-probs stay on the tokens trained on.
    `any_live(count)` is a collective (train.py): every rank runs as many turns as the busiest one (vLLM's
    tensor-parallel groups generate together). A sample's tools are its row's (data.prepare: a row's own `tools`
    field, else --tools); with none its trajectories have one turn. -> per sample, n dicts (train.py makes
    Completion records)."""
    end_call = processor.tokenizer.convert_tokens_to_ids("</tool_call>")
    trajs = [[dict(ids=[], vllm_ids=[], mask=[], logps=[], mm_types=[], images=[], image_ids=[], mm=[], turns=[], calls=[],
                   model_tokens=0, finish_reason=None) for _ in range(n)] for _ in samples]
    for turn in range(args.max_turns):
        live = [(i, k) for i, ts in enumerate(trajs) for k, t in enumerate(ts) if t["finish_reason"] is None]
        if not any_live(len(live)):
            break
        # the first turn: a sample's n trajectories are still empty and start from its prompt alone, one request with
        # n samples (vLLM renders the prompt and its images once, not n times), the first standing for all; later
        # turns: one request per live trajectory
        first = turn == 0
        asked = [(i, 0) for i in range(len(samples))] if first else live
        requests = [{key: samples[i][key] + trajs[i][k][key] for key in ("vllm_ids", "images", "image_ids")} for i, k in asked]
        outs = generate(requests, [(i, turn) if first else (i, k, turn) for i, k in asked],
                        [args.max_completion_length - trajs[i][k]["model_tokens"] for i, k in asked],
                        [[end_call] if samples[i]["tools"] else [] for i, _ in asked],   # a row without tools: one turn
                        n if first else 1)
        pending = []
        for (i, k), c in zip(live, [c for out in outs for c in out.outputs]):
            t = trajs[i][k]
            tokens = list(c.token_ids)
            t["ids"] += tokens
            t["vllm_ids"] += tokens
            t["mask"] += [1] * len(tokens)
            t["mm_types"] += [0] * len(tokens)
            t["logps"] += [next(iter(d.values())).logprob for d in c.logprobs]
            t["model_tokens"] += len(tokens)
            t["turns"].append(processor.tokenizer.decode(tokens, skip_special_tokens=True))
            if not (c.finish_reason == "stop" and tokens and tokens[-1] == end_call):
                t["finish_reason"] = c.finish_reason    # the answer ("stop"), or the budget ("length")
            elif turn == args.max_turns - 1 or t["model_tokens"] >= args.max_completion_length:
                t["finish_reason"] = "length"           # a call with no turn left to answer in
            else:
                pending.append((t, samples[i]))
        if pending:
            answer(pending, processor, args)
    return trajs


def answer(pending, processor, args):
    """Run the call that ended the last turn of each (trajectory, sample) in `pending` and append its tool message,
    in both forms: vLLM's (one <|image_pad|> per image; it expands them) and the training forward's (the
    processor's, expanded), masked out of the loss. A call that repeats another trajectory's on the same sample (a
    group's trajectories often write the same one) runs once, and their messages share its images, one content id
    each: vLLM processes and encodes such an image once. One processor call for the turn's distinct messages:
    called once per message it took a quarter of a multi-turn step (docs/verification.md). A result that would take
    the prompt past --limit_images images keeps its text only."""
    ran, messages, which = {}, {}, []   # (sample, call) -> its result; (text, images) -> (its row, text, images)
    for t, sample in pending:
        call = t["turns"][-1]
        if (id(sample), call) not in ran:
            ran[id(sample), call] = run_call(call, sample, sample["tools"])
        parts, error = ran[id(sample), call]
        images = [p for p in parts if not isinstance(p, str)]
        if images and len(sample["images"]) + len(t["images"]) + len(images) > args.limit_images:
            error = f"the image limit (--limit_images {args.limit_images}) is reached"
            parts, images = [f"Error: {error}; no more images"], []
        t["calls"].append((call, error))
        text = response(processor, parts)
        which.append(messages.setdefault((text, tuple(map(id, images))), (len(messages), text, images))[0])
    rows = list(messages.values())
    texts, flat = [text for _, text, _ in rows], [im for _, _, images in rows for im in images]
    hf = processor(text=texts, images=flat or None, padding=True, return_tensors="pt")
    pixels = iter(hf["pixel_values"].split(hf["image_grid_thw"].prod(-1).tolist()) if flat else ())
    grids = iter(hf["image_grid_thw"] if flat else ())
    made = [dict(vllm_ids=text_ids, ids=row[keep].tolist(), types=types[keep].tolist(), images=images,   # padding dropped
                 image_ids=[data.content_id(im) for im in images],
                 mm={"pixel_values": torch.cat([next(pixels) for _ in images]),
                     "image_grid_thw": torch.stack([next(grids) for _ in images])} if images else None)
            for (_, _, images), text_ids, row, keep, types in zip(
                rows, processor.tokenizer(texts, add_special_tokens=False)["input_ids"], hf["input_ids"],
                hf["attention_mask"].bool(), hf["mm_token_type_ids"])]
    for (t, _), m in zip(pending, [made[i] for i in which]):
        t["vllm_ids"] += m["vllm_ids"]
        t["ids"] += m["ids"]
        t["mask"] += [0] * len(m["ids"])
        t["logps"] += [0.0] * len(m["ids"])
        t["mm_types"] += m["types"]
        t["images"] += m["images"]
        t["image_ids"] += m["image_ids"]
        if m["mm"]:
            t["mm"].append(m["mm"])
