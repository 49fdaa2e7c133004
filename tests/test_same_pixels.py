"""One resize decides an image's pixels for vLLM and for training: for each family, a prompt's image and a tool's
image of 448, 5,000 and 10,000 px a side give the trainer's processor and vLLM's processor (built from the engine's own
arguments, rollout.engine_kwargs) the same image grid and the same pixel values, with --min_pixels equal to
--max_pixels and with ordinary bounds. Bounds that hold no size on the model's grid are refused at start."""
import functools

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

import data
import rollout
import toolbox
import train
from conftest import tiny_of

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_5"]
SIDES = [(448, 448), (5000, 5000), (10000, 10000), (10000, 7000)]   # (w, h) in pixels


@functools.lru_cache(maxsize=None)
def picture(w, h, seed=0):
    """A smooth random RGB image of w x h pixels (a 16 x 16 random image upscaled), made once per module; nothing
    alters it. Its info names it (copies keep that), for downscaled_once."""
    small = np.random.default_rng(seed).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    im = Image.fromarray(small).resize((w, h), Image.BICUBIC)
    im.info["picture"] = (w, h, seed)
    return im


@pytest.fixture(scope="module", autouse=True)
def downscaled_once():
    """data.downscale of one of these pictures (or a copy: open_image copies) to the same bounds on the same grid
    runs once per module: it is a pure function of the pixels and the bounds, and families on one grid (and the
    3136 px test beside the equal bounds) ask for the same resize of the same 10,000 px picture. The pictures and
    their resizes (1.2 GB) live while this module runs, not to the end of the session."""
    done, downscale = {}, data.downscale

    def once(img, min_pixels, max_pixels, factor):
        if "picture" not in img.info:
            return downscale(img, min_pixels, max_pixels, factor)
        key = (img.info["picture"], img.size, min_pixels, max_pixels, factor)
        if key not in done:
            done[key] = downscale(img, min_pixels, max_pixels, factor)
        return done[key]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(data, "downscale", once)
        yield
    done.clear()
    picture.cache_clear()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(arch, model dir, processor, a row of the colour task) of each family's tiny model."""
    model_dir, train_jsonl, _ = tiny_of(request.param)
    return request.param, model_dir, AutoProcessor.from_pretrained(model_dir), data.read_jsonl(train_jsonl)[0]


def run_args(arch, model_dir, processor, bounds):
    """The run's flags with `bounds` ("min max" pixels, or None for the tiny defaults), settled as startup.py does."""
    extra = ["--min_pixels", str(bounds[0]), "--max_pixels", str(bounds[1])] if bounds else []
    args = train.parse_args(["--tiny_arch", arch, "--max_prompt_length", "4096", *extra])
    args.min_pixels, args.max_pixels = data.pixel_bounds(args, processor)
    return args


