"""Bad input: each case gets a clear message naming the file, line or flag, and the run goes on."""
import json
import re
import subprocess
import sys

import pytest
from PIL import Image

import data
import model as model_py
import toolbox
import train
from conftest import ROOT


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


def test_an_images_content_id_is_its_pixels_own():
    """vLLM keys its caches on the ids data.vllm_request sends (multi_modal_uuids), so an id must change with any
    pixel, the size or the mode, and stay with the content (a copy, the same pixels decoded again)."""
    im = Image.new("RGB", (4, 4), (10, 20, 30))
    dot = im.copy()
    dot.putpixel((3, 3), (10, 20, 31))
    ids = {data.content_id(x)
           for x in (im, dot, im.resize((8, 2)), Image.new("RGB", (2, 8), (10, 20, 30)), im.convert("RGBX"))}
    assert len(ids) == 5 and data.content_id(im.copy()) == data.content_id(im)


@pytest.mark.parametrize("arch,grid", [("qwen2_5_vl", 28), ("qwen3_vl", 32), ("qwen3_5", 32)])
def test_same_pixels_for_vllm_and_training(tmp_path, arch, grid):
    """Each family's grid (patch x merge, read from its processor): the image is downscaled once onto
    it, and the processor, which resizes anything off its grid, leaves it as it is."""
    from transformers import AutoProcessor

    from conftest import tiny_of
    processor = AutoProcessor.from_pretrained(tiny_of(arch)[0])
    assert model_py.image_grid(processor) == grid
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
    # <= 8 otherwise (112 or 56)
    assert train.micro_batch(args_for("--model", "m", "--num_generations", "7"), world) == 8


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
    s = data.prepare(data.Rows(str(path), image_root=str(tmp_path / "imgs"))[0], processor,
                     args_for("--limit_images", "2"))
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


def test_an_image_path_that_climbs_out_of_the_image_root_is_refused(tmp_path, processor):
    """A relative path is read under the image root (--image_root, default: the data file's folder), never
    above it (`../../..` would read any file the run can); an absolute path stays the user's explicit choice."""
    (tmp_path / "root" / "sub").mkdir(parents=True)
    Image.new("RGB", (56, 56), (255, 0, 0)).save(tmp_path / "outside.png")
    Image.new("RGB", (56, 56), (0, 0, 255)).save(tmp_path / "root" / "inside.png")
    path = write_task(tmp_path / "root", [row("../outside.png"), row("sub/../../outside.png"),
                                          row("sub/../inside.png"), row(str(tmp_path / "outside.png")),
                                          row({"path": "../outside.png", "bytes": None})])
    rows = data.Rows(str(path))
    for i in (0, 1, 4):
        with pytest.raises(ValueError, match=r"climbs out of the image root") as e:
            data.prepare(rows[i], processor, args_for())
        assert f"{path}:{i + 1}" in str(e.value) and "../outside.png" in str(e.value)
    assert data.prepare(rows[2], processor, args_for())["images"][0].getpixel((0, 0)) == (0, 0, 255)
    assert data.prepare(rows[3], processor, args_for())["images"][0].getpixel((0, 0)) == (255, 0, 0)
    # --image_root: the folder the paths start from is the one they may not leave
    path = write_task(tmp_path / "root", [row("../inside.png")])
    with pytest.raises(ValueError, match=r"climbs out of the image root .*/root/sub "):
        data.prepare(data.Rows(str(path), image_root=str(tmp_path / "root" / "sub"))[0], processor, args_for())


