"""Data: samples -> the same downscaled images and video frames for vLLM and for training, and micro-batches.

Sources (`--train_data`, `--val_data`): JSONL, one sample per line ({"image": "a.png" or a list, "video": "a.mp4",
"question": "...", "solution": "..."}, or the VLM-R1 and R1-V layouts); a Hugging Face `datasets` folder
(save_to_disk) or a parquet file with an image column. `--columns question=query` maps other names onto ours. A
relative path lies under `--image_root` (default: the data file's folder). Every other field reaches the reward
functions. A bad sample is reported with its file and line, counted and skipped; prompts are never cut. A sample
without an image is a text-only prompt. docs/data.md has the formats, the checks and what is left out.
"""
import collections
import contextlib
import functools
import hashlib
import inspect
import io
import json
import math
import os
import string
import sys
import time
import zlib

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image, ImageOps
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

import reward
from model import image_grid

# The defaults of the pixel flags, in merged tokens on the model's grid (pixel_bounds, video_bounds; flags.py's help)
IMAGE_TOKENS = 1280   # --max_pixels by default: this many merged image tokens per image (pixel_bounds)
VIDEO_FRAME_TOKENS = (128, 768)   # --video_min_pixels, --video_max_pixels by default: merged tokens a frame
VIDEO_TOKENS = 2048   # --video_total_pixels by default: a video's merged tokens at most (video_bounds)


# ----------------------------------------------------------------------------- images
def downscale(img, min_pixels, max_pixels, factor):
    """-> img resized to grid_size: a size that the trainer's processor and vLLM's both keep as it is."""
    size = grid_size(img.height, img.width, min_pixels, max_pixels, factor)
    if size is None:
        raise ValueError(f"--min_pixels {min_pixels} --max_pixels {max_pixels} hold no image size on the model's "
                         f"{factor}-pixel grid")
    h, w = size
    return img if (w, h) == img.size else img.resize((w, h), Image.BICUBIC)


def grid_size(height, width, min_pixels, max_pixels, factor):
    """-> (h, w): multiples of `factor` with min_pixels <= h*w <= max_pixels and at most 200:1, nearest the image's
    aspect; smart_resize's choice where it keeps these bounds. None if no size does. Outside them (bounds close
    together, a thin image) each processor would resize again by its own bounds, and vLLM and training differ."""
    h, w = smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    if min_pixels <= h * w <= max_pixels and max(h, w) <= 200 * min(h, w):
        return h, w
    lo, hi = -(-min_pixels // factor ** 2), max_pixels // factor ** 2   # cells of factor x factor px
    area = min(max(height * width, min_pixels), max_pixels) / factor ** 2
    th, tw = math.sqrt(area * height / width), math.sqrt(area * width / height)   # the ideal, in cells
    best = None
    for a in range(1, hi + 1):   # a x b cells: for each height a, the widths b nearest tw that keep the bounds
        b_lo, b_hi = max(-(-lo // a), -(-a // 200), 1), min(hi // a, 200 * a)
        for b in {min(max(math.floor(tw), b_lo), b_hi), min(max(math.ceil(tw), b_lo), b_hi)} if b_lo <= b_hi else ():
            cost = abs(math.log(a / th)) + abs(math.log(b / tw))
            best = min(best or (cost, a, b), (cost, a, b))
    return None if best is None else (best[1] * factor, best[2] * factor)


def pixel_bounds(args, processor):
    """-> (min_pixels, max_pixels) of this run: the flags, or the defaults. Exits outside the processor's bounds,
    or where no image size on the model's grid lies between them."""
    size, grid = processor.image_processor.size, image_grid(processor)
    lo = size["shortest_edge"] if args.min_pixels is None else args.min_pixels
    hi = min(IMAGE_TOKENS * grid ** 2, size["longest_edge"]) if args.max_pixels is None else args.max_pixels
    if hi > size["longest_edge"] or lo < size["shortest_edge"] or lo > hi:
        sys.exit(f"error: --min_pixels/--max_pixels {lo}/{hi} lie outside the processor's {size['shortest_edge']}/"
                 f"{size['longest_edge']} (or min > max): it would resize again")
    if grid_size(grid, grid, lo, hi, grid) is None:
        below, above = lo // grid ** 2 * grid ** 2, -(-hi // grid ** 2) * grid ** 2
        sys.exit(f"error: --min_pixels {lo} --max_pixels {hi} hold no image size on the model's {grid}-pixel grid "
                 f"(h and w multiples of {grid}): each processor would resize such an image by its own bounds, and "
                 f"vLLM and training would see different pixels; use "
                 + (f"--min_pixels {below} or " if below else "") + f"--max_pixels {above}")
    return lo, hi


def load_image(source, min_pixels, max_pixels, factor, name=None):
    """open_image, then downscale once onto the `factor`-pixel grid."""
    im = open_image(source, name, max_pixels)
    out = downscale(im, min_pixels, max_pixels, factor)
    out.info["original_size"] = im.info["original_size"]   # (w, h): box rewards rescale ground truth to out.size
    return out


def open_image(source, name=None, max_pixels=None):
    """A path, encoded bytes or a PIL image -> an upright RGB image at its own size, with info["original_size"] its
    (w, h). Transparency goes on white and 16-bit is scaled to 8; a JPEG far above `max_pixels` decodes at a reduced
    size. Raises ValueError naming the file (or `name`) for anything unreadable."""
    name = name or str(source)
    try:
        opened = not isinstance(source, Image.Image)
        im = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) if opened else source
        with im if opened else contextlib.nullcontext(im):
            size = im.size[::-1] if im.getexif().get(0x0112, 1) in (5, 6, 7, 8) else im.size  # as seen upright
            if max_pixels:
                im.draft("RGB", (int(max_pixels ** 0.5) * 2,) * 2)  # JPEG: decode huge images at reduced size
            im = ImageOps.exif_transpose(im)
            if im.mode in ("F", "I"):   # 32-bit float or int (TIFF): scaled to 8 bits only where that is faithful
                lo, hi = im.getextrema()
                scale = {"F": 255.0 if hi <= 1.0 else 1.0 if hi <= 255.0 else None,
                         "I": 1 / 256 if hi > 255 else 1.0}[im.mode] if lo >= 0 and hi <= 65535 else None
                if scale is None or not math.isfinite(lo + hi):
                    raise ValueError(f"{im.mode} image with values {lo}..{hi}: no faithful 8-bit conversion "
                                     f"(a float image must hold 0..1 or 0..255, an int image 0..65535)")
                im = im.point(lambda v: v * scale).convert("L")
            if im.mode in ("I;16", "I;16B", "I;16L"):
                im = im.point(lambda v: v / 256).convert("L")    # 16-bit -> 8-bit, keep the range
            if im.mode in ("RGBA", "LA", "P", "PA"):
                im = im.convert("RGBA")
                bg = Image.new("RGBA", im.size, (255, 255, 255, 255))
                im = Image.alpha_composite(bg, im)
            if im.mode != "RGB":   # exif_transpose made a new image: convert would copy it again
                im = im.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"image {name}: {type(e).__name__}: {e}") from None
    im.info["original_size"] = size
    return im


def image_size(source, name=None, max_pixels=None):
    """open_image's sizes from the image's header alone -> ((w, h) upright, (w, h) upright as open_image decodes it:
    a JPEG far above `max_pixels` decodes smaller). Raises ValueError naming the file, as open_image does."""
    name = name or str(source)
    try:
        opened = not isinstance(source, Image.Image)
        im = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) if opened else source
        with im if opened else contextlib.nullcontext(im):
            # a PNG's getexif decodes the pixels to reach an EXIF after them: only one before them is read here
            exif = im.getexif() if im.format != "PNG" or "exif" in im.info else {}
            size = im.size
            if max_pixels:
                im.draft("RGB", (int(max_pixels ** 0.5) * 2,) * 2)   # open_image's: it sets the size, decodes nothing
            decoded = im.size
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ValueError(f"image {name}: {type(e).__name__}: {e}") from None
    turned = exif.get(0x0112, 1) in (5, 6, 7, 8)
    return (size[::-1], decoded[::-1]) if turned else (size, decoded)


