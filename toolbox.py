"""Tools the policy may call during a rollout (`--tools crop`), over several turns (rollout).

A tool is a plain function and one line in TOOLS, like a reward in reward.py (or a line in a plugin file's TOOLS,
docs/plugins.md). Its first parameter, `sample`, is the prepared sample of its trajectory (data.prepare); the others
are what the model passes, and their type hints and Google-style docstring make the schema the chat template shows
(schemas). It returns text, a PIL image, or a list of both; an image takes the path of every image (data.load_image),
so what a tool returns is what the planner counts. Whatever goes wrong becomes a tool message that says so, counted,
never a crash: the model's mistake (BAD_CALL) or the tool's own failure (TOOL_ERROR). Calls follow Qwen's (Hermes)
format, which the Qwen chat templates teach:

    <tool_call>
    {"name": "crop", "arguments": {"x1": 10, "y1": 10, "x2": 40, "y2": 40}}
    </tool_call>

docs/tools.md has the loop, the failure kinds, the threads and the memory. Left out: parallel calls in one turn (the
first call of a turn runs), tools that keep state between calls, tools that run code or reach the network.
"""
import functools
import inspect
import json
import math
import os
import threading
import time
import traceback

import torch
from PIL import Image

import data
import reward

TOOL_TIME_S = 10.0    # a call that takes longer is answered with a message; its thread is left running (a daemon)
STUCK_MAX = 8         # calls past their time still running at once, at most: past it a call is answered unrun
CALL_TAGS = ("<tool_call>", "</tool_call>")   # a call is the text between the first opening tag and the next close
MAX_TEXT_CHARS = 300  # a tool's text (or error) is cut here: the trajectory's token budget is the model's
# A tool's image past PIL's own bound on a decoded image (its decompression-bomb limit) is refused, not downscaled.
MAX_TOOL_IMAGE_PIXELS = 2 * Image.MAX_IMAGE_PIXELS
BAD_CALL, TOOL_ERROR, IMAGE_LIMIT = "call", "tool", "limit"   # why a call failed: the model, the tool, the limit


def opened(source):
    """data.open_image, cached for the last few paths or bytes: a turn's calls on one sample open the same original."""
    return _opened(source) if isinstance(source, (str, bytes, os.PathLike)) else data.open_image(source)


@functools.lru_cache(maxsize=4)
def _opened(source):
    return data.open_image(source)


# A box's units as a tool's schema tells the model, by its family's convention (model.FAMILIES norm_bbox): schemas()
# puts the second phrase where a docstring says the first.
BOX_UNITS = {"none": "in pixels of the image as you see it",
             "norm1000": "from 0 to 1000 across the image as you see it"}


def crop(sample, x1: int, y1: int, x2: int, y2: int) -> Image.Image:
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
    """The template's text after a model turn that called a tool: its end, the tool message of `parts` (text and PIL
    images), the next turn's header."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts]
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": MARK},
            {"role": "tool", "content": content}]
    text = processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return text[text.index(MARK) + len(MARK):]


def schemas(names, norm_bbox="none"):
    """{name: JSON schema} of the named tools for the chat template: get_json_schema of each without `sample`, the box
    units in the family's `norm_bbox` convention (BOX_UNITS)."""
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
    """The most tokens one tool message takes: an image of `max_pixels` on the `grid`, MAX_TEXT_CHARS of text (a token
    a character at worst), the template's own."""
    return max_pixels // grid ** 2 + MAX_TEXT_CHARS + 64


def trajectory_tokens(args, max_pixels, grid=28):
    """The most tool-message tokens one trajectory holds, one message a turn but the last; 0 without --tools."""
    return (args.max_turns - 1) * response_tokens(max_pixels, grid) if getattr(args, "tools", None) else 0


