"""Bad input: each case gets a clear message naming the file, line or flag, and the run goes on."""
import json
import re

import pytest
from PIL import Image

import data
import train


@pytest.fixture(scope="module")
def processor(tiny_default):
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(tiny_default[0])


def args_for(*flags):
    return train.parse_args(list(flags))


def write_task(tmp_path, lines):
    Image.new("RGB", (56, 56), (255, 0, 0)).save(tmp_path / "ok.png")
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    path = tmp_path / "data.jsonl"
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else (json.dumps(line) + "\n").encode())
    return path


def row(image, **extra):
    return {"image": image, "question": "What colour is the shape?", "solution": "red", **extra}


def test_bad_lines_are_skipped_with_their_line_number(tmp_path, capsys):
    path = write_task(tmp_path, [row("ok.png"), b"\n", b"{not json\n", b"\xff\xfe bad utf8\n", row("ok.png")])
    rows = data.read_jsonl(str(path))
    assert len(rows) == 2
    out = capsys.readouterr().out
    assert f"{path}:3" in out and "JSONDecodeError" in out
    assert f"{path}:4" in out and "UnicodeDecodeError" in out


def test_json_that_is_not_an_object_is_skipped_and_a_bom_is_read(tmp_path, capsys):
    good = json.dumps(row("ok.png")).encode()
    path = write_task(tmp_path, [b"\xef\xbb\xbf" + good + b"\n", b"[1, 2]\n", b'"x"\n', b"7\n", good + b"\n"])
    rows = data.read_jsonl(str(path))
    assert [r["_where"] for r in rows] == [f"{path}:1", f"{path}:5"]     # the BOM line is read, not lost
    out = capsys.readouterr().out
    assert f"{path}:2: skipped, ValueError: a JSON list, not an object" in out
    assert f"{path}:3: skipped, ValueError: a JSON str" in out and f"{path}:4: skipped, ValueError: a JSON int" in out


def test_empty_file_is_refused(tmp_path):
    path = write_task(tmp_path, [b"\n"])
    with pytest.raises(SystemExit, match="no usable samples"):
        data.read_jsonl(str(path))


@pytest.mark.parametrize("sample,flags,message", [
    (row("missing.png"), [], "missing.png"),
    (row("corrupt.png"), [], "corrupt.png"),
    (row(["ok.png", "ok.png"]), ["--limit_images", "1"], "2 images > --limit_images 1"),
    (row("ok.png"), ["--max_prompt_length", "10"], "--max_prompt_length 10"),
    (row(7), [], "image field holds int 7"),
    (row(True), [], "image field holds bool True"),
    (row(["ok.png", 3.5]), ["--limit_images", "2"], "image field holds float 3.5"),
    ({"image": "ok.png", "solution": "red"}, ["--question_template", "{question}"],
     "no field 'question' that --question_template '{question}' needs; the sample has \\['image', 'solution'\\]"),
    (row({}), [], "image field holds {}: an HF datasets image with neither bytes nor a path"),
    (row({"bytes": None, "path": None}), [], "neither bytes nor a path"),
    (row("http://example.com/a.png"), [], "is a URL; URLs are not fetched"),
    (b'{"image": "ok.png", "question": "q", "solution": NaN}\n', [], "solution is nan, not a finite number"),
    (b'{"image": "ok.png", "question": "q", "solution": Infinity}\n', [], "solution is inf, not a finite number"),
])
def test_unusable_samples_are_named(tmp_path, processor, sample, flags, message):
    path = write_task(tmp_path, [sample])
    with pytest.raises(ValueError, match=message) as e:
        data.prepare(data.read_jsonl(str(path))[0], processor, args_for(*flags))
    assert f"{path}:1" in str(e.value)


