"""A drawing made into a sample the way the dataset's own samples were made.

MNIST (and EMNIST, built by the same recipe): "the images were size normalized to fit in a
20x20 pixel box while preserving their aspect ratio ... anti-aliasing ... then centered in a
28x28 image by computing the center of mass of the pixels" (LeCun, Cortes and Burges, the
MNIST page; Cohen et al. 2017 for EMNIST). OCR letters (Taskar et al. 2003): 16x8 binary
images of the letter scaled to fit, centred; measured on the test split, 78% of letters span
the full 8 columns and heights are centred, so: fit the bounding box into 16x8 keeping the
aspect ratio, centre it, threshold at half ink.

Input: ink intensity, 0 (paper) to 255 (full ink), as a [H, W] uint8 tensor. Output: the
stored-pixel scale of the dataset (0-255 for MNIST, 0/1 for OCR), [1, h, w] float.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from partrain.errors import PartrainError

# what a drawing is made into, per dataset: (rows, cols) of the sample, box the ink is fitted into
SHAPES = {"mnist": ((28, 28), (20, 20)), "emnist": ((28, 28), (20, 20)), "ocr-letters": ((16, 8), (16, 8))}
CLASSES = {
    "mnist": [str(d) for d in range(10)],
    "emnist": [chr(ord("a") + i) for i in range(26)],
    "ocr-letters": list("aegilnortu"),
}


def _check(dataset: str) -> None:
    if dataset not in SHAPES:
        raise PartrainError(f"serve reads handwritten characters: the model was trained on {dataset!r}, "
                            f"not one of {', '.join(SHAPES)}")


def _fit(ink: torch.Tensor, box: tuple[int, int]) -> torch.Tensor:
    """The ink's bounding box scaled, aspect ratio kept, to fit ``box``; anti-aliased (area
    averaging when shrinking). Returns [h, w] float in 0-255."""
    rows, cols = torch.nonzero(ink > 0, as_tuple=True)
    crop = ink[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1].float()
    h, w = crop.shape
    s = min(box[0] / h, box[1] / w)
    size = (max(1, round(h * s)), max(1, round(w * s)))
    return F.interpolate(crop[None, None], size=size, mode="bilinear", antialias=True, align_corners=False)[0, 0]


def _paste(canvas: torch.Tensor, img: torch.Tensor, top: int, left: int) -> torch.Tensor:
    """Paste ``img`` at (top, left), clipped to the canvas."""
    H, W = canvas.shape
    h, w = img.shape
    t0, l0 = max(0, top), max(0, left)
    t1, l1 = min(H, top + h), min(W, left + w)
    if t1 > t0 and l1 > l0:
        canvas[t0:t1, l0:l1] = img[t0 - top : t1 - top, l0 - left : l1 - left]
    return canvas


def to_sample(ink: torch.Tensor, dataset: str) -> torch.Tensor:
    """A drawing ([H, W] ink 0-255) as one sample of ``dataset``: [1, rows, cols] float."""
    _check(dataset)
    (rows, cols), box = SHAPES[dataset]
    if ink.dim() != 2 or not (ink > 0).any():
        return torch.zeros(1, rows, cols)
    img = _fit(ink, box)
    h, w = img.shape
    if dataset == "ocr-letters":
        out = _paste(torch.zeros(rows, cols), (img >= 127.5).float(), (rows - h) // 2, (cols - w) // 2)
        return out[None]
    # centre of mass onto pixel (14, 14): where it lies in MNIST's own images (test split: 13.99, 14.00 on
    # average, 0.3 standard deviation), one half pixel below-right of the geometric centre 13.5
    ys, xs = torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32)
    total = img.sum()
    cy, cx = (img.sum(1) * ys).sum() / total, (img.sum(0) * xs).sum() / total
    top, left = round(rows / 2 - cy.item()), round(cols / 2 - cx.item())
    return _paste(torch.zeros(rows, cols), img, top, left).clamp_(0, 255)[None]


def normalize(sample: torch.Tensor, dataset: str) -> torch.Tensor:
    """Stored-pixel scale to what the model was trained on: what ``load_dataset`` applies."""
    from partrain.data.load import normalization

    scale, mean, std = normalization(dataset)
    return (sample * scale - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