def processor_cache_gb(args, prompts, max_pixels):
    """GB of host RAM for vLLM's processor cache, sized for one step's prompt images (24 bytes a pixel); 0 without
    --tools. With tools every turn sends each trajectory's prompt images again."""
    return prompts * args.limit_images * max_pixels * 24 / 2 ** 30 if getattr(args, "tools", None) else 0


def image_limit(args, prompt_images=1):
    """The images one request may hold: the prompt's `prompt_images`, plus --max_turns - 1 when a tool may return
    images (one for each turn after a call)."""
    return prompt_images + (args.max_turns - 1 if any(map(returns_images, getattr(args, "tools", None) or [])) else 0)


def returns_images(name):
    """Whether the tool `name` may return images: every tool but one annotated to return text alone (-> str)."""
    return inspect.signature(TOOLS[name]).return_annotation not in (str, "str")


def started_line(args, trajectories):
    """Rank 0's line at start about --tools: the image limit, the tool images' host RAM, a call's time."""
    images = image_limit(args, 0)
    given = "given" if "limit_images" in getattr(args, "explicit", ()) else \
        f"derived: a prompt's image and one for each turn after a call, --max_turns {args.max_turns} - 1"
    return (f"[tools] {' '.join(args.tools)}: --limit_images {args.limit_images} ({given}); vLLM and the planner "
            f"take it. Each tool image is downscaled to --max_pixels {args.max_pixels} as the prompt's are, {images} "
            f"at most a trajectory: at most {tool_images_gb(args, trajectories, args.max_pixels):.3g} GB of host RAM "
            f"a step on this rank. A call is given {TOOL_TIME_S:g} s, on a thread of its own; at most {STUCK_MAX} "
            f"calls past their time run on at once, and what such a call holds is its own")


def tool_images_gb(args, trajectories, max_pixels):
    """Host RAM (GB) that a step's tool images may take on a rank rolling out `trajectories`: --max_turns - 1 images
    each, of `max_pixels`, at 3 bytes a pixel as PIL holds them and 24 as the processor's. 0 without --tools."""
    return trajectories * (args.max_turns - 1) * max_pixels * 27 / 2 ** 30 if getattr(args, "tools", None) else 0


def parse_call(text):
    """The first tool call in a turn's text -> (name, arguments). ValueError saying what is wrong, whatever the
    text."""
    # two finds, linear: a regex search tries every unclosed tag to the end of the text (20,000 tags: minutes)
    start = text.find(CALL_TAGS[0])
    end = text.find(CALL_TAGS[1], start + len(CALL_TAGS[0])) if start >= 0 else -1
    if end < 0:
        raise ValueError("no <tool_call>...</tool_call> in the turn")
    try:
        call = json.loads(text[start + len(CALL_TAGS[0]):end])
    except json.JSONDecodeError as e:
        raise ValueError(f"the call is not JSON ({e.msg} at character {e.pos})") from None
    except RecursionError:
        raise ValueError("the call is not JSON that can be read: nested too deep") from None
    except ValueError:   # Python's int conversion limit (4300 digits)
        raise ValueError("the call is not JSON that can be read: a number has too many digits") from None
    if (not isinstance(call, dict) or not isinstance(call.get("name"), str)
            or not isinstance(call.get("arguments", {}), dict)):
        raise ValueError('the call must be {"name": <tool name>, "arguments": {...}}')
    return call["name"], call.get("arguments", {})


JSON_TYPES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
              dict: "an object", type(None): "null"}


