"""Every pixel format reads as the right 8-bit RGB (api/media/pixels.py ``to_rgb8``): one test
per mode against values worked out by hand, through the server's decoder where a file
format carries the mode, and the ocr layout step reading a 16-bit page as its 8-bit twin.
"""
from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image
from triptych.api.media.decode import MediaLimits, decode_image
from triptych.api.media.pixels import to_rgb8


def rgb(img: Image.Image) -> np.ndarray:
    out = to_rgb8(img)
    assert out.mode == "RGB"
    return np.asarray(out).astype(int)


def grey(values: list[int]) -> np.ndarray:
    """The RGB rows a grey row reads as."""
    return np.repeat(np.array([values])[..., None], 3, axis=-1)


def encoded(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def png16(samples: np.ndarray, color_type: int) -> bytes:
    """A 16-bit PNG written by hand (Pillow writes no 16-bit colour): color_type 0 grey,
    2 RGB, 4 grey + alpha, 6 RGBA; ``samples`` [h, w(, channels)] uint16."""
    h, w = samples.shape[:2]
    raw = b"".join(b"\x00" + samples[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def decoded(data: bytes) -> np.ndarray:
    img = decode_image(data, MediaLimits())
    assert img.mode == "RGB"
    return np.asarray(img).astype(int)


# -- 8-bit modes ---------------------------------------------------------------------------
def test_rgb_passes_through_untouched() -> None:
    img = Image.fromarray(np.arange(24, dtype=np.uint8).reshape(2, 4, 3))
    assert to_rgb8(img) is img


def test_grey_and_bilevel_replicate_into_three_channels() -> None:
    assert (rgb(Image.fromarray(np.array([[0, 7, 255]], np.uint8))) == grey([0, 7, 255])).all()
    bits = Image.fromarray(np.array([[0, 255]], np.uint8)).convert("1")
    assert (rgb(bits) == grey([0, 255])).all()


def test_alpha_is_composited_on_white() -> None:
    la = Image.fromarray(np.array([[[0, 255], [0, 0], [100, 128]]], np.uint8), mode="LA")
    got = rgb(la)
    assert (got[0, :2] == grey([0, 255])[0]).all()  # opaque black, transparent -> white
    assert abs(got[0, 2, 0] - round((100 * 128 + 255 * 127) / 255)) <= 1
    rgba = Image.fromarray(np.array([[[10, 20, 30, 255], [10, 20, 30, 0]]], np.uint8))
    assert rgb(rgba).tolist() == [[[10, 20, 30], [255, 255, 255]]]
    # a 16-bit RGBA PNG: Pillow hands it over as 8-bit RGBA (high bytes), then as above
    data = png16(np.array([[[65535, 0, 0, 65535], [0, 0, 65535, 0]]], np.uint16), 6)
    assert decoded(data).tolist() == [[[255, 0, 0], [255, 255, 255]]]


def test_palette_transparency_is_white() -> None:
    p = Image.new("P", (3, 1))
    p.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255])
    p.putdata([0, 1, 2])
    back = Image.open(io.BytesIO(encoded(p, "PNG", transparency=1)))
    assert back.mode == "P" and back.info.get("transparency") == 1
    assert rgb(back).tolist() == [[[255, 0, 0], [255, 255, 255], [0, 0, 255]]]


# -- 16 and 32 bits --------------------------------------------------------------------------
SIXTEEN = [0, 100 * 257, 40000, 65535]  # 8-bit 100 stored in 16 bits, and a mid value
EIGHT = [0, 100, 40000 >> 8, 255]


def test_sixteen_bit_grey_is_scaled_not_clipped() -> None:
    data = encoded(Image.fromarray(np.array([SIXTEEN], np.uint16)), "PNG")
    opened = Image.open(io.BytesIO(data))
    assert opened.mode == "I;16"
    assert np.asarray(opened.convert("RGB"))[0, 1, 0] == 255  # Pillow's (and HF's) clip
    assert (decoded(data) == grey(EIGHT)).all()
    for mode, dtype in (("I;16B", ">u2"), ("I;16L", "<u2")):
        img = Image.frombytes(mode, (4, 1), np.array(SIXTEEN, dtype).tobytes())
        assert (rgb(img) == grey(EIGHT)).all(), mode


def test_sixteen_bit_grey_transparency_is_white() -> None:
    data = encoded(Image.fromarray(np.array([SIXTEEN], np.uint16)), "PNG", transparency=40000)
    assert (decoded(data) == grey([0, 100, 255, 255])).all()


def test_sixteen_bit_rgb_as_pillow_opens_it() -> None:
    """Pillow has no 16-bit RGB mode: such a PNG opens as 8-bit RGB of each sample's high
    byte, the rule 16-bit grey follows, so the two agree."""
    samples = np.array([[[0, 100 * 257, 40000], [65535, 300, 65280]]], np.uint16)
    data = png16(samples, 2)
    assert Image.open(io.BytesIO(data)).mode == "RGB"
    assert decoded(data).tolist() == [[[0, 100, 156], [255, 1, 255]]]
    assert (decoded(png16(np.array([SIXTEEN], np.uint16), 0)) == grey(EIGHT)).all()


@pytest.mark.parametrize("values, expected", [
    ([0, 100, 255], [0, 100, 255]),  # within 0..255: as they are
    ([0, 100 * 257, 65535], [0, 100, 255]),  # within 0..65535: as 16 bits
    ([-1000, 0, 1000], [0, 128, 255]),  # beyond: stretched from min..max
])
def test_32_bit_integer_scaled_by_its_range(values, expected) -> None:
    img = Image.fromarray(np.array([values], np.int32))
    assert img.mode == "I"
    assert (rgb(img) == grey(expected)).all()


@pytest.mark.parametrize("values, expected", [
    ([0.0, 0.5, 1.0, float("nan")], [0, 128, 255, 0]),  # within 0..1: x 255, NaN -> 0
    ([0.0, 100.4, 255.0], [0, 100, 255]),
    ([-1.0, 0.0, 1.0], [0, 128, 255]),
])
def test_float_scaled_by_its_range(values, expected) -> None:
    img = Image.fromarray(np.array([values], np.float32))
    assert img.mode == "F"
    assert (rgb(img) == grey(expected)).all()


# -- CMYK ------------------------------------------------------------------------------------
def cmyk_grey_profile() -> bytes:
    """A minimal ICC v2 CMYK profile written by hand: its A2B0 table maps any C, M, Y to
    nothing and K from white to black (L* 100 -> 0, a* = b* = 0), so colour through the
    profile differs visibly from Pillow's plain conversion."""
    def tag(kind: bytes, body: bytes) -> bytes:
        return kind + b"\0" * 4 + body

    desc = b"grey by K\0"
    clut = [v for i in range(16) for v in (0 if i & 1 else 0xFF00, 0x8000, 0x8000)]
    lut = (struct.pack(">BBBB", 4, 3, 2, 0)
           + struct.pack(">9i", 65536, 0, 0, 0, 65536, 0, 0, 0, 65536)
           + struct.pack(">HH", 2, 2) + struct.pack(">8H", *[0, 65535] * 4)
           + struct.pack(">48H", *clut) + struct.pack(">6H", *[0, 65535] * 3))
    tags = [(b"desc", tag(b"desc", struct.pack(">I", len(desc)) + desc + b"\0" * 78)),
            (b"wtpt", tag(b"XYZ ", struct.pack(">3i", 63190, 65536, 54061))),
            (b"cprt", tag(b"text", b"none\0")), (b"A2B0", tag(b"mft2", lut))]
    offset, table, data = 128 + 4 + 12 * len(tags), b"", b""
    for kind, body in tags:
        data += b"\0" * (-(offset + len(data)) % 4)
        table += kind + struct.pack(">II", offset + len(data), len(body))
        data += body
    body = struct.pack(">I", len(tags)) + table + data
    header = (struct.pack(">I", 128 + len(body)) + b"\0" * 4 + struct.pack(">I", 0x02100000)
              + b"prtrCMYKLab " + b"\0" * 12 + b"acsp" + b"\0" * 28
              + struct.pack(">3i", 63190, 65536, 54061) + b"\0" * 48)
    return header + body


CMYK = np.array([[[255, 0, 0, 0], [0, 0, 0, 255], [0, 255, 255, 0]]], np.uint8)


@pytest.mark.parametrize("fmt", ["TIFF", "JPEG"])
def test_cmyk_through_its_icc_profile(fmt) -> None:
    img = Image.frombytes("CMYK", (3, 1), CMYK.tobytes())
    data = encoded(img, fmt, icc_profile=cmyk_grey_profile(),
                   **({"quality": 100} if fmt == "JPEG" else {}))
    got = decoded(data)
    assert (np.abs(got - grey([255, 0, 255])) <= 1).all(), got  # the profile ignores C, M, Y


def test_cmyk_without_a_profile_is_pillows_conversion() -> None:
    img = Image.frombytes("CMYK", (3, 1), CMYK.tobytes())
    assert decoded(encoded(img, "TIFF")).tolist() == [[[0, 255, 255], [0, 0, 0], [255, 0, 0]]]


# -- orientation, animation ----------------------------------------------------------------
ORIENTED = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3) * 10