def test_a_link_out_of_the_image_root_is_followed_and_said_and_a_videos_refusal_says_video(tmp_path, processor, capsys):
    """A link inside the data folder was followed anywhere without a word. Links are trusted (a linked
    image folder and a Hugging Face snapshot, whose files are links into its blobs/, are common layouts; a data
    file's line cannot make one, as it can write `../`): followed, and said once per folder they lead from and to,
    naming the link. And a video path that climbs out was refused as an "image"."""
    outside, root = tmp_path / "elsewhere", tmp_path / "root"
    (outside / "imgs").mkdir(parents=True)
    root.mkdir()
    Image.new("RGB", (56, 56), (0, 0, 255)).save(outside / "imgs" / "a.png")
    Image.new("RGB", (56, 56), (0, 255, 0)).save(outside / "b.png")
    (root / "images").symlink_to(outside / "imgs")
    (root / "b.png").symlink_to(outside / "b.png")
    path = write_task(root, [row("images/a.png"), row("images/a.png"), row("b.png"), row("ok.png")])
    rows = data.Rows(str(path))
    capsys.readouterr()
    assert [data.prepare(rows[i], processor, args_for())["images"][0].getpixel((0, 0)) for i in range(4)] == \
        [(0, 0, 255), (0, 0, 255), (0, 255, 0), (255, 0, 0)]
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[data]")]
    assert said == [f"[data] {root / 'images'} is a link to {outside / 'imgs'}, outside the image root {root}: "
                    f"followed (links in a data folder are trusted, docs/data.md); said once for the links in {root} "
                    f"into {outside}"]
    path = write_task(root, [{"video": "../clip.mp4", "question": "Which way?", "solution": "left"}])
    with pytest.raises(ValueError, match=r"data.jsonl:1: video '../clip.mp4' climbs out of the image root"):
        data.prepare(data.Rows(str(path))[0], processor, args_for("--limit_videos", "1"))


def test_a_validation_file_with_no_usable_sample_is_refused(tmp_path, processor):
    """Every sample of --val_data skipped: a clear error at start naming the file, the count and the first
    reasons, not a val/reward of 0.0 from no sample at all."""
    path = write_task(tmp_path, [row("missing.png"), b"{not json\n", row("corrupt.png"), row(7), row("gone.png")])
    args = args_for("--val_data", str(path))
    with pytest.raises(SystemExit) as e:
        data.validation_samples(args, processor, rank=0, world=1)
    msg = str(e.value)
    assert f"--val_data {path}" in msg and "all 4 of its samples were skipped" in msg
    assert msg.index(f"{path}:1: image") < msg.index(f"{path}:3: image") < msg.index(f"{path}:4: image")
    assert ":5:" not in msg and "(and 1 more, each reported above)" in msg
    # one usable sample is enough
    path = write_task(tmp_path, [row("missing.png"), row("ok.png")])
    assert len(data.validation_samples(args_for("--val_data", str(path)), processor, rank=0, world=1)) == 1


def test_no_usable_validation_sample_is_decided_over_all_ranks():
    """Each rank prepares every world-th sample: a rank without a usable sample of its own is fine while another
    has one, and when none has, every rank refuses alike, with the first reasons in the file's order."""
    share = lambda kept, *lines: (kept, len(lines), [(i, f"v.jsonl:{i + 1}: bad") for i in lines])  # noqa: E731
    assert data.check_validation("v.jsonl", [share(0, 0, 2), share(1, 1)]) is None
    with pytest.raises(SystemExit) as e:
        data.check_validation("v.jsonl", [share(0, 0, 2, 4, 6), share(0, 1, 3, 5)])
    assert "all 7 of its samples were skipped" in str(e.value)
    assert "v.jsonl:1: bad\n  v.jsonl:2: bad\n  v.jsonl:3: bad\n  (and 4 more" in str(e.value)


@pytest.mark.launch
def test_an_all_bad_validation_file_stops_the_run_at_start(tmp_path):
    """Two ranks, each with its share of a validation file of unusable samples: both refuse at start, before any
    validation, and nothing logs a val/reward."""
    from conftest import FAST, command
    path = write_task(tmp_path, [row("missing.png"), row("corrupt.png"), row("gone.png")])
    cmd, env = command(tmp_path / "out", [*FAST, "--val_data", str(path), "--val_only"], procs=2)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    log = r.stdout + r.stderr
    assert r.returncode != 0, log[-3000:]
    assert f"error: --val_data {path} has no usable sample: all 3 of its samples were skipped" in log, log[-3000:]
    metrics = tmp_path / "out" / "metrics.jsonl"
    assert not metrics.exists() or "val/reward" not in metrics.read_text()