def checked_arguments(name, fn, sample, arguments):
    """The call's arguments bound to the tool's parameters and held to their type hints -> what the tool gets (an
    integral float for an int becomes an int). ValueError for a wrong type, an integer past 64 bits or a number that is
    not finite."""
    try:
        params = inspect.signature(fn).bind(sample, **arguments).signature.parameters
    except TypeError as e:
        raise ValueError(f"bad arguments for {name}: {e}") from None
    out = {}
    for key, value in arguments.items():
        hint = params[key].annotation
        want = {"int": int, "float": float, "str": str, "bool": bool}.get(hint, hint)   # hints written as strings
        if want is int and isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = {bool: isinstance(value, bool), str: isinstance(value, str),
              int: number and isinstance(value, int) and abs(value) < 2 ** 63,
              float: number and abs(value) < 2 ** 63 and math.isfinite(value)}.get(want, True)
        if not ok:   # the value is not shown: it may nest deeper than the stack
            raise ValueError(f"bad arguments for {name}: {key} must be {JSON_TYPES[want]}" +
                             (" between -2^63 and 2^63" if number else f", not {JSON_TYPES.get(type(value), 'that')}"))
        out[key] = value
    return out


def clean(text):
    """Text a tool message may hold: cut at MAX_TEXT_CHARS, what is no UTF-8 (a lone surrogate) replaced."""
    return text[:MAX_TEXT_CHARS].encode("utf-8", "replace").decode("utf-8")


def said(e):
    """str(e), which a tool's exception may fail to give."""
    try:
        return str(e)
    except Exception:
        return "(its message could not be read)"


_lock = threading.Lock()
_stuck = {}     # id(call) -> the tool's name, for each call past its time whose thread still runs
_told = set()   # what was said once: each distinct tool exception's traceback, each stuck tool, the image limit


def say_once(key, text):
    """Print `text` once per `key`, whichever thread asks first."""
    with _lock:
        if key in _told:
            return
        _told.add(key)
    print(text, flush=True)


def start_call(text, sample, names, time_s=None):
    """Parse and check the call in a turn's text (allowed tools `names`) and start it on a daemon thread -> the call,
    for finish_call. A bad call, or one past STUCK_MAX stuck calls, is answered at once."""
    time_s = TOOL_TIME_S if time_s is None else time_s
    try:
        name, arguments = parse_call(text)
        if name not in names:
            raise ValueError(f"there is no tool {name[:40]!r}; the tools are {', '.join(names)}")
        arguments = checked_arguments(name, TOOLS[name], sample, arguments)
    except Exception as e:   # whatever the model wrote: its mistake, told to it and counted, never the run's end
        return dict(answer=failure(said(e) if isinstance(e, ValueError) else f"the call could not be read "
                                   f"({type(e).__name__})", BAD_CALL))
    call = dict(name=name, sample=sample, time_s=time_s, out=None, error=None, done=threading.Event())
    with _lock:
        stuck = len(_stuck)
    if stuck >= STUCK_MAX:
        return dict(answer=failure(f"{name} was not run: {stuck} earlier tool calls still run past their time",
                                   TOOL_ERROR))
    # a daemon thread is never joined at exit: a tool that never returns cannot keep the process alive
    threading.Thread(target=_run, args=(call, TOOLS[name], sample, arguments), name=f"tool-{name}",
                     daemon=True).start()
    return call


def _run(call, fn, sample, arguments):
    """Run the tool on its thread; its result or exception goes into `call`."""
    try:
        call["out"] = fn(sample, **arguments)
    except BaseException as e:   # the tool's own failure: told to the model, counted, its traceback printed once
        call["error"] = e
    finally:
        with _lock:
            _stuck.pop(id(call), None)
            call["done"].set()


