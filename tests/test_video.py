"""Videos (--limit_videos, data.load_video): decoded with PyAV, their frames chosen and downscaled once, the same
frames and timestamps for vLLM and for the training forward of every family; bad videos named; a long clip decoded
within bounded memory; the planner's video tokens against vLLM's own budget; the motion task's two-rank run."""
import json
import os
import subprocess
import sys
import types
from fractions import Fraction

import numpy as np
import pytest
import torch
from PIL import Image

import data
import flags
import grpo
import model as model_py
import planner
import rollout
import tiny
import train
from conftest import ROOT

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_5"]
TOL = {torch.float32: 1e-4, torch.bfloat16: 0.1}   # as tests/test_vllm_agreement.py: Qwen3.5 runs in bf16 on CPU


def motion(arch="qwen2_5_vl"):
    """(model_dir, train_jsonl, val_jsonl) of --tiny_task motion on the tiny model of `arch`."""
    return tiny.ensure_default(os.path.join(ROOT, ".cache", "tiny"), task="motion", arch=arch)


def coded(i):
    """A frame whose colour says its index, a hex digit a channel in steps of 16 (H.264 keeps them within ~4)."""
    return np.array([16 * (i % 16), 16 * (i // 16 % 16), 16 * (i // 256 % 16)], np.uint8)


def index_of(frame):
    r, g, b = frame.reshape(-1, 3).mean(0)
    return round(r / 16) + 16 * round(g / 16) + 256 * round(b / 16)


def write_clip(path, n, width=64, height=48, fps=30, codec="libx264", options=None):
    """A clip of n frames, each coded() with its index, written with PyAV."""
    import av
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = options if options is not None else {"preset": "ultrafast", "crf": "0"}
        for i in range(n):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.broadcast_to(coded(i), (height, width, 3)).copy(),
                                                                    format="rgb24")))
        container.mux(stream.encode())
    return str(path)


def video_args(*extra):
    return flags.parse_args(["--model", "MODEL", "--limit_videos", "1", *extra])


# ----------------------------------------------------------------------------- frames: chosen and downscaled once
@pytest.mark.parametrize("grid", [28, 32])
def test_frames_are_chosen_at_the_rate_on_the_grid_within_the_budget(tmp_path, grid):
    """10 s at 30 fps, --video_fps 2: 20 frames, evenly over the clip (HF's own linspace), each the frame it says it
    is (seeks and decoding land on the right ones), all one size on the model's grid, within the frame bounds and
    the video's budget; metadata as vLLM takes it. Fewer frames get larger ones (qwen-vl-utils' total_pixels)."""
    path = write_clip(tmp_path / "c.mp4", 300, 320, 240)
    args = video_args("--video_total_pixels", str(64 * grid ** 2), "--video_max_pixels", str(16 * grid ** 2),
                      "--video_min_pixels", str(grid ** 2))
    frames, meta = data.load_video(path, args, grid, 2)
    assert frames.shape[0] == 20 and frames.dtype == np.uint8
    assert meta["frames_indices"] == np.linspace(0, 299, 20).round().astype(int).tolist()
    assert [index_of(f) for f in frames] == meta["frames_indices"]
    assert (meta["fps"], meta["total_num_frames"], meta["duration"]) == (30.0, 300, 10.0)
    assert meta["do_sample_frames"] is False
    h, w = frames.shape[1:3]
    assert h % grid == 0 and w % grid == 0 and grid ** 2 <= h * w <= 16 * grid ** 2
    assert 20 // 2 * h * w // grid ** 2 <= 64                                   # tokens within the budget
    few, _ = data.load_video(path, video_args(*args_of(args), "--video_max_frames", "4"), grid, 2)
    assert few.shape[0] == 4 and few.shape[1] * few.shape[2] > h * w          # fewer frames, larger ones


def args_of(args):
    return ["--video_total_pixels", str(args.video_total_pixels), "--video_max_pixels", str(args.video_max_pixels),
            "--video_min_pixels", str(args.video_min_pixels)]