# ----------------------------------------------------------------------------- the data position
def taking(monkeypatch):
    """PromptStream.next without images or a processor: a prepared sample is its row's id."""
    monkeypatch.setattr(data, "prepare", lambda r, processor, args, *rest: {"id": r["_id"], "empty_image": False})


def take(stream, k):
    """k samples from `stream`, one at a time -> [(epoch it came from, row id)]."""
    return [(got["id"], stream.epoch)[::-1] for got in (stream.next(1)[0] for _ in range(k))]


@pytest.mark.parametrize("old,new,counts", [(2, 1, [5, 4]), (1, 2, [7]), (3, 2, [2, 3, 1]), (2, 3, [6, 5])])
def test_another_number_of_ranks_goes_on_through_the_epoch_without_repeating_a_row(monkeypatch, old, new, counts):
    """A checkpoint of `old` ranks resumed on `new`: the new ranks go on through the same epoch's permutation and
    skip the rows the old ones took (uneven counts: a rank that skipped bad samples; 11 rows of 3 ranks: one rank
    wraps into epoch 1 first). Every row comes exactly once in epoch 0, over both launches, and epoch 1 is again
    a whole permutation. Before, a resume on another number of ranks was refused."""
    taking(monkeypatch)
    rows = [{"_id": i} for i in range(11)]
    args = args_for("--seed", "3")
    before = [data.PromptStream(rows, None, args, r, old) for r in range(old)]
    taken = [x for s, k in zip(before, counts) for x in take(s, k)]
    after = [data.PromptStream(rows, None, args, r, new) for r in range(new)]
    for s in after:
        s.regroup([b.state() for b in before])
    while any(s.epoch == 0 for s in after):   # round robin, as the ranks step together, until all are in epoch 1
        taken += [x for s in after for x in take(s, 1)]
    assert sorted(i for e, i in taken if e == 0) == list(range(11))
    assert all(e <= 1 for e, _ in taken)
    later = [i for e, i in taken if e == 1]
    assert len(later) == len(set(later))   # epoch 1: no row twice
    again = [data.PromptStream(rows, None, args, r, new) for r in range(new)]   # the regrouped state saves and loads
    for s, a in zip(after, again):
        a.load(s.state())
        assert a.state() == s.state()


def test_regroup_carries_the_counts_and_the_history(monkeypatch):
    """The skipped and empty-image counts (summed over ranks in the logs) go whole to rank 0, the history (the
    same on every rank) to every rank."""
    taking(monkeypatch)
    rows = [{"_id": i} for i in range(8)]
    before = [data.PromptStream(rows, None, args_for(), r, 2) for r in range(2)]
    for s, k in zip(before, (3, 1)):
        s.skipped, s.empty_images, s.history = k, 2 * k, {"a": [1.0], "b": [0.0]}
    after = [data.PromptStream(rows, None, args_for(), r, 1) for r in range(1)] + \
        [data.PromptStream(rows, None, args_for(), r, 3) for r in (1, 2)]
    for s in after:
        s.regroup([b.state() for b in before])
    assert [(s.skipped, s.empty_images) for s in after] == [(4, 8), (0, 0), (0, 0)]
    assert all(s.history == {"a": [1.0], "b": [0.0]} for s in after)