def test_an_empty_image_field_is_a_counted_text_only_sample(tmp_path, processor, capsys):
    """A parquet image cell of None (or "image": "" in JSONL): the sample is trained as a text-only
    prompt, as a mixed dataset means it, and counted (data/empty_images), with one message naming it."""
    path = write_task(tmp_path, [row(None), row(""), row("ok.png")])
    stream = data.PromptStream(data.read_jsonl(str(path)), processor, args_for(), rank=0, world=1)
    got = stream.next(3)
    assert sorted(len(s["images"]) for s in got) == [0, 0, 1] and stream.empty_images == 2 and stream.skipped == 0
    assert capsys.readouterr().out.count("the image field is empty") == 1
    assert data.PromptStream(data.read_jsonl(str(path)), processor, args_for(), 0, 1).state()["empty_images"] == 0


def test_stream_skips_and_counts_bad_samples(tmp_path, processor):
    path = write_task(tmp_path, [row("ok.png"), row("missing.png"), row("corrupt.png"), row("ok.png", solution="blue")])
    stream = data.PromptStream(data.read_jsonl(str(path)), processor, args_for(), rank=0, world=1)
    got = stream.next(4)   # 4 good samples from a file with 2: wraps into the next epoch
    assert len(got) == 4 and all(s["images"][0].size == (56, 56) for s in got)
    assert stream.skipped >= 2
    assert {s["columns"]["solution"] for s in got} == {"red", "blue"}


