"""JPEGs decoded where the model runs (`--decode-on device`): on a GPU, nvJPEG decodes a whole batch at once and the
crop, resize, flip and normalisation are a few kernels, so the loader's CPU work per image is reading the file.

The loader workers read each file's bytes and draw its random crop box and flip from the sample's own seed
(`augmentation_seed`), the same draws `RandomResizedCrop` + `RandomHorizontalFlip` make on the PIL path: a resume
stays exact with any number of workers, and the two paths crop the same boxes. What the device decoder cannot take
(PNG and other formats, CMYK JPEGs) is decoded in the worker, as the PIL path does, and joins the batch as pixels.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image
from torchvision import transforms
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.functional import pil_to_tensor

from ddp_accel.errors import UserError
from ddp_accel.vision.data import (
    CheckedImageFolder,
    DeviceNormalize,
    augmentation_seed,
    check_image_folder,
    named_if_unreadable,
)

JPEG_START = b"\xff\xd8\xff"
# what nvJPEG and libjpeg decode to RGB themselves; other JPEGs (CMYK, YCCK) are decoded by PIL in the worker
DECODABLE_MODES = ("RGB", "L")
CENTER = -1  # a box's flip field for a validation image: resize the short side, then the centre crop


@dataclass
class EncodedImages:
    """A batch as the workers send it: per image its JPEG bytes (1-D uint8) or its pixels (3-D uint8, decoded in the
    worker), and its box: (top, left, height, width, flip) in the image's pixels, or (0, 0, 0, 0, CENTER).
    It has no `.to`: Accelerate leaves it on the CPU, where the decoder reads it."""

    data: list[torch.Tensor]
    boxes: torch.Tensor  # (batch, 5) int64
    paths: list[str]  # to name a file the decoder cannot read

    def __len__(self) -> int:
        return len(self.data)


class EncodedImageFolder(CheckedImageFolder):
    """An ImageFolder whose items are (file bytes, crop box, class) for `DeviceDecode`. `train`: RandomResizedCrop's
    box and the flip, drawn from the sample's seed; else the validation's resize and centre crop (no draw)."""

    def __init__(self, root: Path, train: bool, class_to_idx: dict[str, int] | None = None, seed: int = 0) -> None:
        self.train = train
        super().__init__(root, transform=_unused, class_to_idx=class_to_idx, seed=seed)

    # (bytes, box, class, path), which collate_encoded batches, where the PIL folder gives (image, class)
    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int, str]:  # type: ignore[override]
        path, target = self.samples[index]
        with named_if_unreadable(path):
            raw = Path(path).read_bytes()
            with Image.open(io.BytesIO(raw)) as header:  # the header only: size and mode, no decoding
                box = (0, 0, 0, 0, CENTER)
                if self.train:
                    with augmentation_seed(self.seed, self.epoch, index):
                        box = self.draw_box(header)
                decodable = raw.startswith(JPEG_START) and header.mode in DECODABLE_MODES
            pixels = None if decodable else self.loader(io.BytesIO(raw))  # from the bytes read, not the file again
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if pixels is None else pil_to_tensor(pixels)
        return data, torch.tensor(box), target, path

    @staticmethod
    def draw_box(image: Image.Image) -> tuple[int, int, int, int, int]:
        """RandomResizedCrop's box (default scale and ratio), then RandomHorizontalFlip's draw: the PIL path's
        draws, in its order, from the same generator (they read the image's size only)."""
        top, left, height, width = transforms.RandomResizedCrop.get_params(image, [0.08, 1.0], [3 / 4, 4 / 3])
        flip = int(torch.rand(1).item() < 0.5)
        return top, left, height, width, flip


def encoded_image_folders(data_dir: str, seed: int = 0) -> tuple[EncodedImageFolder, EncodedImageFolder, list[str]]:
    """DATA_DIR's train/ and val/ folders for `DeviceDecode` (as `image_folders` for the PIL path)."""
    train_dir, val_dir = check_image_folder(data_dir)
    train = EncodedImageFolder(train_dir, train=True, seed=seed)
    val = EncodedImageFolder(val_dir, train=False, class_to_idx=train.class_to_idx)
    return train, val, train.classes


def collate_encoded(items: Sequence[tuple[torch.Tensor, torch.Tensor, int, str]]) -> dict[str, Any]:
    """The loader's collate_fn: the targets first (the batch's size for Accelerate), then the images as they are."""
    data, boxes, targets, paths = zip(*items, strict=True)
    images = EncodedImages(list(data), torch.stack(boxes), list(paths))
    return {"targets": torch.tensor(targets), "images": images}


class DeviceDecode:
    """A batch of `EncodedImages` -> normalised float images on the targets' device (nvJPEG on a GPU, libjpeg on
    the CPU), each cropped and resized to `image_size` as the PIL path does: the training box resized to a square;
    for validation the short side to image_size / 0.875, then the centre crop. Bilinear with antialiasing, as PIL."""

    def __init__(
        self, image_size: int, mean: Sequence[float], std: Sequence[float], channels_last: bool = False
    ) -> None:
        self.image_size, self.resize_to = image_size, round(image_size / 0.875)
        self.normalize = DeviceNormalize(mean, std, channels_last)

    def inputs(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        targets, encoded = batch["targets"], batch["images"]
        decoded = self.decode(encoded, targets.device)
        pixels = torch.cat([self.crop(image, box) for image, box in zip(decoded, encoded.boxes.tolist(), strict=True)])
        return self.normalize.scaled(pixels), targets

    @staticmethod
    def decode(encoded: EncodedImages, device: torch.device) -> list[torch.Tensor]:
        """Every image of the batch as uint8 (3, H, W) on `device`: the JPEGs in one call."""
        jpegs = [index for index, data in enumerate(encoded.data) if data.dim() == 1]
        images = list(encoded.data)
        if jpegs:
            try:
                decoded = _decode_jpegs([encoded.data[i] for i in jpegs], device)
            except RuntimeError:
                decoded = [_decode_one(encoded.data[i], encoded.paths[i], device) for i in jpegs]
            for index, image in zip(jpegs, decoded, strict=True):
                images[index] = image
        return [image.to(device, non_blocking=True) for image in images]

    def crop(self, image: torch.Tensor, box: list[int]) -> torch.Tensor:
        top, left, height, width, flip = box
        if flip == CENTER:
            short = min(image.shape[1:])
            size = [self.resize_to, self.resize_to]
            long_side = int(self.resize_to * max(image.shape[1:]) / short)  # torchvision's Resize(int) rule
            size[0 if image.shape[1] > image.shape[2] else 1] = long_side
            resized = F.interpolate(image[None].float(), size=size, mode="bilinear", antialias=True)
            top = int(round((size[0] - self.image_size) / 2.0))
            left = int(round((size[1] - self.image_size) / 2.0))
            return resized[:, :, top : top + self.image_size, left : left + self.image_size]
        window = image[None, :, top : top + height, left : left + width].float()
        square = [self.image_size, self.image_size]
        resized = F.interpolate(window, size=square, mode="bilinear", antialias=True)
        return resized.flip(-1) if flip else resized


def _decode_jpegs(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    # torchvision 0.29 deprecates its decoders for TorchCodec's (not tried on a GPU here; torchvision's wheel carries
    # nvJPEG): the same call there (torchcodec.decoders.decode_jpeg, a list and a device) when torchvision drops it
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The image decoding and encoding capabilities", DeprecationWarning)
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)


def _decode_one(data: torch.Tensor, path: str, device: torch.device) -> torch.Tensor:
    """One JPEG the batch decoder refused, decoded on the CPU; a file no decoder reads is named."""
    try:
        return _decode_jpegs([data], torch.device("cpu"))[0].to(device)
    except RuntimeError:
        raise UserError(f"cannot decode image {path} (a damaged JPEG); delete or replace it") from None


def _unused(image: Any) -> Any:  # (ImageFolder wants a transform; this folder's items are not transformed)
    return image