def test_a_sample_is_known_by_its_content_or_its_own_id_wherever_its_row_moves(tmp_path, processor):
    """The per-prompt history was keyed by the row number, so after a shuffle of the file it
    pointed at other samples. A sample's id is now its own "id" field when every row has a distinct one, else
    a hash of its content; a shuffle or an append keeps every sample's id, and the history still finds them."""
    lines = [row(f"img{i}.png", solution=["red", "blue"][i % 2]) for i in range(6)]
    path = write_task(tmp_path, lines)
    rows = data.Rows(str(path))
    ids = {rows[i]["image"]: rows[i]["_id"] for i in range(len(rows))}
    assert len(set(ids.values())) == 6 and all(str(i).startswith("sha1:") for i in ids.values())
    history = {rows[i]["_id"]: [float(i)] for i in range(len(rows))}   # what train.score keeps
    import random
    random.Random(0).shuffle(lines)
    moved = data.Rows(str(write_task(tmp_path, lines + [row("new.png")])))
    assert {moved[i]["image"]: moved[i]["_id"] for i in range(6)} == {lines[i]["image"]: ids[lines[i]["image"]]
                                                                     for i in range(6)}
    assert [history[moved[i]["_id"]] for i in range(6)] == [[float(int(lines[i]["image"][3]))] for i in range(6)]
    own = data.Rows(str(write_task(tmp_path, [dict(row("ok.png"), id=f"q{i}") for i in range(3)])))
    assert [own[i]["_id"] for i in range(3)] == ["q0", "q1", "q2"]
    twice = data.Rows(str(write_task(tmp_path, [dict(row("ok.png", solution=s), id=7) for s in ("red", "blue")])))
    assert twice[0]["_id"] != twice[1]["_id"] and str(twice[0]["_id"]).startswith("sha1:")   # a repeated id: content
    got = data.prepare(own[1], processor, args_for())
    assert got["id"] == "q1"


def test_a_history_saved_by_row_number_is_read_by_sample_id(tmp_path):
    """A checkpoint from before sample ids keyed the history by row number: it is read with the ids of the rows at
    those numbers now (right when the file did not change, which such a checkpoint cannot tell)."""
    rows = data.Rows(str(write_task(tmp_path, [row(f"img{i}.png") for i in range(3)])))
    stream = data.PromptStream(rows, None, args_for(), 0, 1)
    stream.load({"epoch": 0, "cursor": 2, "skipped": 0, "history": {0: [1.0], 2: [0.5], 9: [0.0]}})
    assert stream.history == {rows[0]["_id"]: [1.0], rows[2]["_id"]: [0.5]}
    saved = stream.state()
    stream.load(saved)
    assert stream.history == {rows[0]["_id"]: [1.0], rows[2]["_id"]: [0.5]} and saved["history_by"] == "sample_id"


# ----------------------------------------------------------------------------- the data read first
def test_the_peers_field_names_are_read_as_ours(tmp_path, processor):
    """EasyR1's "problem" with its "<image>" placeholder and "answer", TRL's and EasyR1's string "prompt", and the
    "img" / "image_path" of LLaVA-style data are read as question, solution and image (an image under them trained
    text-only before, and a missing solution scored nothing); our own fields win where both are given."""
    path = write_task(tmp_path, [
        {"img": "ok.png", "problem": "<image>What colour is the shape?", "answer": "red"},
        {"image_path": "ok.png", "prompt": "What colour?", "answer": "red"},
        {"image": "ok.png", "img": "other.png", "question": "Q", "solution": "blue", "answer": "red"},
        {"prompt": [{"role": "user", "content": "hi"}], "solution": "x"}])
    rows = data.Rows(str(path))
    first = data.prepare(rows[0], processor, args_for())
    assert first["images"] and first["columns"]["solution"] == "red" and first["columns"]["answer"] == "red"
    assert rows[0]["question"] == "What colour is the shape?"
    assert "<image>" not in processor.tokenizer.decode(first["vllm_ids"])
    assert rows[1]["image"] == "ok.png" and rows[1]["question"] == "What colour?" and rows[1]["solution"] == "red"
    assert (rows[2]["image"], rows[2]["question"], rows[2]["solution"]) == ("ok.png", "Q", "blue")
    assert "question" not in rows[3]   # a list of messages is no question of ours