@pytest.mark.parametrize("orientation, turn", [
    (1, lambda a: a), (3, lambda a: a[::-1, ::-1]),  # 180 degrees
    (6, lambda a: np.rot90(a, k=-1)),  # shown turned 90 degrees clockwise
    (8, lambda a: np.rot90(a, k=1)), (2, lambda a: a[:, ::-1]),  # mirrored
])
def test_exif_orientation_is_applied(orientation, turn) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encoded(Image.fromarray(ORIENTED), "PNG", exif=exif.tobytes())
    got = decode_image(data, MediaLimits())
    assert np.array_equal(np.asarray(got), turn(ORIENTED))
    assert np.array_equal(np.asarray(to_rgb8(got)), turn(ORIENTED))  # applied once only


def test_an_animation_reads_as_its_first_frame() -> None:
    frames = [Image.new("RGB", (4, 4), c) for c in ((255, 0, 0), (0, 0, 255))]
    for fmt in ("GIF", "WEBP", "PNG"):
        data = encoded(frames[0], fmt, save_all=True, append_images=frames[1:],
                       **({"lossless": True} if fmt == "WEBP" else {}))
        assert getattr(Image.open(io.BytesIO(data)), "n_frames", 1) == 2, fmt
        assert decoded(data)[0, 0].tolist() == [255, 0, 0], fmt


# -- the ocr layout step ---------------------------------------------------------------------
def test_the_layout_step_reads_a_sixteen_bit_page_as_its_eight_bit_twin() -> None:
    from triptych.demo import heldout
    from triptych.jobs.ocr_lines import page_strips

    (sample,) = heldout.lines(1)
    page = np.asarray(sample.image.convert("L"))
    eight = encoded(Image.fromarray(page), "PNG")
    sixteen = encoded(Image.fromarray(page.astype(np.uint16) * 257), "PNG")
    assert Image.open(io.BytesIO(sixteen)).mode == "I;16"
    strips = page_strips(eight)
    assert strips and page_strips(sixteen) == strips