def vllm_processor(model_dir, args):
    """vLLM's multimodal processor under the arguments the engine of this run gets."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    kw = rollout.engine_kwargs(model_dir, args, "float32", max_num_seqs=64, rank=0, cuda=False)
    keys = ("limit_mm_per_prompt", "mm_processor_kwargs", "max_model_len", "mm_device_do_normalize")
    return MULTIMODAL_REGISTRY.create_processor(ModelConfig(model=model_dir, **{k: kw[k] for k in keys if k in kw}))


def assert_same(processor, hf, vp, ids, images, what):
    """The trainer's processor output `hf` for `images` equals vLLM's for the same prompt ids and images: the grids
    exactly, the pixel values within 1e-6 (vLLM's uint8 normalized as its device would)."""
    v = vp(ids, vp.info.parse_mm_data({"image": images}))["mm_kwargs"].get_data()
    assert hf["image_grid_thw"].tolist() == v["image_grid_thw"].tolist(), \
        f"{what}: the trainer's grid {hf['image_grid_thw'].tolist()} != vLLM's {v['image_grid_thw'].tolist()}"
    pv = v["pixel_values"]
    if pv.dtype == torch.uint8:   # normalized on the device: mean and std of the image processor, per channel
        ip = processor.image_processor
        mean, std = torch.tensor(ip.image_mean)[:, None], torch.tensor(ip.image_std)[:, None]
        pv = ((pv.view(len(pv), 3, -1).float() * ip.rescale_factor - mean) / std).view(len(pv), -1)
    assert (pv - hf["pixel_values"]).abs().max().item() < 1e-6, what


CHECKED = set()   # (arch, min_pixels, max_pixels) that check_family passed in this process


def check_family(arch, model_dir, processor, row, bounds):
    """The trainer and vLLM see the same pixels for each of SIDES, a prompt's and a tool's, under `bounds`. Once per
    family and settled bounds: Qwen2.5-VL's 3136 px test asks again what its equal bounds test checked."""
    args = run_args(arch, model_dir, processor, bounds)
    if (arch, args.min_pixels, args.max_pixels) in CHECKED:
        return
    vp, grid = vllm_processor(model_dir, args), data.image_grid(processor)
    for w, h in SIDES:
        s = data.prepare(dict(row, image=picture(w, h)), processor, args)
        (seen,) = s["images"]
        what = f"{arch}, --min_pixels {args.min_pixels} --max_pixels {args.max_pixels}, a {w} x {h} image"
        assert_same(processor, s["hf"], vp, s["vllm_ids"], [seen], what)
        assert seen.width % grid == 0 and seen.height % grid == 0, what
        assert args.min_pixels <= seen.width * seen.height <= args.max_pixels, f"{what}: {seen.size}"
        # a tool's image takes the same path (toolbox.tool_image), and the trainer's processor sees it in answer()
        tool = toolbox.tool_image(picture(w, h, seed=1), s, "crop")
        text = toolbox.response(processor, [tool])
        hf = processor(text=[text], images=[tool], return_tensors="pt")
        ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert_same(processor, hf, vp, ids, [tool], f"{what} returned by a tool")
    CHECKED.add((arch, args.min_pixels, args.max_pixels))


def test_equal_bounds_give_both_sides_the_same_pixels(family):
    """--min_pixels == --max_pixels on the family's grid (the zoom task's: 4 tokens): 3136 px for Qwen2.5-VL's 28 px,
    4096 px for the 32 px of Qwen3-VL and Qwen3.5."""
    arch, model_dir, processor, row = family
    grid = data.image_grid(processor)
    check_family(arch, model_dir, processor, row, ((2 * grid) ** 2,) * 2)


def test_ordinary_bounds_give_both_sides_the_same_pixels(family):
    """The tiny defaults (1 to 4 tokens), and the real defaults' kind: the processor's minimum to 256 tokens."""
    arch, model_dir, processor, row = family
    grid = data.image_grid(processor)
    check_family(arch, model_dir, processor, row, None)
    check_family(arch, model_dir, processor, row, (processor.image_processor.size["shortest_edge"], 256 * grid ** 2))


def test_3136_is_one_size_for_qwen2_5_vl_and_refused_on_the_32_px_grid(family):
    """3136 px is 56 x 56 (or 28 x 112) on Qwen2.5-VL's grid; on a 32 px grid no size has 3136 px, and each
    processor would resize by its own bounds: refused at start, naming the flags and the sizes that are."""
    arch, model_dir, processor, row = family
    if data.image_grid(processor) == 28:
        check_family(arch, model_dir, processor, row, (3136, 3136))
        return
    with pytest.raises(SystemExit, match=r"--min_pixels 3136 --max_pixels 3136.*3072.*4096"):
        run_args(arch, model_dir, processor, (3136, 3136))


@pytest.mark.parametrize("grid", [28, 32])
@pytest.mark.parametrize("lo,hi", [(3136, 3136), (784, 3136), (4096, 4096), (3072, 3200), (1024, 1003520)])
@pytest.mark.parametrize("size", [(448, 448), (5000, 5000), (10000, 10000), (30, 45), (10000, 7000), (60, 9000),
                                  (2000, 11)])
def test_every_size_lands_inside_the_bounds_on_the_grid(size, grid, lo, hi):
    """Every image size lands on the grid with lo <= h * w <= hi whenever one such size exists, so that neither
    processor resizes it again; bounds with none give None, and downscale raises naming the flags."""
    if lo // grid ** 2 == hi // grid ** 2 and lo % grid ** 2:
        assert data.grid_size(size[1], size[0], lo, hi, grid) is None
        with pytest.raises(ValueError, match="--min_pixels"):
            data.downscale(Image.new("L", (1, 1)), lo, hi, grid)
        return
    h, w = data.grid_size(size[1], size[0], lo, hi, grid)
    assert w % grid == 0 and h % grid == 0 and lo <= w * h <= hi and max(w, h) <= 200 * min(w, h), (w, h)