def finish_call(call, deadline):
    """-> (result, error, kind) of a started call once it ends or at `deadline` (time.monotonic()): result the tool
    message's content (text and PIL images), error a short reason or None, kind BAD_CALL, TOOL_ERROR or None."""
    if "answer" in call:
        return call["answer"]
    name = call["name"]
    if not call["done"].wait(max(0.0, deadline - time.monotonic())):
        with _lock:
            if not call["done"].is_set():
                _stuck[id(call)] = name
            stuck = len(_stuck)
        if not call["done"].is_set():
            say_once(("stuck", name), f"[tools] {name} took longer than {call['time_s']:g} s: answered with an error "
                     f"(tools/tool_error_frac); its thread runs on and never holds the process at its exit. {stuck} "
                     f"such call(s) now; past {STUCK_MAX} at once a call is answered without running")
            return failure(f"{name} took longer than {call['time_s']:g} s", TOOL_ERROR)
    e = call["error"]
    if isinstance(e, ValueError):   # the tool refuses the call (the crop's box outside the image): the model's mistake
        return failure(f"{name} failed: ValueError: {said(e)}", BAD_CALL)
    if e is not None:
        where = traceback.extract_tb(e.__traceback__)[-1:]
        say_once((name, type(e).__name__, tuple((f.filename, f.lineno) for f in where)),
                 f"[tools] {name} raised {type(e).__name__} (said once; each such call is counted in "
                 f"tools/tool_error_frac and told to the model):\n" + "".join(traceback.format_exception(e)).rstrip())
        return failure(f"{name} failed: {type(e).__name__}: {said(e)}", TOOL_ERROR)
    try:
        parts = result_parts(name, call["out"])
        return [clean(p) if isinstance(p, str) else tool_image(p, call["sample"], name) for p in parts], None, None
    except ValueError as e:   # what result_parts and tool_image say
        return failure(said(e), TOOL_ERROR)
    except Exception as e:    # an image that cannot be read or resized (a lazily opened file gone, 0 pixels wide)
        return failure(f"{name} returned what could not be used: {type(e).__name__}: {said(e)}", TOOL_ERROR)


def result_parts(name, out):
    """A tool's output -> a list of text and PIL images; ValueError otherwise."""
    parts = out if isinstance(out, list) else [out]
    wrong = [type(p).__name__ for p in parts if not isinstance(p, (str, Image.Image))]
    if wrong or not parts:
        raise ValueError(f"{name} returned {wrong[0] if wrong else 'an empty list'}: a tool returns text, a PIL image "
                         f"or a list of them")
    return parts


def tool_image(image, sample, name):
    """A tool's image, downscaled as any image is (data.load_image). Refused past MAX_TOOL_IMAGE_PIXELS."""
    if image.width * image.height > MAX_TOOL_IMAGE_PIXELS:
        raise ValueError(f"{name} returned a {image.width} x {image.height} image, more than {MAX_TOOL_IMAGE_PIXELS} "
                         f"pixels (PIL's bound on a decoded image)")
    if image.mode == "RGB" and image.getexif().get(0x0112, 1) == 1:   # open_image would only copy it
        return data.downscale(image, *sample["pixel_bounds"])
    return data.load_image(image, *sample["pixel_bounds"], name=f"the image {name} returned")


def failure(reason, kind):
    reason = clean(reason)
    return [f"Error: {reason}"], reason, kind


def run_call(text, sample, names, time_s=None):
    """Start and finish one call, waiting at most `time_s` (TOOL_TIME_S) -> (result, error, kind)."""
    call = start_call(text, sample, names, time_s)
    return finish_call(call, time.monotonic() + (TOOL_TIME_S if time_s is None else time_s))