@pytest.mark.parametrize("seconds,frames,expected", [(10, 300, 20), (1.5, 45, 2), (0.2, 6, 2), (100, 3000, 32),
                                                     (3.5, 7, 6), (2.5, 3, 2), (1, 1, 2)])
def test_frame_counts_are_a_multiple_of_the_temporal_patch(seconds, frames, expected):
    """--video_fps 2, --video_max_frames 32: at most the clip's own frames, rounded down to the temporal patch (2),
    at least one patch (a one-frame clip shows its frame twice, as the processor would pad it)."""
    assert data.frame_count(seconds, frames, video_args(), 2) == expected


def test_a_list_of_frames_is_one_video_taken_at_video_fps(tmp_path):
    """["f0.png", ...] in a row's "video": one video, its frames opened only when chosen, at --video_fps."""
    for i in range(7):
        Image.fromarray(np.broadcast_to(coded(i), (40, 60, 3)).copy()).save(tmp_path / f"f{i}.png")
    args = video_args("--video_min_pixels", str(28 * 28), "--video_max_pixels", str(28 * 28 * 4))
    [clip] = data.video_sources([f"f{i}.png" for i in range(7)], "t:1")
    frames, meta = data.load_video([str(tmp_path / f) for f in clip], args, 28, 2)
    assert frames.shape[0] == 6 and meta["fps"] == 2.0 and meta["total_num_frames"] == 7
    assert [index_of(f) for f in frames] == meta["frames_indices"] == [0, 1, 2, 4, 5, 6]


@pytest.mark.parametrize("field,expected", [
    ("a.mp4", ["a.mp4"]), (["a.mp4", "b.mkv"], ["a.mp4", "b.mkv"]), (["f0.png", "f1.jpg"], [["f0.png", "f1.jpg"]]),
    ([["f0.png", "f1.png"], ["g0.png", "g1.png"]], [["f0.png", "f1.png"], ["g0.png", "g1.png"]]), (None, []), ("", []),
    ({"bytes": b"x", "path": "a.mp4"}, [{"bytes": b"x", "path": "a.mp4"}]),
    ("frame.png", "is an image; give it as the row's \"image\""), ("http://x/a.mp4", "is a URL"),
    (7, "video field holds int"),
    (["a.mp4", ["f0.png"], 3], "video field holds int")])
def test_a_rows_video_field(field, expected):
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=f"t:1: .*{expected}"):
            data.video_sources(field, "t:1")
    else:
        assert data.video_sources(field, "t:1") == expected