def test_check_source_reads_every_row_and_says_each_reason_once_with_its_count(tmp_path):
    """Every row is read before anything heavy, nothing decoded: a repeated reason is said once with its count and
    its first rows, the peers' names read as ours and the fields nothing reads are named, the fields a chosen reward
    needs too; the most images and videos a usable row holds are the data's limits; no usable row is an error."""
    rows = [{"img": "ok.png", "question": "q", "solution": "red", "difficulty": 3}] * 3 + \
        [row("gone.png")] * 101 + [{"image": ["ok.png", "ok.png"], "question": "q"}]
    path = write_task(tmp_path, rows)
    v = data.check_source(str(path), args_for())
    text = "\n".join(v["lines"])
    assert (v["rows"], v["usable"], v["images"], v["videos"], v["error"]) == (105, 3, 1, 0, None), text
    assert "105 rows read and checked" in text and text.count("gone.png") == 3   # its first three rows, once
    assert "101 x its image file is not there" in text and f"{path}:4 ({tmp_path}/gone.png)" in text
    assert "1 x no field 'solution', which --reward_funcs accuracy needs" in text
    assert '"img" as "image" (3 rows)' in text and '"difficulty" (3 rows)' in text
    v = data.check_source(str(path), args_for("--reward_funcs", "format"))   # format needs no solution
    assert (v["usable"], v["images"]) == (4, 2)
    v = data.check_source(str(write_task(tmp_path, [row("gone.png")] * 2)), args_for(), "--val_data")
    assert v["error"].startswith("error: --val_data") and "all 2 of its samples were skipped" in v["error"]


def test_the_limits_follow_from_the_data_unless_the_launch_set_them():
    """--limit_images and --limit_videos default to what the data holds (a JSONL of videos no longer needs
    --limit_videos 1), plus with --tools an image a turn after a call; a limit given on the command line stays."""
    args = args_for("--model", "M", "--train_data", "t.jsonl")
    said = data.data_limits(args, 2, 1)
    assert (args.limit_images, args.limit_videos) == (2, 1)
    assert "--limit_images 2" in said and "--limit_videos 1" in said
    args = args_for("--model", "M", "--tools", "crop", "--max_turns", "3")
    data.data_limits(args, 1, 0, toolbox.image_limit(args, 0))
    assert (args.limit_images, args.limit_videos) == (3, 0)
    args = args_for("--model", "M", "--limit_images", "1", "--limit_videos", "0")
    assert data.data_limits(args, 2, 1) is None and (args.limit_images, args.limit_videos) == (1, 0)


def test_a_repeated_skip_is_said_once(tmp_path, processor, capsys):
    """One bad row among few is met again every epoch: it was printed each time (101 identical lines before the
    run stopped); now once, and counted in data/skipped."""
    path = write_task(tmp_path, [row("ok.png"), row("gone.png")])
    stream = data.PromptStream(data.read_jsonl(str(path)), processor, args_for(), rank=0, world=1)
    stream.next(20)
    out = capsys.readouterr().out
    assert stream.skipped >= 10 and out.count("rank 0: skipped") == 1 and "gone.png" in out and "said once" in out


def test_the_data_check_phase_sets_the_limits_on_every_rank_or_stops_them(tmp_path, world1):
    """startup.check_data, before vLLM starts and the model loads: rank 0 reads the data and every rank takes its
    verdict (a broadcast): the data's limits, or the stop naming the file."""
    import startup
    Image.new("RGB", (56, 56)).save(tmp_path / "a.png")
    path = write_task(tmp_path, [{"image": ["a.png", "a.png"], "question": "q", "solution": "s"}])
    args = args_for("--model", "M", "--train_data", str(path))
    startup.check_data(args, 0)
    assert args.limit_images == 2
    bad = write_task(tmp_path / "..", [row("gone.png")])
    with pytest.raises(SystemExit, match=f"--train_data {bad} has no usable sample"):
        startup.check_data(args_for("--model", "M", "--train_data", str(bad)), 0)