@pytest.mark.parametrize("arch,grid", [("qwen2_5_vl", 28), ("qwen3_vl", 32), ("qwen3_5", 32)])
def test_same_pixels_for_vllm_and_training(tmp_path, arch, grid):
    """Each family's grid (patch x merge, read from its processor): the image is downscaled once onto
    it, and the processor, which resizes anything off its grid, leaves it as it is."""
    from transformers import AutoProcessor

    from conftest import tiny_of
    processor = AutoProcessor.from_pretrained(tiny_of(arch)[0])
    assert train.model.image_grid(processor) == grid
    Image.new("RGB", (300, 200), (0, 0, 255)).save(tmp_path / "big.png")
    path = write_task(tmp_path, [row("big.png")])
    s = data.prepare(data.read_jsonl(str(path))[0], processor,
                     args_for("--tiny_arch", arch, "--max_pixels", str(grid * grid * 16)))
    w, h = s["images"][0].size
    assert w * h <= grid * grid * 16 and w % grid == 0 and h % grid == 0
    t, gh, gw = s["hf"]["image_grid_thw"][0].tolist()
    assert (gh * grid // 2, gw * grid // 2) == (h, w)     # the processor did not resize again
    assert s["vllm_ids"].count(processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 1


def test_pixel_bounds_default_to_the_model_and_stay_inside_its_processor(processor):
    """--min_pixels / --max_pixels left out: the processor's minimum and 1,280 tokens on the model's
    grid (1003520 px at Qwen2.5-VL's 28); outside the processor's bounds: refused, it would resize again."""
    args = args_for("--model", "somewhere", "--train_data", "x.jsonl")
    assert (args.min_pixels, args.max_pixels) == (None, None)
    assert data.pixel_bounds(args, processor) == (processor.image_processor.size["shortest_edge"], 1003520)
    with pytest.raises(SystemExit, match="outside the processor's"):
        data.pixel_bounds(args_for("--model", "m", "--min_pixels", "100"), processor)


@pytest.mark.parametrize("flags,world,message", [
    (["--rollout_batch_size", "15"], 2, "15 is not divisible by 2 ranks"),
    (["--rollout_batch_size", "16", "--num_generations", "7", "--per_device_train_batch_size", "6"], 2,
     "16 / 2 prompts x 7 generations = 56 sequences, not divisible by --per_device_train_batch_size 6"),
    (["--num_generations", "1"], 1, "--num_generations must be >= 2"),
    (["--vllm_tensor_parallel_size", "4"], 2, "not divisible by --vllm_tensor_parallel_size 4"),
])
def test_impossible_flags_are_refused_with_the_arithmetic(flags, world, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        train.check_args(args_for(*flags), world)


def test_possible_flags_give_micro_batch_count():
    args = args_for("--num_generations", "7", "--per_device_train_batch_size", "7", "--rollout_batch_size", "16")
    assert train.check_args(args, 2) is None and train.grad_accumulation_steps(args, 2) == 8


def test_overlong_prompt_error_mode_stops_the_run(tmp_path, processor):
    path = write_task(tmp_path, [row("ok.png")])
    stream = data.PromptStream(data.read_jsonl(str(path)), processor,
                               args_for("--max_prompt_length", "10", "--overlong_prompt", "error"), rank=0, world=1)
    with pytest.raises(SystemExit, match="--max_prompt_length 10"):
        stream.next(1)


@pytest.mark.parametrize("world,expected", [(1, 32), (2, 28)])
def test_default_micro_batch_divides_the_rank_sequences(world, expected):
    args = args_for("--num_generations", "7")           # the command researchers type
    train.check_args(args, world)
    assert args.per_device_train_batch_size is None      # check_args checks; micro_batch derives
    assert train.micro_batch(args, world) == expected    # 32 / world x 7 sequences, divisor <= 32 on the tiny model
    assert train.micro_batch(args_for("--model", "m", "--num_generations", "7"), world) == 8   # <= 8 otherwise (112 or 56)


def test_vlm_r1_layout_r1v_layout_and_column_mapping(tmp_path, processor):
    path = write_task(tmp_path, [
        {"id": 1, "image": "ok.png", "conversations": [{"from": "human", "value": "<image>Where is the cat?"},
                                                        {"from": "gpt", "value": "[1, 2, 3, 4]"}]},
        {"image": "ok.png", "problem": "What is 1+1?", "solution": "2"},
        {"img": "ok.png", "query": "Which colour?", "answer": "red", "difficulty": 3},
    ])
    rows = data.Rows(str(path), columns=["image=img", "question=query", "solution=answer"])
    assert (rows[0]["question"], rows[0]["solution"]) == ("Where is the cat?", "[1, 2, 3, 4]")
    assert (rows[1]["question"], rows[1]["solution"]) == ("What is 1+1?", "2")
    assert (rows[2]["question"], rows[2]["solution"], rows[2]["image"]) == ("Which colour?", "red", "ok.png")
    s = data.prepare(rows[2], processor, args_for())
    assert s["columns"]["difficulty"] == 3 and s["columns"]["seen_size"] == [56, 56]   # extra fields reach rewards


def test_image_root_and_multi_image(tmp_path, processor):
    (tmp_path / "imgs").mkdir()
    for name, colour in (("a.png", "red"), ("b.png", "blue")):
        Image.new("RGB", (56, 84), colour).save(tmp_path / "imgs" / name)
    path = write_task(tmp_path, [row(["a.png", "b.png"])])
    s = data.prepare(data.Rows(str(path), image_root=str(tmp_path / "imgs"))[0], processor, args_for("--limit_images", "2"))
    assert [im.getpixel((0, 0)) for im in s["images"]] == [(255, 0, 0), (0, 0, 255)]
    assert s["hf"]["image_grid_thw"].shape[0] == 2
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert s["vllm_ids"].count(pad) == 2                                   # one per image for vLLM
    expanded = int(s["hf"]["image_grid_thw"].prod(-1).sum()) // 4          # 2x2 patches merge into a token
    assert (s["hf"]["input_ids"][0] == pad).sum().item() == expanded >= 2    # expanded for training


@pytest.mark.parametrize("kind", ["parquet", "save_to_disk"])
def test_hf_datasets_sources(tmp_path, processor, kind):
    import io

    import datasets
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), "green").save(buf, "PNG")
    ds = datasets.Dataset.from_dict({"picture": [{"bytes": buf.getvalue(), "path": None}] * 2,
                                     "question": ["Which colour?"] * 2, "solution": ["green", "green"]})
    ds = ds.cast_column("picture", datasets.Image())
    if kind == "parquet":
        path = str(tmp_path / "d.parquet")
        ds.to_parquet(path)
    else:
        path = str(tmp_path / "d")
        ds.save_to_disk(path)
    rows = data.Rows(path, columns=["image=picture"])
    assert len(rows) == 2
    s = data.prepare(rows[1], processor, args_for())
    assert s["images"][0].getpixel((0, 0)) == (0, 128, 0) and s["where"] == f"{path}[1]"