def rollout(samples, n, processor, args, generate, any_live):
    """n trajectories per sample (--tools) -> per sample, n dicts (train.py makes Completion records). Each
    `generate(requests, keys, budgets, stops, counts)` call advances every live trajectory one turn, all batched, a
    request standing for `count` trajectories. A turn ends at a tool call (`</tool_call>`), the answer or the budget:
    --max_completion_length model tokens, --max_turns turns. After a call its tool message is appended (answer).
    Tokens are appended, never re-tokenized, so the sampler's log-probs stay on the tokens trained on. `any_live(count)`
    is a collective: every rank runs as many turns as the busiest."""
    end_call = processor.tokenizer.convert_tokens_to_ids("</tool_call>")
    trajs = [[dict(ids=[], vllm_ids=[], mask=[], logps=[], mm_types=[], images=[], image_ids=[], mm=[], turns=[],
                   calls=[], model_tokens=0, finish_reason=None) for _ in range(n)] for _ in samples]
    for turn in range(args.max_turns):
        live = [(i, k) for i, ts in enumerate(trajs) for k, t in enumerate(ts) if t["finish_reason"] is None]
        if not any_live(len(live)):
            break
        # a sample's live trajectories that hold the same tokens and images go as one request with as many samples
        # (vLLM renders the prompt and its images once): at the first turn its n empty ones, later those whose calls
        # and answers matched. The first of them stands for all: the seed's key is its own
        same = {}
        for i, k in live:
            t = trajs[i][k]
            same.setdefault((i, tuple(t["vllm_ids"]), tuple(t["image_ids"])), []).append((i, k))
        asked = list(same.values())
        requests = [{key: samples[i][key] + trajs[i][k][key] for key in ("vllm_ids", "images", "image_ids")}
                    for (i, k), *_ in asked]
        outs = generate(requests, [(i, turn) if turn == 0 else (i, k, turn) for (i, k), *_ in asked],
                        [args.max_completion_length - trajs[i][k]["model_tokens"] for (i, k), *_ in asked],
                        [[end_call] if samples[i]["tools"] else [] for (i, _), *_ in asked],   # no tools: one turn
                        [len(a) for a in asked])
        pending = []
        for (i, k), c in zip([m for a in asked for m in a], [c for out in outs for c in out.outputs]):
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
    """Run the call that ended the last turn of each (trajectory, sample) in `pending` and append its tool message in
    two forms: vLLM's (one <|image_pad|> per image) and the training forward's (expanded), out of the loss. A call
    repeated on one sample runs once and its trajectories share its images; one processor call serves the turn. A
    result past --limit_images keeps its text only (IMAGE_LIMIT)."""
    ran, messages, which = {}, {}, []   # (sample, call) -> its result; (text, images) -> (its row, text, images)
    rendered = {}   # a message's text parts, None for each image -> its template text (response)
    for t, sample in pending:   # every distinct call of the turn starts at once: their time-outs overlap
        if (id(sample), t["turns"][-1]) not in ran:
            ran[id(sample), t["turns"][-1]] = start_call(t["turns"][-1], sample, sample["tools"])
    deadline = time.monotonic() + TOOL_TIME_S
    ran = {key: finish_call(call, deadline) for key, call in ran.items()}
    for t, sample in pending:
        call = t["turns"][-1]
        parts, error, kind = ran[id(sample), call]
        images = [p for p in parts if not isinstance(p, str)]
        if images and len(sample["images"]) + len(t["images"]) + len(images) > args.limit_images:
            error, kind = f"the image limit (--limit_images {args.limit_images}) is reached", IMAGE_LIMIT
            parts, images = [f"Error: {error}; no more images"], []
            say_once(IMAGE_LIMIT, f"[tools] a call's image was refused: its trajectory holds --limit_images "
                     f"{args.limit_images} images already (the prompt's and the tools'); counted in tools/failure_frac")
        t["calls"].append((call, error, kind))
        shape = tuple(p if isinstance(p, str) else None for p in parts)   # all the template's text depends on
        if shape not in rendered:
            rendered[shape] = response(processor, parts)
        text = rendered[shape]
        which.append(messages.setdefault((text, tuple(map(id, images))), (len(messages), text, images))[0])
    rows = list(messages.values())
    texts, flat = [text for _, text, _ in rows], [im for _, _, images in rows for im in images]
    hf = processor(text=texts, images=flat or None, padding=True, return_tensors="pt")
    pixels = iter(hf["pixel_values"].split(hf["image_grid_thw"].prod(-1).tolist()) if flat else ())
    grids = iter(hf["image_grid_thw"] if flat else ())
    # each message's own ids and token types, the batch's padding dropped
    made = [dict(vllm_ids=text_ids, ids=row[keep].tolist(), types=types[keep].tolist(), images=images,
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