def test_check_data_alone_names_an_img_key_without_loading_a_model(tmp_path):
    """`train.py --check_data` on a file whose images are under "img": seconds, no model (a --model that does not
    exist), no vLLM; it names "img" as read for "image", the limits, and exits 0 when every row is usable."""
    import time
    Image.new("RGB", (56, 56)).save(tmp_path / "a.png")
    path = write_task(tmp_path, [{"img": "a.png", "question": "q", "solution": "s"}] * 3)
    t0 = time.time()
    r = subprocess.run([sys.executable, "train.py", "--check_data", "--model", "nobody/not-on-disk", "--train_data",
                        str(path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert '"img" as "image" (3 rows)' in r.stdout and "3 rows read and checked" in r.stdout
    assert "[data] from the data: --limit_images 1" in r.stdout and "vLLM" not in r.stdout + r.stderr
    print(f"--check_data: {time.time() - t0:.1f} s, imports included")


def test_plan_reads_the_data_for_its_limits(tmp_path, capsys):
    """`train.py --plan` reads --train_data where cheap (nothing decoded): a JSONL of two videos a row is planned
    with --limit_videos 2, said."""
    import startup
    path = write_task(tmp_path, [{"video": ["a.mp4", "b.mp4"], "question": "q", "solution": "s"}])
    for name in ("a.mp4", "b.mp4"):
        (tmp_path / name).write_bytes(b"not decoded by the check")
    args = args_for("--plan", "--tiny_task", "motion", "--train_data", str(path))
    startup.print_plan(args)
    out = capsys.readouterr().out
    assert "--limit_videos 2 (the most videos in a row)" in out and args.limit_videos == 2 and "[plan]" in out


@pytest.mark.launch
def test_a_train_file_with_no_usable_row_stops_the_launch_before_vllm_starts(tmp_path):
    """Two ranks under the launcher, a --train_data whose every row names a missing image: rank 0's check says the
    reason once with its count, every rank stops on its verdict, and no vLLM engine starts (the data was read after
    vLLM had started and the model had loaded, before)."""
    from conftest import FAST, command
    path = write_task(tmp_path, [row("gone.png")] * 3)
    cmd, env = command(tmp_path / "out", [*FAST, "--train_data", str(path)], procs=2)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    log = r.stdout + r.stderr
    assert r.returncode != 0 and f"error: --train_data {path} has no usable sample" in log, log[-3000:]
    assert log.count("3 x its image file is not there") == 1 and "vLLM engine started" not in log, log[-3000:]


@pytest.mark.parametrize("kind", ["parquet", "save_to_disk"])
def test_check_source_reads_hf_sources_without_decoding_an_image(tmp_path, kind, monkeypatch):
    """A parquet file or a save_to_disk folder is read a thousand rows at a time as arrow: its images stay
    {"bytes", "path"}, their headers read and their pixels never decoded, and --columns maps them as in training."""
    import io

    import datasets
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), "green").save(buf, "PNG")
    ds = datasets.Dataset.from_dict({"picture": [{"bytes": buf.getvalue(), "path": None}] * 3,
                                     "question": ["Which colour?"] * 3, "answer": ["green"] * 3})
    ds = ds.cast_column("picture", datasets.Image())
    path = str(tmp_path / ("d.parquet" if kind == "parquet" else "d"))
    ds.to_parquet(path) if kind == "parquet" else ds.save_to_disk(path)
    from PIL import ImageFile
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda *a, **k: pytest.fail("an image was decoded"))
    v = data.check_source(path, args_for("--columns", "image=picture"))
    assert (v["rows"], v["usable"], v["images"], v["error"]) == (3, 3, 1, None)
    assert '"answer" as "solution" (3 rows)' in "\n".join(v["lines"])