# ----------------------------------------------------------------------------- videos
# A video is decoded with PyAV (FFmpeg in a wheel), its frames chosen and downscaled once, as qwen-vl-utils does.
# The same frames and timestamps go to vLLM and to training: the processor never samples or resizes again.
VIDEO_SEEK_SECONDS = 4.0   # a chosen frame further ahead than this is reached by a seek, not by decoding every frame


def video_bounds(args, grid):
    """-> (min, max) pixels of one frame and the pixel budget of a whole video: the flags, or the defaults on the
    model's grid."""
    lo = args.video_min_pixels or VIDEO_FRAME_TOKENS[0] * grid ** 2
    hi = args.video_max_pixels or VIDEO_FRAME_TOKENS[1] * grid ** 2
    return lo, max(lo, hi), args.video_total_pixels or VIDEO_TOKENS * grid ** 2


def frame_count(seconds, frames, args, temporal):
    """How many frames of a video of `seconds` and `frames` frames are shown: --video_fps a second, at most
    --video_max_frames and its own, a multiple of the temporal patch and at least one."""
    n = min(round(seconds * args.video_fps), args.video_max_frames, frames)
    return max(temporal, n // temporal * temporal)


def frame_size(width, height, n, bounds, factor, temporal):
    """(w, h) of each of a video's n frames on the `factor`-pixel grid: within [min, max] pixels a frame, and the video
    within its budget (qwen-vl-utils' total_pixels rule)."""
    lo, hi, total = bounds
    h, w = smart_resize(height, width, factor=factor, min_pixels=lo, max_pixels=max(min(hi, total * temporal // n), lo))
    return w, h


def video_kwargs(processor, args):
    """The video processor's arguments, the same for vLLM and for training: no frame sampling, and a size bound that
    leaves every video load_video makes as it is."""
    from transformers import Qwen3VLVideoProcessor
    vp = processor.video_processor
    lo, hi, total = video_bounds(args, image_grid(processor))
    if isinstance(vp, Qwen3VLVideoProcessor):
        hi = max(min(args.video_max_frames * hi, vp.temporal_patch_size * total), args.video_max_frames * lo)
    return {"size": {"shortest_edge": lo, "longest_edge": hi}, "do_sample_frames": False, "cap_pixels_per_frame": False}


VIDEO_EXTENSIONS = (".mp4", ".mkv", ".webm", ".avi", ".mov", ".m4v", ".mpg", ".mpeg", ".wmv", ".flv", ".ts")


def is_frame(item):
    """Whether an entry of a row's "video" list is a frame (an image file or image) rather than a video."""
    name = item.get("path") if isinstance(item, dict) else item   # HF's {"bytes", "path"}: by its path
    return isinstance(item, Image.Image) or (isinstance(name, str) and
                                             os.path.splitext(name)[1].lower() in Image.registered_extensions())


def video_sources(field, where):
    """A row's "video" field -> its videos, each a path, encoded bytes, HF's {"bytes", "path"}, or a list of frames. A
    list of image paths is one video given as its frames. Raises ValueError naming the sample for anything else."""
    if field is None or field == "" or (isinstance(field, (list, tuple)) and not field):
        return []
    items = list(field) if isinstance(field, (list, tuple)) else [field]
    if all(is_frame(v) for v in items) and isinstance(field, (list, tuple)):
        items = [items]   # one video given as its frames
    for v in items:
        if isinstance(v, (list, tuple)) and v and all(is_frame(f) for f in v):
            continue
        if isinstance(v, bool) or not isinstance(v, (str, bytes, dict)) or \
                (isinstance(v, dict) and not (v.get("bytes") or v.get("path"))):
            raise ValueError(f"{where}: video field holds {type(v).__name__} {v!r}; expected a video's path, a list of "
                             f"them, or a video's frames (a list of image paths)")
        if isinstance(v, str) and "://" in v:
            raise ValueError(f"{where}: video {v!r} is a URL; URLs are not fetched: download the videos, give their "
                             f"paths")
        if is_frame(v):
            raise ValueError(f"{where}: video {v!r} is an image; give it as the row's \"image\", or a video's frames "
                             f"as a list of images")
    return [list(v) if isinstance(v, (list, tuple)) else v for v in items]


def vllm_request(sample):
    """A sample's prompt for vLLM: its token ids, its images with their content ids, its videos as (frames, metadata).
    The ids spare vLLM hashing the same pixels at every turn."""
    media = {"image": sample["images"]} if sample["images"] else {}
    media = {**media, "video": sample["videos"]} if sample.get("videos") else media
    return {"prompt_token_ids": sample["vllm_ids"], **({"multi_modal_data": media} if media else {}),
            **({"multi_modal_uuids": {"image": sample["image_ids"]}} if sample["images"] else {})}


# Qwen's own tools block (its Qwen2.5 and Qwen3 templates), for a chat template that shows no tools (prompt)
HERMES = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
          "function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, "
          "return a json object with function name and arguments within <tool_call></tool_call> XML tags:"
          "\n<tool_call>\n"
          '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')
_said = set()


def prompt(processor, messages, tools=None):
    """The prompt text of `messages` by the checkpoint's chat template, showing `tools` (their JSON schemas) when
    given. A template that shows no tools gets Qwen's own tools block (HERMES) in the system message."""
    def render(msgs, **kw):
        return processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)
    if not tools:
        return render(messages)
    text = render(messages, tools=tools)
    if text != render(messages):
        return text
    if "template" not in _said:
        _said.add("template")
        print("[tools] this checkpoint's chat template shows no tools: they go at the head of the system message, "
              "in the format of Qwen's own templates (data.HERMES)")
    block = HERMES.format(tools="\n".join(json.dumps(t) for t in tools))
    system = [m for m in messages if m["role"] == "system"]
    head = {"role": "system", "content": (system[0]["content"] + "\n\n" if system else "") + block}
    return render([head] + [m for m in messages if m["role"] != "system"])


def content_id(image):
    """A digest of an image's mode, size and pixels: its id for vLLM's caches."""
    return hashlib.blake2b(f"{image.mode} {image.size}".encode() + image.tobytes(), digest_size=16).hexdigest()


def load_video(source, args, factor, temporal, name=None):
    """A video file (a path or its bytes) or a list of frames (taken as --video_fps a second) -> (frames (n, h, w, 3)
    uint8, metadata). The frames are chosen (frame_count) and downscaled once (frame_size). metadata holds fps,
    duration, total_num_frames and frames_indices, which vLLM and each family's processor read for time. Only the
    chosen frames are kept in memory. Raises ValueError naming the file for anything unusable."""
    import av
    bounds, name = video_bounds(args, factor), name or str(source)
    if isinstance(source, list):   # frames: only the chosen ones are opened
        n = frame_count(len(source) / args.video_fps, len(source), args, temporal)
        picks = np.linspace(0, len(source) - 1, n).round().astype(int).tolist()
        images = [open_image(source[i], f"{name} frame {i}") for i in picks]
        size = frame_size(*images[0].size, n, bounds, factor, temporal)
        frames = np.stack([np.asarray(im if im.size == size else im.resize(size, Image.BICUBIC)) for im in images])
        return frames, dict(fps=float(args.video_fps), duration=len(source) / args.video_fps,
                            total_num_frames=len(source), frames_indices=picks, width=size[0], height=size[1],
                            do_sample_frames=False)
    if isinstance(source, str) and os.path.isdir(source):
        raise ValueError(f"video {name}: a directory, not a video file (give a video's frames as a list of images)")
    def opened():
        return av.open(io.BytesIO(source) if isinstance(source, bytes) else source)
    try:
        with opened() as container:
            if not container.streams.video:
                raise ValueError("no video stream")
            stream = container.streams.video[0]
            if stream.codec_context is None:   # a codec tag FFmpeg does not know, or one it cannot decode
                raise ValueError("no decoder for its codec in PyAV's FFmpeg (re-encode it, e.g. to H.264)")
            fps = float(stream.average_rate or stream.guessed_rate or 0)
            start = float(stream.start_time * stream.time_base) if stream.start_time else 0.0
            seconds = float(stream.duration * stream.time_base) if stream.duration else \
                container.duration / av.time_base if container.duration else 0.0
            total = stream.frames or round(seconds * fps)
            if not total or not fps:   # no count in the header: count the packets (demuxed, not decoded)
                with opened() as counting:
                    total = sum(1 for p in counting.demux(counting.streams.video[0]) if p.size)
                fps = fps or (total / seconds if seconds else args.video_fps)
                seconds = seconds or total / fps
            if not total:
                raise ValueError("no frames")
            n = frame_count(seconds, total, args, temporal)
            picks = np.linspace(0, total - 1, n).round().astype(int).tolist()
            frames, indices = decode_frames(container, stream, [start + i / fps for i in picks], start, fps,
                                            lambda w, h: frame_size(w, h, n, bounds, factor, temporal))
    except (av.FFmpegError, OSError, ValueError, MemoryError) as e:
        raise ValueError(f"video {name}: {type(e).__name__}: {e}") from None
    return frames, dict(fps=fps, duration=seconds, total_num_frames=total, frames_indices=indices,
                        width=frames.shape[2], height=frames.shape[1], do_sample_frames=False)


def decode_frames(container, stream, times, start, fps, size_of):
    """The frames at `times` (seconds, ascending) of an open PyAV stream, each resized to size_of(w, h) as it is
    decoded -> (frames (n, h, w, 3) uint8, each one's index in the original). A far frame is reached by a seek."""
    import av
    frames, indices, current, decoder, size, seekable = [], [], None, None, None, True
    for t in times:
        if current is None or current.time < t - 0.5 / fps:
            if seekable and t - (start if current is None else current.time) > VIDEO_SEEK_SECONDS:
                try:
                    container.seek(int(t / stream.time_base), stream=stream, backward=True)
                    decoder = container.decode(stream)
                except av.FFmpegError:   # a file without an index to seek by (no cues): decoded on from here
                    seekable = False
            decoder = decoder or container.decode(stream)
            for current in decoder:
                if current.time is not None and current.time >= t - 0.5 / fps:
                    break
            else:   # the stream ended before t
                if current is None or current.time is None:
                    raise ValueError("no decodable frame")
                if t - current.time > 1 + 2 / fps:
                    raise ValueError(f"its last frame is at {current.time:.1f} s, before {t:.1f} s where its header "
                                     f"says it goes on (truncated?)")
        size = size or size_of(current.width, current.height)
        image = current.to_image()   # RGB at the frame's own size; downscaled now, only the chosen frames are kept
        frames.append(np.asarray(image if image.size == size else image.resize(size, Image.BICUBIC)))
        indices.append(round((current.time - start) * fps))
    return np.stack(frames), indices


def read_jsonl(path, dropped=None):
    """Rows of a JSONL file; a bad line is skipped and said with its line number, or put in the list `dropped` as
    (file:line, reason)."""
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
                rows.append(dict(row, _where=f"{path}:{i}", _id=sample_id(row)))
            except (UnicodeDecodeError, ValueError) as e:   # json.JSONDecodeError is a ValueError
                if dropped is None:
                    print(f"[data] {path}:{i}: skipped, {type(e).__name__}: {e}")
                else:
                    dropped.append((f"{path}:{i}", f"{type(e).__name__}: {e}"))
    if not rows:
        sys.exit(f"error: {path} has no usable samples")
    return rows


def sample_id(row, own=True):
    """A sample's identity: its own "id" field (when `own`), else a hash of its content as the source stores it. Never
    its row number, which a shuffled or edited file gives to another sample."""
    if own and isinstance(row.get("id"), (int, str)) and not isinstance(row.get("id"), bool):
        return row["id"]
    content = json.dumps({k: v for k, v in row.items() if not k.startswith("_")}, sort_keys=True, default=_hashed)
    return "sha1:" + hashlib.sha1(content.encode()).hexdigest()[:16]   # 64 bits: a collision needs billions of rows


def _hashed(value):
    """What json cannot write (images, arrays), as the hash of its bytes."""
    if isinstance(value, Image.Image):
        value = f"{value.mode}{value.size}".encode() + value.tobytes()
    elif isinstance(value, np.ndarray):
        value = str(value.dtype).encode() + value.tobytes()
    return hashlib.sha1(value if isinstance(value, bytes) else repr(value).encode()).hexdigest()


def file_crc32(path, chunk=4 << 20):   # 4 MiB blocks: the fastest read measured (docs/data.md)
    """A file's CRC32, 8 hex digits, read `chunk` bytes at a time."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def source_fingerprint(path):
    """-> {"size", "crc32"} that tell a data source's contents apart, for the checkpoint. A `datasets` folder: its
    files' sizes and the fingerprints in its state.json."""
    if not os.path.isdir(path):
        return {"size": os.path.getsize(path), "crc32": file_crc32(path)}
    parts, size = [], 0
    for d, _, files in sorted(os.walk(path)):
        for f in sorted(files):
            size += os.path.getsize(os.path.join(d, f))
            parts.append(f"{os.path.relpath(os.path.join(d, f), path)} {os.path.getsize(os.path.join(d, f))}")
            if f == "state.json":
                with open(os.path.join(d, f)) as fh:
                    parts.append(str(json.load(fh).get("_fingerprint")))
    return {"size": size, "crc32": f"{zlib.crc32(chr(10).join(parts).encode()):08x}"}


# The peers' names for our fields (EasyR1, TRL, R1-V, LLaVA), read as ours where the row has none (normalise).
# "answer" is copied, since a reward may read it by that name; the others are renamed.
PEER_NAMES = {"problem": "question", "prompt": "question", "answer": "solution", "img": "image", "image_path": "image"}


def normalise(row, mapping=None):
    """A source's row with our field names: --columns' mapping first (ours=theirs), then the VLM-R1 / LLaVA
    conversation layout, then PEER_NAMES. -> (the row, [(their name, ours), ...] as read)."""
    read = []
    for ours, theirs in (mapping or {}).items():
        if theirs in row:
            row[ours] = row.pop(theirs)
    if "conversations" in row and "question" not in row:   # VLM-R1 / LLaVA layout
        turns = row.pop("conversations")
        asked = next(t["value"] for t in turns if t.get("from") in ("human", "user"))
        row["question"] = asked.replace("<image>", "").strip()
        row.setdefault("solution", next((t["value"] for t in turns if t.get("from") in ("gpt", "assistant")), None))
    for theirs, ours in PEER_NAMES.items():
        have = row.get(ours) is not None or (ours == "image" and row.get("images") is not None)
        if theirs in row and not have and (theirs != "prompt" or isinstance(row[theirs], str)):
            row[ours] = row[theirs] if theirs == "answer" else row.pop(theirs)
            if ours == "question" and isinstance(row[ours], str):   # EasyR1's placeholder: the image goes first
                row[ours] = row[ours].replace("<image>", "").strip()
            read.append((theirs, ours))
    return row, read


class Rows:
    """Random access to the rows of a JSONL, parquet or HF datasets source, with our field names. HF rows are read (and
    their images decoded) only when asked for. `fingerprint`: the source's, with its number of rows. `dropped`: as
    read_jsonl takes it."""
    def __init__(self, path, columns=(), image_root=None, dropped=None):
        self.path, self.mapping = path, dict(c.split("=", 1) for c in columns)
        self.image_root = image_root or (path if os.path.isdir(path) else os.path.dirname(path))
        if os.path.isdir(path) or path.endswith(".parquet"):
            import datasets
            ds = datasets.load_from_disk(path) if os.path.isdir(path) else \
                datasets.load_dataset("parquet", data_files=path, split="train")
            self.rows = ds["train"] if isinstance(ds, datasets.DatasetDict) else ds
            if len(self.rows) == 0:
                sys.exit(f"error: {path} has no usable samples")
            ids = list(self.rows["id"]) if "id" in self.rows.column_names else []   # a column: no image decoded
        else:
            self.rows = read_jsonl(path, dropped)
            ids = [r["id"] for r in self.rows if "id" in r]
        # a sample's "id" field is its identity only when every row has its own; else its content is (sample_id)
        self.own_ids = len(ids) == len(self.rows) and len(set(map(repr, ids))) == len(ids)
        if ids and not self.own_ids:
            print(f"[data] {path}: the \"id\" field is missing in some rows or repeats: samples are known by a hash "
                  f"of their content instead (the per-prompt history, docs/data.md)")

    @functools.cached_property
    def fingerprint(self):   # read once, when a PromptStream asks (validation's Rows never do)
        return dict(source_fingerprint(self.path), rows=len(self.rows))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.normalised(dict(self.rows[int(i)]), i)[0]

    def normalised(self, row, i):
        """Row i normalised, with its place and id -> (the row, the names read)."""
        row.setdefault("_where", f"{self.path}[{i}]")
        row["_id"] = sample_id(row, self.own_ids)   # the same on every rank, epoch and launch, wherever the row moves
        row["_image_root"] = self.image_root
        return normalise(row, self.mapping)

    def every_row(self):
        """Each row as normalised() gives it, images not decoded; an HF dataset is read as arrow in chunks."""
        if isinstance(self.rows, list):
            yield from (self.normalised(dict(r), i) for i, r in enumerate(self.rows))
            return
        table = self.rows.with_format("arrow")
        for start in range(0, len(table), 1000):
            for j, r in enumerate(table[start:start + 1000].to_pylist()):
                yield self.normalised(r, start + j)


def image_path(base, name, kind="image"):
    """The path of `name` (an image, a video or a frame: `kind`) under the image root `base`. A relative path that
    climbs out of the root raises ValueError: a data file from elsewhere could read any file the run can."""
    if not os.path.isabs(name) and os.path.normpath(name).split(os.sep)[0] == os.pardir:
        raise ValueError(f"{kind} {name!r} climbs out of the image root {base} (--image_root, default: the data "
                         f"file's folder); give a path inside it, or an absolute path")
    path = os.path.join(base, name)
    if not os.path.isabs(name):
        said_link(base, name)
    return path


_links_said = set()   # (the folder of a link that leads out of an image root, the folder it leads to)


def said_link(base, name):
    """Say once per (link's folder, target's folder) that `name` under `base` leads out through a link."""
    root = os.path.realpath(base)
    if os.path.commonpath([root, os.path.realpath(os.path.join(base, name))]) == root:
        return
    parts = os.path.normpath(name).split(os.sep)
    link = next((p for p in (os.path.join(base, *parts[:k]) for k in range(1, len(parts) + 1)) if os.path.islink(p)),
                None)
    if link is None:   # the root itself moved between the two reads
        return
    target = os.path.realpath(link)
    key = (os.path.dirname(link), os.path.dirname(target))
    if key not in _links_said:
        _links_said.add(key)
        print(f"[data] {link} is a link to {target}, outside the image root {base}: followed (links in a data folder "
              f"are trusted, docs/data.md); said once for the links in {key[0]} into {key[1]}", flush=True)


class Unusable(ValueError):
    """A row that cannot be trained on: "<where>: <reason> (<detail>)". check_source counts rows by `reason`, which
    holds nothing of one row's own, and shows the first rows with their `detail`."""
    def __init__(self, where, reason, detail=None):
        super().__init__(f"{where}: {reason}" + (f" ({detail})" if detail else ""))
        self.reason, self.detail = reason, detail


def check_row(row, args, limits=("limit_images", "limit_videos")):
    """The checks of a row that open no file: its image and video fields and their `limits`, a finite solution, every
    field a chosen reward needs, a row's tools, the fields --question_template takes (there, and not empty). -> (its
    images, its videos) as given; raises ValueError naming the row."""
    where = row["_where"]
    images = row.get("image", row.get("images"))
    images = [] if images is None or images == "" else list(images) if isinstance(images, (list, tuple)) else [images]
    for im in images:   # a path, encoded bytes, a decoded image, or HF's {"bytes", "path"}
        if isinstance(im, bool) or not isinstance(im, (str, bytes, dict, Image.Image)):
            raise ValueError(f"{where}: image field holds {type(im).__name__} {im!r}; expected a path, a list of "
                             f"paths, or an HF datasets image")
        if isinstance(im, dict) and not im.get("bytes") and not im.get("path"):
            raise ValueError(f"{where}: image field holds {im!r}: an HF datasets image with neither bytes nor a path")
        if isinstance(im, str) and "://" in im:
            raise ValueError(f"{where}: image {im!r} is a URL; URLs are not fetched: download the images, give "
                             f"their paths")
        if isinstance(im, str) and os.path.splitext(im)[1].lower() in VIDEO_EXTENSIONS:
            raise ValueError(f"{where}: image {im!r} is a video file; give it as the row's \"video\" "
                             f"(with --limit_videos)")
    videos = video_sources(row.get("video", row.get("videos")), where)
    solution = row.get("solution")
    if isinstance(solution, float) and not math.isfinite(solution):
        raise ValueError(f"{where}: solution is {solution}, not a finite number (accuracy would score 'nan' right)")
    for field, names in reward_needs(getattr(args, "reward_funcs", ())).items():
        if row.get(field) is None:
            raise ValueError(f"{where}: no field {field!r}, which --reward_funcs {' '.join(names)} "
                             f"{'needs' if len(names) == 1 else 'need'}; the row has "
                             f"{sorted(k for k in row if not k.startswith('_'))}")
    if "limit_images" in limits and len(images) > args.limit_images:
        raise ValueError(f"{where}: {len(images)} images > --limit_images {args.limit_images}")
    if "limit_videos" in limits and len(videos) > args.limit_videos:
        raise ValueError(f"{where}: {len(videos)} video(s) > --limit_videos {args.limit_videos}"
                         + (" (videos are off by default: pass --limit_videos 1)" if not args.limit_videos else ""))
    tools = getattr(args, "tools", None) or []
    names = row.get("tools", list(tools))   # a row may show fewer tools than --tools, or none
    if not isinstance(names, list) or set(names) - set(tools):
        raise ValueError(f"{where}: tools {names!r}: a row's own tools are a list of --tools "
                         f"({' '.join(tools) or 'none given'})")
    try:
        args.question_template.format(**row)
    except (KeyError, IndexError) as e:
        raise ValueError(f"{where}: no field {e} that --question_template {args.question_template!r} needs; "
                         f"the sample has {sorted(k for k in row if not k.startswith('_'))}") from None
    for _, field, _, _ in string.Formatter().parse(args.question_template):
        value = row.get(field, "-")
        if value is None or isinstance(value, str) and not value.replace("<image>", "").replace("<video>", "").strip():
            raise ValueError(f"{where}: its {field!r} is empty ({value!r}), which --question_template shows: the "
                             f"prompt would ask nothing of it")
    return images, videos


BOX_REWARDS = ("iou",)   # the rewards that read `solution` as a box [x1, y1, x2, y2] in pixels of the original image
# How a family writes a box (model.FAMILIES norm_bbox), said where a solution is in another convention
ANSWER_UNITS = {"none": "in pixels of the image it sees", "norm1000": "from 0 to 1000 across the image"}


def check_box(row, args, size=None, norm_bbox="none"):
    """With a box reward among --reward_funcs: the row's solution is a box as reward.box_of reads it (four numbers,
    x1 < x2 and y1 < y2) in pixels of the original image of `size` (w, h; None: not checked against it), within a
    pixel of it, not a 0-1 box. Raises Unusable naming the row."""
    names = [n for n in getattr(args, "reward_funcs", ()) if n in BOX_REWARDS]
    if not names or row.get("solution") is None:   # a missing solution: check_row's
        return
    where, value, rule = row["_where"], row["solution"], " ".join(names)
    shown = f"solution {value!r}"[:80]
    nums = reward.box_numbers(value)
    if len(nums) != 4 or not all(map(math.isfinite, nums)):
        raise Unusable(where, f"solution is not a box: {rule} reads four numbers x1, y1, x2, y2 from it", shown)
    x1, y1, x2, y2 = nums
    if not (x1 < x2 and y1 < y2):
        raise Unusable(where, f"solution is no box with x1 < x2 and y1 < y2 (inverted or empty): {rule} scores it as "
                              f"a failure", shown)
    if size is None:
        return
    w, h = size
    units = f" (this model answers {ANSWER_UNITS.get(norm_bbox, norm_bbox)}, norm_bbox {norm_bbox}, and {rule} " \
        f"rescales its answer)" if norm_bbox else ""
    if all(0 <= v <= 1 for v in nums):
        raise Unusable(where, f"solution is a 0-1 normalised box; {rule} reads the solution in pixels of the original "
                              f"image whatever the model{units}: multiply each x by the image's width and each y by "
                              f"its height", f"{shown}, image {w} x {h}")
    if min(x1, y1) < -1 or x2 > w + 1 or y2 > h + 1:
        scale = "; a box on norm1000's 0-1000 scale is no solution here: convert it to pixels" \
            if norm_bbox == "norm1000" and max(nums) <= 1000 else ""
        raise Unusable(where, f"solution is a box outside its image (by more than a pixel): {rule} reads the "
                              f"solution in pixels of the original image{scale}", f"{shown}, image {w} x {h}")


# The columns the run gives every reward beside the row's own fields (prepare: image_size, seen_size, norm_bbox;
# train.reward_inputs: the rest): a reward's parameter among them is no field the data must have.
RUN_COLUMNS = ("image_size", "seen_size", "norm_bbox", "completion_length", "max_completion_length", "trajectory",
               "tool_calls", "tool_failures", "scorer")


def reward_needs(names):
    """{field: [reward names]}: the row fields the named rewards take without a default, RUN_COLUMNS aside."""
    needs = {}
    for name in names:
        for p in list(inspect.signature(reward.REWARDS[name]).parameters.values())[1:]:
            if (p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                    and p.name not in RUN_COLUMNS):
                needs.setdefault(p.name, []).append(name)
    return needs


def image_root_of(row):
    """The folder a row's relative image and video paths start from."""
    return row.get("_image_root") or os.path.dirname(row["_where"].rsplit(":", 1)[0])


def source_of(item, base, kind="image"):
    """A row's image or video entry (a path, or what HF datasets store: a decoded image or {"bytes", "path"}) -> what
    open_image and load_video take: its path under `base` (image_path), its bytes, or the image."""
    if isinstance(item, dict):
        return item["bytes"] if item.get("bytes") else image_path(base, item["path"], kind)
    return image_path(base, item, kind) if isinstance(item, str) else item


def prompt_text(row, processor, args, tools, images, videos):
    """A checked row's prompt by the chat template: `images` images and `videos` videos, then its question, with the
    tools it shows ({name: JSON schema}). -> (the text, the tools' names); raises ValueError when the template shows
    another number of videos."""
    content = [{"type": "image"} for _ in range(images)] + [{"type": "video"} for _ in range(videos)] + \
        [{"type": "text", "text": args.question_template.format(**row)}]
    messages = ([{"role": "system", "content": args.system_prompt}] if args.system_prompt else []) + \
        [{"role": "user", "content": content}]
    names = row.get("tools", list(tools))   # a row may show fewer tools than --tools, or none
    text = prompt(processor, messages, [tools[n] for n in names])
    pad = getattr(processor, "video_token", "<|video_pad|>")
    if text.count(pad) != videos:
        raise ValueError(f"{row['_where']}: the chat template wrote {text.count(pad)} {pad} for {videos} video(s); a "
                         f"template without videos cannot show one")
    return text, names


def check_length(where, tokens, args, videos=()):
    """Raises Unusable when a prompt of `tokens` (its image and video tokens included) is over --max_prompt_length."""
    if tokens > args.max_prompt_length:
        raise Unusable(where, f"prompt over --max_prompt_length {args.max_prompt_length} (its image and video tokens "
                              f"included); raise it or lower --max_pixels"
                              + (" / --video_total_pixels, --video_max_frames" if videos else ""), f"{tokens} tokens")


def prepare(row, processor, args, tools=None, norm_bbox="none"):
    """One row -> a prepared sample: the same downscaled images and video frames for vLLM and for training, the
    prompt's token ids for both, the reward columns. `tools`: {name: JSON schema} of --tools; `norm_bbox`: the model
    family's box convention. Raises ValueError naming the sample for anything that cannot be trained on."""
    tools = tools or {}
    if set(getattr(args, "tools", None) or []) - set(tools):
        raise TypeError(f"data.prepare: --tools {' '.join(args.tools)} need their schemas: "
                        f"tools=toolbox.schemas(args.tools)")
    where = row["_where"]
    images, videos = check_row(row, args)
    base = image_root_of(row)
    try:   # each path resolved once (image_path also says a link out of the root)
        pil, clips = [], []
        for k, im in enumerate(images):
            src = source_of(im, base)
            pil.append(load_image(src, args.min_pixels, args.max_pixels, image_grid(processor),
                                  name=src if isinstance(im, str) else f"#{k}"))
        for k, v in enumerate(videos):
            src = [source_of(f, base, "video frame") for f in v] if isinstance(v, list) else source_of(v, base, "video")
            clips.append(load_video(src, args, image_grid(processor), processor.video_processor.temporal_patch_size,
                                    name=src if isinstance(v, str) else f"#{k}"))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    check_box(row, args, pil[0].info["original_size"] if pil else None, norm_bbox)
    if clips and isinstance(row.get("question"), str):   # the conversation layouts' <video> placeholder, as <image>
        row = dict(row, question=row["question"].replace("<video>", "").strip())
    text, names = prompt_text(row, processor, args, tools, len(pil), len(clips))
    # the frames as they are (video_kwargs), with the times they were taken at (each family's processor reads them)
    shown = dict(videos=[f for f, _ in clips], video_metadata=[{k: v for k, v in m.items() if k != "do_sample_frames"}
                                                                for _, m in clips],
                 videos_kwargs=video_kwargs(processor, args)) if clips else {}
    hf = processor(text=[text], images=pil or None, **shown, return_tensors="pt")
    check_length(where, hf["input_ids"].shape[1], args, clips)
    # vLLM takes ONE <|image_pad|> per image (and <|video_pad|> per video) and expands it itself.
    vllm_ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    columns = {k: v for k, v in row.items()
               if k not in ("image", "images", "video", "videos", "_where", "_image_root", "_id", "tools")}
    if pil:   # for box rewards: the ground truth is in original pixels, the model saw pil[0].size
        columns.setdefault("image_size", list(pil[0].info["original_size"]))
        columns.setdefault("seen_size", list(pil[0].size))
    columns["norm_bbox"] = norm_bbox   # how the model writes a box (the family's, not the data's)
    # an image field present but empty (a parquet cell of None, "image": ""): trained text-only, and counted
    empty = not pil and any(k in row for k in ("image", "images"))
    # videos: each (frames, metadata) as vLLM takes it (vllm_request); sources and pixel_bounds: what a tool
    # (toolbox.crop) needs to go back to the original images and downscale what it returns by the same path
    return dict(images=pil, image_ids=[content_id(im) for im in pil], videos=clips, vllm_ids=vllm_ids, hf=hf,
                columns=columns, where=where, id=row.get("_id"), empty_image=empty,
                sources=[source_of(im, base) for im in images],
                pixel_bounds=(args.min_pixels, args.max_pixels, image_grid(processor)), tools=names,
                norm_bbox=norm_bbox)


# ----------------------------------------------------------------------------- the data checked before the launch
KNOWN_FIELDS = {"image", "images", "video", "videos", "question", "solution", "id", "tools", "source"}


def missing_file(row, images, videos):
    """Raises Unusable for a row's first image or video file that is not there. -> the sources of its images."""
    base = image_root_of(row)
    sources = [source_of(im, base) for im in images]
    paths = [("image", src) for src in sources if isinstance(src, str)]
    for v in videos:
        frames = [source_of(f, base, "video frame") for f in v] if isinstance(v, list) else \
            [source_of(v, base, "video")]
        paths += [("video", f) for f in frames if isinstance(f, str)]
    for kind, path in paths:
        if not os.path.isfile(path):
            raise Unusable(row["_where"], f"its {kind} file is not there (or is not a file)", path)
    return sources


def check_source(path, args, flag="--train_data", processor=None, tools=None, norm_bbox="none"):
    """Rank 0: every line of a source by prepare's checks, nothing decoded (an image's header read), and with the
    `processor` an image row's prompt length; `tools` {name: JSON schema}, `norm_bbox` as prepare takes them. -> the
    verdict every rank acts on: "lines" to print, "error" or None, the most "images" and "videos" a usable row holds,
    "rows", "usable"."""
    t0, dropped, tools = time.perf_counter(), [], tools or {}
    try:
        rows = Rows(path, args.columns, args.image_root, dropped)
    except SystemExit as e:   # no readable line at all
        return dict(lines=[], error=str(e.code), images=0, videos=0, rows=0, usable=0)
    template = {name for _, name, _, _ in string.Formatter().parse(args.question_template) if name}
    reads = {p for n in args.reward_funcs for p in inspect.signature(reward.REWARDS[n]).parameters}
    known, given = KNOWN_FIELDS | template | reads, set(getattr(args, "explicit", ()))
    limits = [k for k in ("limit_images", "limit_videos") if k in given]   # else the data sets them (data_limits)
    lo, hi = pixel_bounds(args, processor) if processor is not None else (None, None)
    grid, headers = processor and image_grid(processor), {}   # headers: an image's sizes by path, read once

    def sizes_of(src, where):
        try:
            if not isinstance(src, str):
                return image_size(src, "of the row's bytes", hi)
            if src not in headers:
                headers[src] = image_size(src, max_pixels=hi)
            return headers[src]
        except ValueError as e:
            raise Unusable(where, "its image cannot be read", str(e)) from None
    skipped, peers, unknown, most, usable = {}, collections.Counter(), collections.Counter(), [0, 0], 0
    for where, reason in dropped:
        skipped.setdefault("a line that is no JSON object", []).append(f"{where} ({reason})"[:200])
    n = len(dropped)
    for row, read in rows.every_row():
        n += 1
        peers.update(read)
        unknown.update(k for k in row if not k.startswith("_") and k not in known and k not in dict(read))
        where = row["_where"]
        try:
            images, videos = check_row(row, args, limits)
            sizes = [sizes_of(src, where) for src in missing_file(row, images, videos)]
            check_box(row, args, sizes[0][0] if sizes else None, norm_bbox)
            if processor is not None:
                text, _ = prompt_text(row, processor, args, tools, len(images), len(videos))
                seen = [smart_resize(h, w, factor=grid, min_pixels=lo, max_pixels=hi) for (_, (w, h)) in sizes]
                extra = sum(h * w // grid ** 2 - 1 for h, w in seen)   # an image: one pad in the text, more tokens
                # a byte-level BPE token holds a byte at least: a prompt of few bytes needs no tokenizing
                if not videos and len(text.encode()) + extra > args.max_prompt_length:
                    check_length(where, len(processor.tokenizer(text, add_special_tokens=False)["input_ids"]) + extra,
                                 args)
        except ValueError as e:
            reason = getattr(e, "reason", None) or str(e).removeprefix(f"{where}: ")
            skipped.setdefault(reason, []).append(f"{where} ({e.detail})" if getattr(e, "detail", None) else where)
            continue
        usable += 1
        most = [max(most[0], len(images)), max(most[1], len(videos))]
    lines = [f"[data] {path}: {n} rows read and checked in {time.perf_counter() - t0:.1f} s: {usable} usable"
             + (f", {n - usable} to be skipped:" if usable < n else "")]
    for reason, wheres in sorted(skipped.items(), key=lambda kv: -len(kv[1])):   # a reason once, with its count
        lines.append(f"  {len(wheres)} x {reason} (first: {', '.join(wheres[:3])})")
    if peers:
        lines.append(f"[data] {path}: the peers' field names read as ours: " + ", ".join(
            f'"{theirs}" as "{ours}" ({c} rows)' for (theirs, ours), c in peers.most_common()))
    if unknown:
        lines.append(f"[data] {path}: fields no part of this run reads (they reach the rewards as columns): "
                     + ", ".join(f'"{k}" ({c} rows)' for k, c in unknown.most_common()))
    error = None if usable else (f"error: {flag} {path} has no usable sample: all {n} of its samples were skipped, for "
                                 f"the reasons above")
    return dict(lines=lines, error=error, images=most[0], videos=most[1], rows=n, usable=usable)


def data_limits(args, images, videos, tool_images=0):
    """Set --limit_images and --limit_videos where the launch did not: the most a usable row holds, plus `tool_images`.
    -> the line saying what was set, or None."""
    given, said = set(getattr(args, "explicit", ())), []
    if "limit_images" not in given:
        args.limit_images = max(images, 1) + tool_images
        said.append(f"--limit_images {args.limit_images} (the most images in a row: {images}"
                    + (f", and one a turn after a tool call: --max_turns {args.max_turns} - 1" if tool_images else "")
                    + ")")
    if "limit_videos" not in given:
        args.limit_videos = videos
        said.append(f"--limit_videos {videos} (the most videos in a row)")
    return "[data] from the data: " + ", ".join(said) if said else None


class PromptStream:
    """This rank's endless, reproducible stream of prepared samples: epoch e is a seeded permutation of the rows, of
    which rank r reads every world-th. Bad samples are reported, counted and skipped. `history`: a sample's id -> its
    group's rewards the last time it was rolled out, which a curriculum reads. `consumed`: {epoch: rows} that a launch
    with another number of ranks took (regroup). `source`: the source's fingerprint."""
    def __init__(self, rows, processor, args, rank, world, tools=None, norm_bbox="none"):
        self.rows, self.processor, self.args, self.rank, self.world = rows, processor, args, rank, world
        self.tools, self.norm_bbox = tools, norm_bbox   # {name: JSON schema} of --tools, the box convention (prepare)
        self.epoch, self.cursor, self.skipped, self.history, self.empty_images = 0, 0, 0, {}, 0
        self.consumed, self.source = {}, getattr(rows, "fingerprint", None)
        self.said = {}   # a skip's reason -> how often it came (said once)

    def state(self):
        """The position and history a checkpoint saves."""
        return {"epoch": self.epoch, "cursor": self.cursor, "skipped": self.skipped, "history": self.history,
                "empty_images": self.empty_images, "consumed": {e: sorted(r) for e, r in self.consumed.items()},
                "history_by": "sample_id"}

    def load(self, st):
        """Go on from a saved state()."""
        self.epoch, self.cursor, self.skipped = st["epoch"], st["cursor"], st["skipped"]
        self.history, self.empty_images = self.history_of(st), st.get("empty_images", 0)
        self.consumed = {e: set(r) for e, r in st.get("consumed", {}).items()}

    def history_of(self, st):
        """A saved state's history, keyed by sample id."""
        if st.get("history_by") == "sample_id":
            return dict(st.get("history", {}))
        # an older checkpoint keyed it by row number
        return {self.rows[k]["_id"]: v for k, v in st.get("history", {}).items()
                if isinstance(k, int) and 0 <= k < len(self.rows)}

    def regroup(self, states):
        """Go on from every rank's `states` of a launch with another number of ranks: this epoch skips the rows they
        took (consumed_rows)."""
        self.consumed = consumed_rows(states, len(self.rows), self.args.seed)
        self.epoch, self.cursor = min(self.consumed), 0
        self.history = {k: v for st in states for k, v in self.history_of(st).items()}
        first = self.rank == 0
        self.skipped = sum(st["skipped"] for st in states) if first else 0
        self.empty_images = sum(st.get("empty_images", 0) for st in states) if first else 0

    def restart(self):
        """A fresh epoch on the rows as they are now, for data changed under the checkpoint."""
        self.epoch, self.cursor, self.consumed = max([self.epoch, *self.consumed]) + 1, 0, {}

    def next(self, n):
        """The next `n` prepared samples of this rank; bad rows are skipped and counted."""
        out = []
        while len(out) < n:
            shuffled = np.random.default_rng(self.args.seed + self.epoch).permutation(len(self.rows))
            order = shuffled[self.rank::self.world]
            if self.cursor >= len(order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self.consumed = {e: r for e, r in self.consumed.items() if e >= self.epoch}
                continue
            i = order[self.cursor]
            self.cursor += 1
            if i in self.consumed.get(self.epoch, ()):   # taken in this epoch by a launch with another number of ranks
                continue
            row = self.rows[i]
            try:
                out.append(prepare(row, self.processor, self.args, self.tools, self.norm_bbox))
                if out[-1]["empty_image"]:
                    self.empty_images += 1
                    if self.empty_images == 1:
                        print(f"[data] rank {self.rank}: {out[-1]['where']}: the image field is empty (None or \"\"): "
                              f"trained as a text-only prompt; such samples are counted in data/empty_images")
            except ValueError as e:
                if self.args.overlong_prompt == "error" and "--max_prompt_length" in str(e):
                    sys.exit(f"error: {e} (--overlong_prompt error)")
                self.skipped += 1
                self.said[str(e)] = self.said.get(str(e), 0) + 1
                if self.said[str(e)] == 1:   # a row met again (each epoch) is counted, not said again
                    print(f"[data] rank {self.rank}: skipped {e} (said once; data/skipped counts them)")
                if self.skipped > 100 and self.skipped > 10 * len(out):
                    sys.exit(f"error: {self.skipped} samples skipped, for these reasons:\n" + "\n".join(
                        f"  {c} x {reason}" for reason, c in sorted(self.said.items(), key=lambda kv: -kv[1])[:10]))
        return out


def consumed_rows(states, n, seed):
    """{epoch: set of rows} that the ranks of `states` (rank order, `n` rows) took, from the earliest epoch a rank is
    in, earlier regroups' marks included."""
    world, first = len(states), min(st["epoch"] for st in states)
    taken = {first: set()}
    for r, st in enumerate(states):
        for e in range(first, st["epoch"] + 1):
            share = np.random.default_rng(seed + e).permutation(n)[r::world]
            taken.setdefault(e, set()).update(int(i) for i in (share if e < st["epoch"] else share[:st["cursor"]]))
        for e, rows in st.get("consumed", {}).items():
            if e >= first:
                taken.setdefault(e, set()).update(rows)
    return taken


def validation_samples(args, processor, rank, world, tools=None, norm_bbox="none"):
    """This rank's share of --val_data (every world-th row), prepared once; bad rows skipped by name. Exits on every
    rank when no rank kept a sample (check_validation)."""
    rows, out, skipped = Rows(args.val_data, args.columns, args.image_root), [], []
    for i in range(rank, len(rows), world):
        try:
            out.append(prepare(rows[i], processor, args, tools, norm_bbox))
        except ValueError as e:
            skipped.append((i, str(e)))
            print(f"[data] validation: skipped {e}")
    mine = (len(out), len(skipped), skipped[:3])
    shares = [mine]
    if world > 1:   # each rank saw its own share only: gathered, so that every rank decides alike
        shares = [None] * world
        dist.all_gather_object(shares, mine)
    check_validation(args.val_data, shares)
    return out


def check_validation(path, shares):
    """shares: each rank's (kept, skipped, first skipped). Exits when no rank kept a sample."""
    if sum(kept for kept, _, _ in shares) > 0:
        return
    n = sum(k for _, k, _ in shares)
    first = [reason for _, reason in sorted(r for _, _, rs in shares for r in rs)[:3]]
    sys.exit(f"error: --val_data {path} has no usable sample: all {n} of its samples were skipped; the first:\n  "
             + "\n  ".join(first) + (f"\n  (and {n - len(first)} more, each reported above)" if n > len(first) else ""))


def reward_columns(samples):
    """The samples' fields as the reward functions take them: {field: [value per sample]}."""
    return {k: [s["columns"].get(k) for s in samples] for k in (samples[0]["columns"] if samples else {})}


def completion_tokens(c, banned, pad_id, mm=None, mask=None):
    """One completion's tokens -> (input ids, loss mask, mm_token_type_ids), each (n,). A banned token the model wrote
    becomes a pad, out of the loss. `mask` (multi-turn) is 0 at the template's and the tools' tokens; `mm`: the
    trajectory's tool images."""
    c = torch.tensor(c, dtype=torch.long)
    own = torch.ones(len(c), dtype=torch.bool) if mask is None else torch.tensor(mask, dtype=torch.bool)
    ok = ~torch.isin(c, torch.tensor(sorted(banned), dtype=torch.long)) | ~own
    types = torch.tensor(mm["mm_token_type_ids"], dtype=torch.long) if mm else torch.zeros(len(c), dtype=torch.long)
    return torch.where(ok, c, torch.tensor(pad_id)), (ok & own).float(), types


def collate(samples, completions, pad_id, banned, masks=None, mms=None):
    """Left-pad each prompt + completion to the longest -> a micro-batch: input_ids, attention_mask, mm_token_type_ids
    (B, T), completion_mask (B, C) right-aligned with input_ids[:, -C:], and the images. masks[i], mms[i]: as
    completion_tokens takes them."""
    masks, mms = masks or [None] * len(samples), mms or [None] * len(samples)
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
        ids[i, T - n:], cmask[i, C - n:], mm_types[i, T - n:] = completion_tokens(c, banned, pad_id, mms[i], masks[i])
    return dict(input_ids=ids, attention_mask=attn, mm_token_type_ids=mm_types, completion_mask=cmask,
                **images_of([[s["hf"], m] for s, m in zip(samples, mms)]))


VISUAL_INPUTS = {"pixel_values": ("pixel_values", "image_grid_thw"),
                 "pixel_values_videos": ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")}


def images_of(rows):
    """The images and videos of a micro-batch as the model's inputs (pixel_values, image_grid_thw, and the video keys),
    each kind in token order; {} for text only. rows: each row's processor outputs, None where it has none."""
    out = {}
    for first, keys in VISUAL_INPUTS.items():
        found = [part for row in rows for part in row if part and first in part]
        out.update({k: torch.cat([part[k] for part in found]) for k in keys if found and k in found[0]})
    return out


def collate_prefix(parts, pad_id, banned):
    """Shared-prefix micro-batch (--shared_prefix): one row per group, its prompt once and then its completions,
    left-padded to the longest row. parts: (sample, [completion ids, ...]), and multi-turn the masks and tool images as
    collate takes them. -> for R rows and N completions: input_ids, mm_token_type_ids, prompt_mask, offset, part
    (R, T); attention_mask (R, 1, T, T) bool; completion_mask, targets, index (N, C), right-aligned as in collate; the
    images in token order. docs/data.md describes each."""
    parts = [(s, cs, *(rest or [[None] * len(cs)] * 2)) for s, cs, *rest in parts]
    comps = [c for _, cs, _, _ in parts for c in cs]
    C = max(max(len(c) for c in comps), 1)
    lengths = [s["hf"]["input_ids"].shape[1] + sum(len(c) for c in cs) for s, cs, _, _ in parts]
    R, T, N = len(parts), max(lengths), len(comps)
    ids = torch.full((R, T), pad_id, dtype=torch.long)
    mm_types = torch.zeros((R, T), dtype=torch.long)
    prompt = torch.zeros((R, T), dtype=torch.bool)
    offset, part = torch.zeros((R, T), dtype=torch.long), torch.zeros((R, T), dtype=torch.long)
    attn = torch.eye(T, dtype=torch.bool).repeat(R, 1, 1, 1)                   # (R, 1, T, T)
    cmask = torch.zeros((N, C))
    targets = torch.full((N, C), pad_id, dtype=torch.long)
    index = torch.zeros((N, C), dtype=torch.long)
    n = 0
    for r, ((s, cs, masks, mms), L) in enumerate(zip(parts, lengths)):
        start, P = T - L, s["hf"]["input_ids"].shape[1]
        ids[r, start:start + P], mm_types[r, start:start + P] = s["hf"]["input_ids"][0], s["hf"]["mm_token_type_ids"][0]
        prompt[r, start:start + P] = True
        attn[r, 0, start:start + P, start:start + P] = torch.ones(P, P, dtype=torch.bool).tril()
        at = start + P
        for j, (c, mask, mm) in enumerate(zip(cs, masks, mms)):
            k = len(c)
            ids[r, at:at + k], loss_mask, mm_types[r, at:at + k] = completion_tokens(c, banned, pad_id, mm, mask)
            attn[r, 0, at:at + k, start:start + P] = True
            attn[r, 0, at:at + k, at:at + k] = torch.ones(k, k, dtype=torch.bool).tril()
            index[n] = r * T + start + P - 1                                     # outside the completion: any valid row
            if k:
                index[n, C - k:] = r * T + torch.cat([torch.tensor([start + P - 1]), torch.arange(at, at + k - 1)])
                targets[n, C - k:], cmask[n, C - k:] = ids[r, at:at + k], loss_mask
                offset[r, at:at + k], part[r, at:at + k] = torch.arange(1, k + 1), j + 1
            at, n = at + k, n + 1
    return dict(input_ids=ids, attention_mask=attn, mm_token_type_ids=mm_types, completion_mask=cmask,
                prompt_mask=prompt, offset=offset, part=part, targets=targets, index=index,
                **images_of([[s["hf"], *mms] for s, _, _, mms in parts]))
