"""Every decoded image becomes 8-bit RGB here, by one set of rules (``to_rgb8``).

The server (api/media/decode.py), `triptych ocr` (jobs/ocr_sources.py, jobs/pdf.py) and its
layout step (jobs/ocr_lines.py) all read pixels through this function, so an image reads the
same whatever the route. The rules:

- Orientation: an EXIF Orientation tag (2-8) is applied (``ImageOps.exif_transpose``), as
  HF's ``load_image`` does for a path or URL; HF's image processors never look at EXIF, so
  a PIL image handed to HF's processor directly stays as stored. A transposed image loses
  its tag, so applying the rule twice changes nothing.
- Animated images (GIF, APNG, WebP, MPO): the frame the image is on, which is the first
  frame of a file as opened.
- Transparency (an alpha band: LA, La, PA, RGBA, RGBa; or a ``transparency`` entry: P, L,
  RGB, 16-bit grey): composited on white, as HF's ``convert_rgb`` does.
- 16-bit samples keep their high byte (``v >> 8``): grey (I;16, I;16L, I;16B, I;16N) here,
  RGB(A) already by Pillow's PNG and TIFF decoders, which hand 16-bit colour over as 8-bit
  RGB(A) this way, so a grey and a colour 16-bit image of the same content agree, and an
  8-bit image stored in 16 bits (``v * 257``) comes back exactly. Pillow's own
  ``convert("RGB")`` clips instead (every value above 255 turns white), and so does HF's
  ``load_image``: there we do better than the oracle, on purpose.
- 32-bit ``I`` and ``F``: scaled by their range, the smallest of [0, 1] (``F`` only: x 255),
  [0, 255] (as is) and [0, 65535] (``>> 8``, as 16 bits) that holds every finite value;
  values outside all three are stretched from their own minimum..maximum onto 0..255.
  Rounded to the nearest level; NaN reads as 0.
- CMYK: through its embedded ICC profile to sRGB when it has one (LittleCMS, perceptual
  intent); without one (or with one LittleCMS refuses), Pillow's plain conversion.
  RGB images keep their values whatever profile they embed, as in HF.
- Everything else (1, L, P, RGBX, YCbCr, HSV, LAB): Pillow's ``convert("RGB")``.
"""
from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageOps

_ORIENTATION = 0x0112  # EXIF tag
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
_WHITE = (255, 255, 255, 255)


def to_rgb8(img: Image.Image) -> Image.Image:
    """``img`` as 8-bit RGB by the rules above (``img`` itself when it is already RGB,
    upright and opaque)."""
    img = _upright(img)
    if img.mode in _SIXTEEN_BIT:
        grey = np.asarray(img).astype(np.uint16) >> 8
        alpha = _transparent_value_mask(img, np.asarray(img))
        return _grey_to_rgb(grey.astype(np.uint8), alpha)
    if img.mode in ("I", "F"):
        return _grey_to_rgb(_range_to_8bit(np.asarray(img), img.mode == "F"), None)
    if img.mode == "CMYK":
        return _cmyk_to_rgb(img)
    if _has_alpha(img):
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, _WHITE), rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


def _upright(img: Image.Image) -> Image.Image:
    # NOTE: exif_transpose copies an image that needs no turn; asking first avoids that copy
    # for the usual photo.
    if img.getexif().get(_ORIENTATION, 1) in range(2, 9):
        return ImageOps.exif_transpose(img)
    return img


def _has_alpha(img: Image.Image) -> bool:
    bands = img.getbands()
    return "A" in bands or "a" in bands or img.info.get("transparency") is not None


def _transparent_value_mask(img: Image.Image, values: np.ndarray) -> np.ndarray | None:
    """Opacity (255 / 0) of a grey image whose ``transparency`` names one sample value."""
    t = img.info.get("transparency")
    if not isinstance(t, int):
        return None
    return np.where(values == t, 0, 255).astype(np.uint8)


def _grey_to_rgb(grey: np.ndarray, alpha: np.ndarray | None) -> Image.Image:
    if alpha is not None:  # on white, as every other transparent image
        grey = np.where(alpha == 0, 255, grey).astype(np.uint8)
    return Image.fromarray(np.ascontiguousarray(grey), mode="L").convert("RGB")


def _range_to_8bit(values: np.ndarray, is_float: bool) -> np.ndarray:
    """32-bit samples to 0..255 by the smallest standard range that holds them."""
    lo, hi = 0.0, 0.0
    finite = values[np.isfinite(values)] if is_float else values
    if finite.size:  # (an image without one finite value has no range: it reads as 0)
        lo, hi = float(finite.min()), float(finite.max())
    if is_float and lo >= 0.0 and hi <= 1.0:
        scale, shift = 255.0, 0.0
    elif lo >= 0.0 and hi <= 255.0:
        scale, shift = 1.0, 0.0
    elif lo >= 0.0 and hi <= 65535.0:
        scale, shift = None, 0.0  # as a 16-bit sample: its high byte
    else:
        scale, shift = 255.0 / (hi - lo), lo
    out = np.empty(values.shape, np.uint8)
    # NOTE: by bands of rows, so a 32 MP float image never holds several float64 copies
    for r in range(0, values.shape[0], 256):
        a = values[r:r + 256].astype(np.float64)
        a[~np.isfinite(a)] = shift
        a = np.floor(np.rint(a) / 256.0) if scale is None else np.rint((a - shift) * scale)
        out[r:r + 256] = np.clip(a, 0, 255)
    return out


def _cmyk_to_rgb(img: Image.Image) -> Image.Image:
    icc = img.info.get("icc_profile")
    if icc:
        from PIL import ImageCms

        try:
            src = ImageCms.ImageCmsProfile(io.BytesIO(icc))
            out = ImageCms.profileToProfile(img, src, ImageCms.createProfile("sRGB"),
                                            outputMode="RGB")
            if out is not None:
                return out
        except (ImageCms.PyCMSError, OSError, ValueError):
            pass  # a profile LittleCMS cannot use: the plain conversion below
    return img.convert("RGB")


__all__ = ["to_rgb8"]