def counted_skips(out):
    """(rows, to be skipped) from check_source's first line in `out`."""
    found = re.search(r"(\d+) rows read and checked in [\d.]+ s: (\d+) usable(?:, (\d+) to be skipped)?", out)
    return int(found[1]), int(found[3] or 0)


def test_check_data_counts_every_row_the_launch_skips(tmp_path, processor, capsys):
    """A 20-line file with ten kinds of bad rows: `--check_data` says as many rows to be skipped as the launch skips
    (the lines read_jsonl drops, and the rows data.prepare refuses), by the same per-row checks, and exits 1."""
    import startup
    Image.new("RGB", (112, 112), (255, 0, 0)).save(tmp_path / "big.png")
    lines = [row("ok.png")] * 9 + [
        row("gone.png"),                                    # a missing image
        row("corrupt.png"),                                 # an unreadable one
        row(["ok.png", "ok.png"]),                          # too many images for --limit_images 1
        row("ok.png", question=""),                         # an empty prompt
        {"image": "ok.png", "solution": "red"},             # no question
        b"{not json\n", b"[1, 2]\n",                        # a line that is no JSON object
        row("big.png"),                                     # 16 image tokens: over --max_prompt_length
        row("../ok.png"),                                   # out of the image root
        row("http://example.com/a.png"),                    # a URL
        row("ok.png", question="colour " * 60)]             # a question over --max_prompt_length
    path = write_task(tmp_path, lines)
    flags = ["--train_data", str(path), "--limit_images", "1", "--limit_videos", "0", "--max_pixels", "12544",
             "--max_prompt_length", "45"]
    assert startup.check_data_alone(args_for("--check_data", *flags)) == 1
    out = capsys.readouterr().out
    # the launch: the lines read_jsonl drops, then the rows data.prepare refuses
    args = args_for(*flags)
    args.min_pixels, args.max_pixels = data.pixel_bounds(args, processor)
    rows = data.Rows(str(path))
    dropped = capsys.readouterr().out.count(": skipped, ")
    refused = []
    for i in range(len(rows)):
        try:
            data.prepare(rows[i], processor, args)
        except ValueError as e:
            refused.append(str(e))
    assert counted_skips(out) == (20, dropped + len(refused)), out
    assert (dropped, len(refused)) == (2, 9), refused


def test_check_data_refuses_a_box_that_iou_cannot_score(tmp_path, processor, capsys):
    """--reward_funcs iou: a solution is four numbers x1 < x2, y1 < y2 inside the image, in its pixels. "red", an
    inverted box, a 0-1 box (named so, with the family's own convention) and a box past the image are refused by
    line and reason, by the check (exit 1) and by the launch alike; the same boxes that fit exit 0."""
    import startup
    good = [row("ok.png", solution=[10, 10, 40, 40]), row("ok.png", solution='{"bbox_2d": [10, 12, 40, 44]}')]
    bad = [row("ok.png"), row("ok.png", solution=[40, 10, 10, 40]), row("ok.png", solution=[0.1, 0.2, 0.5, 0.6]),
           row("ok.png", solution="[10, 10, 90, 40]")]
    path = write_task(tmp_path, good + bad)
    flags = ["--train_data", str(path), "--val_data", str(path), "--reward_funcs", "iou"]
    assert startup.check_data_alone(args_for("--check_data", *flags)) == 1
    out = capsys.readouterr().out
    assert counted_skips(out) == (6, 4), out
    for line, reason in ((3, "not a box: iou reads four numbers"), (4, "x1 < x2 and y1 < y2"),
                         (5, "a 0-1 normalised box; iou reads the solution in pixels of the original image"),
                         (6, "a box outside its image")):
        assert re.search(re.escape(reason) + f"[^\n]*{path}:{line} ", out), (reason, out)
    assert "this model answers in pixels of the image it sees, norm_bbox none" in out and "image 56 x 56" in out
    args = args_for(*flags)
    args.min_pixels, args.max_pixels = data.pixel_bounds(args, processor)
    refused = []
    for r in data.read_jsonl(str(path)):
        try:
            data.prepare(r, processor, args)
        except ValueError as e:
            refused.append(str(e).split(": ")[0])
    assert refused == [f"{path}:{k}" for k in (3, 4, 5, 6)]
    startup.check_data_alone(args_for("--check_data", *flags, "--tiny_arch", "qwen3_vl"))
    assert "this model answers from 0 to 1000 across the image, norm_bbox norm1000" in capsys.readouterr().out
    fine = write_task(tmp_path, good)
    assert startup.check_data_alone(args_for("--check_data", "--train_data", str(fine), "--val_data", str(fine),
                                             "--reward_funcs", "iou")) == 0