# ----------------------------------------------------------------------------- bad videos: named, skipped and counted
def bad_video(kind, tmp_path):
    """-> (the row's "video" or "image" field, the file it names) of each kind of bad video."""
    good = write_clip(tmp_path / "good.mp4", 8)
    if kind == "corrupt":
        (tmp_path / "bad.mp4").write_bytes(os.urandom(4096))
    elif kind == "truncated":   # an .mp4 whose index (moov, in front) promises 300 frames, cut after a third
        import av
        with av.open(str(tmp_path / "full.mp4"), "w", options={"movflags": "faststart"}) as container:
            stream = container.add_stream("libx264", rate=30)
            stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
            for i in range(300):
                noise = np.random.default_rng(i).integers(0, 255, (48, 64, 3), dtype=np.uint8)
                container.mux(stream.encode(av.VideoFrame.from_ndarray(noise, format="rgb24")))
            container.mux(stream.encode())
        raw = open(tmp_path / "full.mp4", "rb").read()
        (tmp_path / "bad.mp4").write_bytes(raw[:len(raw) // 3])
    elif kind == "no_frames":   # a video stream whose packets decode to nothing
        import av
        with av.open(str(tmp_path / "bad.mkv"), "w") as container:
            stream = container.add_stream("h264", rate=30)
            stream.width, stream.height = 64, 48
            for i in range(10):
                packet = av.Packet(np.random.default_rng(i).integers(0, 255, 200, dtype=np.uint8).tobytes())
                packet.stream, packet.pts, packet.dts, packet.time_base = stream, i, i, Fraction(1, 30)
                container.mux(packet)
        return "bad.mkv", "bad.mkv"
    elif kind == "unsupported_codec":   # an AVI whose codec tag no decoder knows
        raw = bytearray(open(write_clip(tmp_path / "m.avi", 8, codec="mpeg4", options={}), "rb").read())
        for tag in (b"FMP4", b"fmp4", b"XVID", b"DIVX", b"xvid", b"mp4v"):
            raw = raw.replace(tag, b"ZZZZ")
        (tmp_path / "bad.avi").write_bytes(bytes(raw))
        return "bad.avi", "bad.avi"
    elif kind == "directory":
        os.makedirs(tmp_path / "bad.mp4")
    elif kind == "missing":
        return "bad.mp4", "bad.mp4"
    elif kind == "image_as_video":
        Image.new("RGB", (56, 56)).save(tmp_path / "bad.png")
        return "bad.png", "bad.png"
    elif kind == "video_as_image":
        return {"image": os.path.basename(good)}, "good.mp4"
    return "bad.mp4", "bad.mp4"


KINDS = {"corrupt": "InvalidDataError", "truncated": "InvalidDataError|truncated", "no_frames": "no decodable frame",
         "unsupported_codec": "no decoder for its codec", "directory": "a directory, not a video file",
         "missing": "FileNotFoundError", "image_as_video": "is an image", "video_as_image": "is a video file"}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_bad_video_is_named_and_counted(kind, tmp_path):
    """Each kind is an error naming the file and the data line (data.prepare), and the stream skips and counts it
    (data/skipped) and goes on; a good row beside them is trained on."""
    field, name = bad_video(kind, tmp_path)
    path = tmp_path / "train.jsonl"
    bad = field if isinstance(field, dict) else {"video": field}
    with open(path, "w") as f:
        f.write(json.dumps({**bad, "question": "which way?", "solution": "left"}) + "\n")
        f.write(json.dumps({"video": "good.mp4", "question": "which way?", "solution": "left"}) + "\n")
    import re

    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(motion()[0])
    args = train.parse_args(["--tiny_task", "motion", "--train_data", str(path)])
    rows = data.read_jsonl(str(path))
    with pytest.raises(ValueError) as refused:
        data.prepare(rows[0], processor, args)
    err = str(refused.value)
    print(kind, err)
    assert err.startswith(f"{path}:1: ") and name in err and re.search(KINDS[kind], err), err
    assert data.prepare(rows[1], processor, args)["videos"][0][0].shape[0] == 2   # 8 frames at 30 fps: 0.27 s
    stream = data.PromptStream(rows, processor, args, rank=0, world=1)
    assert len(stream.next(3)) == 3 and stream.skipped >= 1


def test_too_many_videos_and_videos_off_are_refused_by_name(tmp_path):
    write_clip(tmp_path / "a.mp4", 8)
    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(motion()[0])
    row = {"video": ["a.mp4", "a.mp4"], "question": "q", "solution": "left", "_where": str(tmp_path / "d.jsonl") + ":3"}
    with pytest.raises(ValueError, match=r"d.jsonl:3: 2 video\(s\) > --limit_videos 1"):
        data.prepare(row, processor, train.parse_args(["--tiny_task", "motion"]))
    with pytest.raises(ValueError, match="videos are off by default: pass --limit_videos 1"):
        data.prepare(dict(row, video="a.mp4"), processor, train.parse_args(["--tiny_task", "colour"]))


def test_a_4k_clip_and_a_2_hour_clip_are_decoded_within_the_bounds(tmp_path):
    """A 4K clip comes out at --video_max_pixels a frame; a 2-hour clip (a frame every 4 s) gives --video_max_frames
    frames spread over the two hours, reached by seeking (the frames between are never decoded): seconds, not the
    1,800 frames."""
    import time
    args = video_args()
    clip = write_clip(tmp_path / "4k.mp4", 4, 3840, 2160, options={"preset": "ultrafast"})
    frames, _ = data.load_video(clip, args, 28, 2)
    assert frames.shape[1] * frames.shape[2] <= data.video_bounds(args, 28)[1]
    start = time.time()
    frames, meta = data.load_video(write_clip(tmp_path / "2h.mp4", 1800, fps=Fraction(1, 4)), args, 28, 2)
    assert meta["duration"] == 7200 and frames.shape[0] == 32 and time.time() - start < 30
    assert [index_of(f) for f in frames] == meta["frames_indices"] and meta["frames_indices"][-1] == 1799


RSS = """
import resource, sys
sys.path.insert(0, {root!r})
import data, flags
args = flags.parse_args(["--model", "MODEL", "--limit_videos", "1"])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
frames, meta = data.load_video({path!r}, args, 28, 2)
print("GROWTH_MB", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024, frames.nbytes // 2 ** 20)
"""


def test_a_long_clip_is_decoded_within_bounded_memory(tmp_path):
    """A 40 s 640 x 480 clip at 30 fps is 1,200 frames, 1.1 GB decoded whole; decoding only the chosen ones (each
    downscaled as it comes) keeps the process's peak within 150 MB of where it started (a fresh process, so that
    the peak is this decode's)."""
    path = write_clip(tmp_path / "long.mp4", 1200, 640, 480, options={"preset": "ultrafast"})
    out = subprocess.run([sys.executable, "-c", RSS.format(root=ROOT, path=path)], capture_output=True, text=True,
                         timeout=300)
    growth, kept = map(int, out.stdout.split("GROWTH_MB")[1].split())
    whole = 1200 * 640 * 480 * 3 // 2 ** 20
    print(f"peak RSS growth {growth} MB for {kept} MB of chosen frames; the whole clip decoded: {whole} MB")
    assert growth < 150 < whole // 5, (growth, whole)


# ----------------------------------------------------------------------------- vLLM and the trainer, every family
@pytest.fixture(scope="module", params=FAMILIES)
def family(request, llm_of, tmp_path_factory):
    """The motion model of a family, its engine (--tiny_task motion's flags), processor, policy, and samples: three
    videos, and one prompt with an image and a video."""
    from transformers import AutoProcessor
    arch = request.param
    model_dir, train_jsonl, _ = motion(arch)
    args = train.parse_args(["--tiny_task", "motion", "--tiny_arch", arch, "--max_completion_length", "8"])
    processor = AutoProcessor.from_pretrained(model_dir)
    dtype = torch.bfloat16 if model_py.use_bf16(args, {"model_type": arch}, cuda=False) else torch.float32
    policy = model_py.load_model(model_dir, args, dtype).eval()
    rows = data.read_jsonl(train_jsonl)[:4]
    rows[3]["image"] = str(tmp_path_factory.mktemp("image") / "red.png")
    Image.new("RGB", (56, 56), (200, 30, 30)).save(rows[3]["image"])
    samples = [data.prepare(r, processor, args) for r in rows]
    llm = llm_of(arch, model_dir, ("--tiny_task", "motion", "--max_completion_length", "8"))
    return types.SimpleNamespace(arch=arch, llm=llm, processor=processor, policy=policy, samples=samples,
                                 tol=TOL[dtype], args=args)


def test_vllm_and_the_trainer_get_the_same_frames_grids_and_tokens(family):
    """Through vLLM's own processing: its prompt tokens are the trainer's (Qwen3-VL's and Qwen3.5's timestamps
    included), and its vision tower is given the trainer's pixels (after vLLM's own rescale and normalization, done
    on the device with the image processor's mean and std) and grids, for an image beside a video too."""
    pixels, grids = [], []

    def capture(worker):   # vLLM runs in this process (external_launcher): its vision tower's inputs, recorded
        visual = worker.model_runner.model.visual
        embed, forward = visual.patch_embed.forward, visual.forward
        visual.patch_embed.forward = lambda x: pixels.append(x.detach().clone()) or embed(x)
        visual.forward = lambda x, grid_thw, **kw: grids.append(torch.as_tensor(grid_thw).tolist()) or \
            forward(x, grid_thw, **kw)
        return True

    def release(worker):
        del worker.model_runner.model.visual.patch_embed.forward, worker.model_runner.model.visual.forward
        return True
    family.llm.collective_rpc(capture)
    try:
        for s in family.samples:
            pixels.clear(), grids.clear()
            request = data.vllm_request(s)
            out = rollout.generate(family.llm, [request], [rollout.sampling_params(grpo.Sampling(), n=1, max_tokens=1)])
            assert list(out[0].prompt_token_ids) == s["hf"]["input_ids"][0].tolist()
            trainer = {k: (s["hf"][k], s["hf"][g].tolist()) for k, g in
                       (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")) if k in s["hf"]}
            assert len(pixels) == len(grids) == len(trainer)
            for x, grid in zip(pixels, grids):   # vLLM's order of the kinds is its own: matched by grid
                mine, = [p for p, g in trainer.values() if g == grid]   # in the tower's dtype (Qwen3.5: bf16)
                gap = (x.reshape(mine.shape).float() - mine.to(x.dtype).float()).abs().max()
                assert gap < 1e-5, gap
    finally:
        family.llm.collective_rpc(release)
    assert "pixel_values" in family.samples[3]["hf"] and family.samples[3]["videos"]


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.2, 0.9)])
def test_vllm_and_the_trainer_agree_on_video_prompts(family, temperature, top_p):
    """Sampler / trainer log-probs on video prompts (one with an image too) at T != 1: within 1e-4 in fp32 (measured
    ~1e-6), bf16's bound on Qwen3.5. Qwen2.5-VL's text after a video sits where vLLM puts it (model.rope_index:
    transformers 5.19 put it inside the video's temporal positions, 1.5e-3 apart here)."""
    from test_vllm_agreement import max_logp_diff
    rollout.sync_weights(family.llm, family.policy, bucket_mb=1024)
    diff = max_logp_diff(family.llm, family.policy, family.processor, family.samples, seed=5, temperature=temperature,
                         top_p=top_p)
    print(f"{family.arch} T={temperature} top_p={top_p}: max |vLLM - trainer| {diff:.1e}")
    assert diff < family.tol


def test_a_video_processor_normalizing_otherwise_is_normalized_on_the_host(monkeypatch):
    """vLLM 0.32 normalizes pixels on the device with the image processor's mean and std, videos' too (its
    Qwen3-VL did so to the first tiny models' videos, whose processors differed: 9e-3 apart); a checkpoint whose
    video processor has its own gets vLLM's host normalization, each processor's own, as the trainer's."""
    from transformers import AutoProcessor
    model_dir = motion("qwen3_vl")[0]
    args = train.parse_args(["--tiny_task", "motion", "--tiny_arch", "qwen3_vl"])
    assert "mm_device_do_normalize" not in rollout.engine_kwargs(model_dir, args, "float32", 8, 0, cuda=False)
    processor = AutoProcessor.from_pretrained(model_dir)
    processor.video_processor.image_mean = [0.1, 0.2, 0.3]
    monkeypatch.setattr(AutoProcessor, "from_pretrained", lambda *a, **k: processor)
    assert rollout.engine_kwargs(model_dir, args, "float32", 8, 0, cuda=False)["mm_device_do_normalize"] is False


# ----------------------------------------------------------------------------- the training forward
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_shared_prefix_forward_equals_the_standard_one_on_videos(arch, tmp_path):
    """--shared_prefix on video prompts (Qwen2.5-VL's time-spaced temporal positions, Qwen3-VL's frames between
    timestamps) and on one with an image and a video: each group's video encoded once, the log-probs and gradients
    of the standard path."""
    from transformers import AutoProcessor
    model_dir, train_jsonl, _ = motion(arch)
    processor = AutoProcessor.from_pretrained(model_dir)
    args = train.parse_args(["--tiny_task", "motion", "--tiny_arch", arch])
    rows = data.read_jsonl(train_jsonl)[:2]
    rows[1]["image"] = str(tmp_path / "blue.png")
    Image.new("RGB", (56, 56), (30, 30, 200)).save(rows[1]["image"])
    samples = [data.prepare(r, processor, args) for r in rows]
    samples.append(data.prepare({"question": "what is 2", "solution": "4", "_where": "t:1"}, processor, args))
    comps = [[[11, 12, 13], [14], [15, 16, 17, 18]], [[30, 31], [32, 33, 34]], [[40], [41, 42]]]
    model = model_py.load_model(model_dir, args, torch.float32)
    model.train()
    banned = rollout.checkpoint_banned_ids(model_dir, processor.tokenizer)
    pad = processor.tokenizer.pad_token_id
    patches = []
    model.model.visual.register_forward_hook(lambda mod, a, out: patches[-1].append(a[0].shape[0]))
    seqs = [(s, c) for s, cs in zip(samples, comps) for c in cs]
    batches = {"standard": data.collate([s for s, _ in seqs], [c for _, c in seqs], pad, banned),
               "prefix": data.collate_prefix(list(zip(samples, comps)), pad, banned)}
    out = {}
    for name, batch in batches.items():
        model.zero_grad()
        patches.append([])
        logps = model(**batch, sampling=grpo.Sampling(banned=tuple(banned)), vision_calls=2).logps
        (logps * batch["completion_mask"] * torch.arange(1, logps.shape[0] + 1)[:, None]).sum().backward()
        out[name] = logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    (a, ga), (b, gb) = out["standard"], out["prefix"]
    assert (a - b).abs().max() < 1e-5, (a - b).abs().max()
    # fp32 sums in another order (a video's gradient from 5 copies or from one): 3e-6 of gradients near 4, measured
    assert ga.keys() == gb.keys() and all(torch.allclose(ga[n], gb[n], rtol=1e-4, atol=1e-5) for n in ga)
    image, video = samples[1]["hf"]["pixel_values"].shape[0], samples[0]["hf"]["pixel_values_videos"].shape[0]
    assert patches == [[2 * image, 5 * video], [image, 2 * video]], patches   # each group's image and video once


def test_every_micro_batch_runs_the_vision_tower_as_often_as_the_busiest_rank():
    """ZeRO-3: a micro-batch of videos beside a rank's micro-batch of images and videos runs the tower twice (a
    dummy image), a text-only one twice (two dummies): same log-probs as without the dummies."""
    from transformers import AutoProcessor
    model_dir, train_jsonl, _ = motion()
    processor = AutoProcessor.from_pretrained(model_dir)
    args = train.parse_args(["--tiny_task", "motion"])
    video = data.prepare(data.read_jsonl(train_jsonl)[0], processor, args)
    text = data.prepare({"question": "what is 2", "solution": "4", "_where": "t:1"}, processor, args)
    model = model_py.load_model(model_dir, args, torch.float32).eval()
    calls = []
    model.model.visual.register_forward_hook(lambda *a: calls.append(1))
    banned = rollout.checkpoint_banned_ids(model_dir, processor.tokenizer)
    with torch.no_grad():
        for s, alone in ((video, 1), (text, 1)):
            batch = data.collate([s], [[5, 6]], processor.tokenizer.pad_token_id, banned)
            calls.clear()
            one = model(**batch, vision_calls=alone).logps
            assert len(calls) == 1
            calls.clear()
            two = model(**batch, vision_calls=2).logps
            assert len(calls) == 2 and torch.equal(one, two)


# ----------------------------------------------------------------------------- limits and the planner
def vllm_video_tokens(model_dir, args):
    """vLLM's own budget of a video (the largest it profiles and admits), under this run's engine arguments."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    kw = rollout.engine_kwargs(model_dir, args, "bfloat16", max_num_seqs=64, rank=0, cuda=True)
    mc = ModelConfig(model=model_dir, **{k: kw[k] for k in ("limit_mm_per_prompt", "mm_processor_kwargs",
                                                            "max_model_len")})
    return MULTIMODAL_REGISTRY.get_processing_info(mc).get_mm_max_tokens_per_item(
        seq_len=mc.max_model_len, mm_counts={"image": args.limit_images, "video": args.limit_videos})["video"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_planner_counts_a_video_as_vllm_and_the_processor_do(arch):
    """The motion task's bounds (8 frames, 4 tokens a frame): the planner's video tokens are those of its clips as
    prepared, and vLLM's budget for them (Qwen3-VL, Qwen3.5: exactly; Qwen2.5-VL's vLLM budgets 14 frames, more);
    with videos off vLLM profiles none."""
    from transformers import AutoProcessor
    model_dir, train_jsonl, _ = motion(arch)
    args = train.parse_args(["--tiny_task", "motion", "--tiny_arch", arch])
    grid = 2 * tiny.PATCH[arch]
    sample = data.prepare(data.read_jsonl(train_jsonl)[0], AutoProcessor.from_pretrained(model_dir), args)
    tokens = int((sample["hf"]["mm_token_type_ids"] == 2).sum())
    assert planner.video_tokens(args, grid) == tokens == 16
    assert vllm_video_tokens(model_dir, args) == (28 if arch == "qwen2_5_vl" else 16)
    off = train.parse_args(["--tiny_arch", arch])
    assert rollout.engine_kwargs(model_dir, off, "bfloat16", 8, 0, cuda=True)["limit_mm_per_prompt"]["video"] == 0


def test_the_planner_counts_a_real_size_video_as_vllm_does(tmp_path):
    """Qwen3-VL-8B (its published config; a processor of its grid), 64 frames at 448 x 448: 32 temporal patches of
    14 x 14 tokens, 6,272, in the plan and in vLLM's own budget; the update's activations and vLLM's encoder and KV
    budget grow by them; the video bounds are levers, each with what it saves."""
    import shutil
    shutil.copytree(motion("qwen3_vl")[0], tmp_path / "m", ignore=shutil.ignore_patterns("*.safetensors"))
    planner.builtin_config("qwen3-vl-8b").save_pretrained(tmp_path / "m")
    flags_ = ["--model", str(tmp_path / "m"), "--limit_videos", "1", "--video_max_frames", "64", "--video_min_pixels",
              str(448 * 448), "--video_max_pixels", str(448 * 448), "--video_total_pixels", str(64 * 448 * 448),
              "--min_pixels", str(4 * 1024), "--max_pixels", str(1280 * 1024), "--max_prompt_length", "8192", "--bf16"]
    args = train.parse_args(flags_)
    assert planner.video_tokens(args, 32) == vllm_video_tokens(str(tmp_path / "m"), args) == 32 * 14 * 14
    s = planner.model_shape("qwen3-vl-8b")
    cluster = planner.Cluster(8, 1, 80, 1024)
    plain = train.parse_args(flags_[:2] + flags_[4:])
    with_video, without = planner.plan(args, cluster, s), planner.plan(plain, cluster, s)
    assert with_video["video_tokens"] == 6272 and with_video["image_tokens"] == 6272 + 1280
    gpu = lambda pl, ph, term: pl["phases"][ph]["gpu"].get(term, 0)   # noqa: E731
    assert gpu(with_video, "update", "activations") > gpu(without, "update", "activations")
    assert gpu(with_video, "old_ref_logps", "vision tower forward (no grad)") > \
        gpu(without, "old_ref_logps", "vision tower forward (no grad)")
    names = [name for name, _ in planner.levers(args, cluster, s)]
    assert any(n.startswith("--video_max_frames 32") for n in names) and any("--video_total_pixels" in n for n in names)
    assert "6272 of them a prompt's videos" in planner.render(with_video, cluster)


# ----------------------------------------------------------------------------- two ranks, real .mp4 files
def test_the_motion_task_shows_the_way_only_across_frames():
    """The motion task is honest: whichever way the square moves, each frame of a clip puts it on each of
    the 16 patch positions for one of the 16 starts (the wrap), so a single frame says nothing of the way; the
    control's rows (tiny.build_motion_task's *_first_frame.jsonl) are the task's rows with each clip its first frame
    shown 8 times, decoded through PyAV like any clip, with the same frame count and prompt."""
    class Start:   # motion_frames' rng: the start (x0, y0) given
        def __init__(self, x, y):
            self.values = [x, y]

        def randrange(self, *_):
            return self.values.pop(0)
    starts = [(x, y) for x in range(0, tiny.SIZE, tiny.MOTION_STEP) for y in range(0, tiny.SIZE, tiny.MOTION_STEP)]
    for direction in tiny.MOTION_DIRECTIONS:
        clips = np.stack([tiny.motion_frames(direction, Start(*s)) for s in starts])   # (16, 8, 56, 56, 3)
        for k in range(tiny.MOTION_FRAMES):   # frame k over the 16 starts: the same set of frames for every way
            assert sorted(f.tobytes() for f in clips[:, k]) == sorted(f.tobytes() for f in clips[:, 0])
    _, train_jsonl, val_jsonl = motion()
    args = train.parse_args(["--tiny_task", "motion"])
    for path in (train_jsonl, val_jsonl):
        rows, still = (data.read_jsonl(p) for p in (path, path.replace(".jsonl", "_first_frame.jsonl")))
        assert [r["solution"] for r in rows] == [r["solution"] for r in still]
        assert {r["question"] for r in rows} == {r["question"] for r in still} == {tiny.MOTION_QUESTION}
        for row, control in list(zip(rows, still))[:4]:
            clip, _ = data.load_video(os.path.join(os.path.dirname(path), row["video"]), args, 28, 2)
            first, _ = data.load_video(os.path.join(os.path.dirname(path), control["video"]), args, 28, 2)
            assert clip.shape == first.shape == (8, 56, 56, 3) and np.ptp(first.astype(int), axis=0).max() <= 2
            assert np.abs(first[0].astype(int) - clip[0]).max() <= 8
            assert np.abs(clip[1].astype(int) - clip[0]).max() > 200


@pytest.mark.launch
def test_motion_task_with_a_video_rank_beside_a_text_only_rank(tmp_path):
    """A two-rank ZeRO-3 run of --tiny_task motion for 3 steps from a JSONL that names real .mp4 files written by
    PyAV (the task's own): rank 0 draws rows with a video and an image, rank 1 text-only rows. ZeRO-3 stays in step
    (each micro-batch runs the vision tower as often as the busiest rank's: rank 0 its image and its video, rank 1
    two dummies), vLLM and the trainer agree, nothing is skipped."""
    from conftest import launch
    _, train_jsonl, _ = motion()
    rows = [json.loads(line) for line in open(train_jsonl)][:16]
    text_rows = set(np.random.default_rng(0).permutation(16)[1::2].tolist())   # epoch 0: rank 1 reads every second row
    Image.new("RGB", (56, 56), (30, 160, 30)).save(tmp_path / "green.png")
    path = tmp_path / "mixed.jsonl"
    with open(path, "w") as f:
        for i, r in enumerate(rows):
            video = os.path.join(os.path.dirname(train_jsonl), r["video"])
            f.write(json.dumps({"question": "what is 2", "solution": "2"} if i in text_rows else
                               {**r, "video": video, "image": str(tmp_path / "green.png")}) + "\n")
    out, log = launch(tmp_path / "run", "--tiny_task", "motion", "--tiny_size", "tiny", "--train_data", str(path),
                      "--max_steps", "3", "--val_freq", "0", "--no-save_final_model", "--no-val_before_train",
                      "--rollout_batch_size", "4",
                      "--num_generations", "4", "--max_completion_length", "2", "--logprob_chunk_tokens", "1")
    train_rows = [r for r in out if "reward/mean" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3] and "skipped" not in log
    assert max(r["rollout/logp_diff_max"] for r in train_rows) < 1e-4, train_rows
