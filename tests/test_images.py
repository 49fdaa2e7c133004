"""Images: downscaled once on the model's grid (28 px for Qwen2.5-VL, 32 for Qwen3-VL / Qwen3.5), every
mode fixed, bad files named."""
import pytest
from PIL import Image

import data


@pytest.mark.parametrize("grid", [28, 32])
@pytest.mark.parametrize("size", [(56, 56), (1000, 600), (4000, 3000), (30, 500), (3000, 40)])
def test_downscale_keeps_aspect_bounds_grid(size, grid):
    img = Image.new("RGB", size)
    lo, hi = 4 * grid * grid, grid * grid * 256
    out = data.downscale(img, lo, hi, grid)
    w, h = out.size
    assert w % grid == 0 and h % grid == 0
    assert lo <= w * h <= hi
    if min(size) >= 100:   # tiny sides are rounded up to one grid cell, so aspect is only kept for real images
        assert abs(w / h - size[0] / size[1]) / (size[0] / size[1]) < 0.15


def test_downscale_is_a_noop_on_the_grid():
    img = Image.new("RGB", (56, 84))
    assert data.downscale(img, 28 * 28, 10 ** 6, 28) is img


@pytest.mark.parametrize("mode,ext", [("L", "png"), ("RGBA", "png"), ("P", "png"), ("I;16", "png"),
                                      ("LA", "png"), ("CMYK", "jpg")])
def test_modes_become_rgb(tmp_path, mode, ext):
    path = tmp_path / f"x.{ext}"
    Image.new(mode, (60, 60)).save(path)
    out = data.load_image(path, 28 * 28, 28 * 28 * 16, 28)
    assert out.mode == "RGB" and out.size == (56, 56)


@pytest.mark.parametrize("values,expected", [(0.5, 127), (200.0, 200)])
def test_a_float_tiff_is_scaled_faithfully(tmp_path, values, expected):
    """A 32-bit float image (TIFF) holding 0..1 is scaled to 0..255, not truncated to black; 0..255 is kept."""
    path = tmp_path / "f.tiff"
    Image.new("F", (56, 56), values).save(path)
    assert data.load_image(path, 28 * 28, 10 ** 6, 28).getpixel((5, 5)) in ((expected,) * 3, (expected + 1,) * 3)


def test_an_image_with_no_faithful_8_bit_form_is_refused(tmp_path):
    path = tmp_path / "f.tiff"
    Image.new("F", (56, 56), 1000.0).save(path)
    with pytest.raises(ValueError, match="f.tiff.*no faithful 8-bit conversion"):
        data.load_image(path, 28 * 28, 10 ** 6, 28)


def test_rgba_transparent_goes_on_white(tmp_path):
    path = tmp_path / "t.png"
    Image.new("RGBA", (56, 56), (255, 0, 0, 0)).save(path)
    assert data.load_image(path, 28 * 28, 10 ** 6, 28).getpixel((5, 5)) == (255, 255, 255)


def test_exif_rotation_is_applied(tmp_path):
    path = tmp_path / "r.jpg"
    img = Image.new("RGB", (112, 56))
    exif = img.getexif()
    exif[0x0112] = 6   # orientation: rotate 90 degrees
    img.save(path, exif=exif)
    assert data.load_image(path, 28 * 28, 10 ** 6, 28).size == (56, 112)


def test_bad_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="missing.png"):
        data.load_image(tmp_path / "missing.png", 28 * 28, 10 ** 6, 28)
    bad = tmp_path / "corrupt.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    with pytest.raises(ValueError, match="corrupt.png"):
        data.load_image(bad, 28 * 28, 10 ** 6, 28)


def test_decompression_bomb_is_refused_and_big_images_downscaled(tmp_path, monkeypatch):
    path = tmp_path / "big.png"
    Image.new("RGB", (2000, 1500), (0, 128, 0)).save(path)
    out = data.load_image(path, 28 * 28, 28 * 28 * 64, 28)      # big but legal: downscaled once
    assert out.size[0] * out.size[1] <= 28 * 28 * 64 and out.size[0] % 28 == 0
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1_000_000)  # 3 MP is past twice this: a "bomb"
    with pytest.raises(ValueError, match="big.png.*DecompressionBombError"):
        data.load_image(path, 28 * 28, 28 * 28 * 64, 28)


def test_original_size_is_kept_for_box_rewards(tmp_path):
    path = tmp_path / "r.jpg"
    img = Image.new("RGB", (1120, 560))
    exif = img.getexif()
    exif[0x0112] = 6
    img.save(path, exif=exif)
    out = data.load_image(path, 28 * 28, 28 * 28 * 100, 28)
    assert out.info["original_size"] == (560, 1120)     # upright, before downscaling
    assert out.size[0] < out.size[1] and out.size[0] * out.size[1] <= 28 * 28 * 100