def test_a_users_train_data_without_val_data_validates_on_nothing_and_says_so(tmp_path, world1, capsys):
    """A user's --train_data with no --val_data: no validation (TRL's and verl's default), said in one line that
    names --val_data, never the embedded task's validation set; the embedded task's own data keeps its set."""
    import startup
    path = write_task(tmp_path, [row("ok.png")])
    args = args_for("--check_data", "--train_data", str(path))
    assert startup.check_data_alone(args) == 0
    out = capsys.readouterr().out
    assert args.val_data is None and "val.jsonl" not in out and len(re.findall(".*--val_data.*", out)) == 1, out
    assert "no --val_data: this run validates on nothing" in out
    args = args_for("--check_data")
    startup.check_data_alone(args)
    assert args.val_data.endswith("val.jsonl") and "--val_data" not in capsys.readouterr().out
    args = args_for("--model", "M", "--train_data", str(path))
    startup.check_data(args, 0)   # the launch's check says it too
    assert "no --val_data: this run validates on nothing" in capsys.readouterr().out


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_check_source_counts_a_prompts_tokens_as_prepare_does(tmp_path, arch):
    """The check reads an image's header alone, yet counts the prompt as data.prepare builds it: sizes off the grid,
    a large JPEG that decodes at a reduced size, an EXIF-rotated photo, two images, the tools' schemas."""
    import copy

    from transformers import AutoProcessor

    from conftest import tiny_of
    processor = AutoProcessor.from_pretrained(tiny_of(arch)[0])
    Image.new("RGB", (300, 100), "red").save(tmp_path / "wide.png")
    Image.new("RGB", (3000, 2000), "red").save(tmp_path / "big.jpg")
    exif = Image.Exif()
    exif[0x0112] = 6   # stored 200 x 100, seen upright 100 x 200
    Image.new("RGB", (200, 100), "red").save(tmp_path / "turned.jpg", exif=exif)
    rows = [row("ok.png"), row("wide.png"), row("big.jpg"), row("turned.jpg"), row(["wide.png", "turned.jpg"])]
    for flags in (["--max_pixels", "200704"], ["--max_pixels", "50176", "--tools", "crop"]):
        args = args_for("--tiny_arch", arch, "--limit_images", "2", "--max_prompt_length", "100000", *flags)
        tools = toolbox.schemas(args.tools)
        prepared = copy.copy(args)
        prepared.min_pixels, prepared.max_pixels = data.pixel_bounds(args, processor)
        for k, r in enumerate(rows):
            path = str(write_task(tmp_path, [r]))
            want = data.prepare(data.read_jsonl(path)[0], processor, prepared, tools)["hf"]["input_ids"].shape[1]
            for limit, usable in ((want, 1), (want - 1, 0)):
                args.max_prompt_length = limit
                v = data.check_source(path, args, "--train_data", processor, tools)
                assert v["usable"] == usable, (k, flags, v["lines"])
            assert f"({want} tokens)" in "\n".join(v["lines"])
