"""ImageFolder data (checked up front, clear errors), the standard transforms, and synthetic images."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision import datasets, transforms
from torchvision.datasets.folder import IMG_EXTENSIONS

from ddp_accel.bad_samples import BadSample
from ddp_accel.errors import UserError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def check_image_folder(data_dir: str | Path) -> tuple[Path, Path]:
    """DATA_DIR/train/<class>/* and DATA_DIR/val/<class>/*: every class folder holds images, val's classes are
    train's."""
    root = Path(data_dir)
    if not root.is_dir():
        raise UserError(
            f"data directory {root} does not exist (expected {root}/train/<class>/*.jpg and {root}/val/...)"
        )
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise UserError(
                f"{root} has no {split}/ folder: expected {root}/train/<class>/*.jpg and {root}/val/<class>/*.jpg"
            )
    classes = {}
    for split in ("train", "val"):
        folder = root / split
        classes[split] = sorted(entry.name for entry in folder.iterdir() if entry.is_dir())
        if not classes[split]:
            raise UserError(f"{folder} has no class folders (one sub-folder of images per class)")
        for name in classes[split]:
            if not any(path.suffix.lower() in IMG_EXTENSIONS for path in (folder / name).iterdir()):
                raise UserError(
                    f"class folder {folder / name} has no images ({', '.join(IMG_EXTENSIONS)}); "
                    "add images or remove the folder"
                )
    unknown = sorted(set(classes["val"]) - set(classes["train"]))
    if unknown:
        raise UserError(f"{root}/val has classes that train/ lacks: {', '.join(unknown[:5])}")
    if len(classes["train"]) < 2:
        raise UserError(
            f"{root}/train has one class folder ({classes['train'][0]}); a classifier needs two or more "
            "(one sub-folder of images per class)"
        )
    return root / "train", root / "val"


def walk_images(folder: Path) -> Iterator[Path]:
    """Image files under `folder`, links followed, in a stable order; a link that leads back into the folders
    already walked (a file-system loop) is one line, not the same images counted again and again."""
    seen: set[tuple[int, int]] = set()
    for current, subfolders, files in os.walk(folder, followlinks=True):
        stat = os.stat(current)
        if (stat.st_dev, stat.st_ino) in seen:
            raise UserError(
                f"{current} leads back to a folder already read (a symbolic-link loop under {folder}); remove the link"
            )
        seen.add((stat.st_dev, stat.st_ino))
        subfolders.sort()
        for name in sorted(files):
            if name.lower().endswith(IMG_EXTENSIONS):
                yield Path(current, name)


def load_image(path: str | IO[bytes]) -> Image.Image:
    """An RGB image as it is: 16-bit and 32-bit grey (which PIL's convert("RGB") clips to white) scaled to 8 bits,
    palette, CMYK, grey and alpha images converted. A decompression bomb (more pixels than PIL's limit) is refused."""
    with Image.open(path) as image:
        image.load()
        if image.mode not in ("I;16", "I;16B", "I;16L", "I", "F"):
            return image.convert("RGB")
        values = np.asarray(image, dtype=np.float64)
        top = 65535.0 if image.mode.startswith("I;16") else max(float(values.max()), 1.0)
        return Image.fromarray(np.clip(values / top * 255.0, 0, 255).astype(np.uint8), mode="L").convert("RGB")


class CheckedImageFolder(datasets.ImageFolder):
    """ImageFolder whose unreadable images stop training with the file's name instead of a PIL traceback.

    We chose a clear error over skipping: a skipped image would silently change the dataset (and the
    exact-once evaluation count). Delete or replace the file and run again.
    """

    def __init__(
        self,
        root: Path,
        transform: Callable[[Any], torch.Tensor],
        class_to_idx: dict[str, int] | None = None,
        seed: int = 0,
    ) -> None:
        self._fixed_classes = class_to_idx
        self.seed, self.epoch = seed, 0
        super().__init__(str(root), transform=transform, loader=load_image)

    def set_epoch(self, epoch: int) -> None:
        """Accelerate's prepared loader calls this at each epoch start (fit's start_epoch)."""
        self.epoch = epoch

    def make_dataset(
        self, directory: str, class_to_idx: dict[str, int], *args: Any, **kwargs: Any
    ) -> list[tuple[str, int]]:
        """(path, class index) of every image, walked without following a link loop (see walk_images)."""
        return [
            (str(path), index)
            for name, index in sorted(class_to_idx.items())
            for path in walk_images(Path(directory, name))
        ]

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        if self._fixed_classes is not None:  # val uses train's class indices even if it lacks a class
            names = sorted(entry.name for entry in Path(directory).iterdir() if entry.is_dir())
            return names, {name: self._fixed_classes[name] for name in names}
        return super().find_classes(directory)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, target = self.samples[index]
        with named_if_unreadable(path):
            image = self.loader(path)
        with augmentation_seed(self.seed, self.epoch, index):
            return self.transform(image), target


@contextlib.contextmanager
def named_if_unreadable(path: str) -> Iterator[None]:
    """An image PIL cannot read (or refuses: a decompression bomb) is one line naming it."""
    try:
        yield
    except Image.DecompressionBombError:
        raise BadSample(
            f"image {path} has more pixels than PIL's decompression-bomb limit ({Image.MAX_IMAGE_PIXELS}); "
            "delete it or replace it with a smaller copy"
        ) from None
    except (OSError, ValueError, SyntaxError) as error:  # PIL's UnidentifiedImageError is an OSError
        raise BadSample(f"cannot read image {path} ({type(error).__name__}); delete or replace it") from None


@contextlib.contextmanager
def augmentation_seed(seed: int, epoch: int, index: int) -> Iterator[None]:
    """Draw sample `index`'s random crop and flip from a seed of its own, so that the augmentation depends neither
    on which process or worker gets the sample nor on what it drew before: a run resumed mid-epoch, with any number
    of workers (or none), sees the same images.

    In a DataLoader worker the seed is the loader's base seed (one per epoch, from the (seed, epoch)-seeded loader
    generator) and the index. In the main process (-j 0) it is (seed, epoch, index), and the global RNG, which
    also drives dropout, is put back afterwards (a resume restores that RNG, but not the draws of the batches it
    skips). `default_generator.manual_seed` seeds only the CPU generator the transforms draw from:
    `torch.manual_seed` also seeds every device's generator, 60x slower per sample."""
    worker = torch.utils.data.get_worker_info()
    if worker is not None:
        torch.default_generator.manual_seed(((worker.seed - worker.id) * 1_000_003 + index) % 2**63)
        yield
        return
    state = torch.default_generator.get_state()
    torch.default_generator.manual_seed(((seed * 100_003 + epoch) * 1_000_003 + index) % 2**63)
    try:
        yield
    finally:
        torch.default_generator.set_state(state)


AUTO_AUGMENTS = ("none", "randaugment", "trivialaugment")


def image_transforms(
    image_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    augment: str,
    uint8: bool = False,
    auto_augment: str = "none",
    random_erasing: float = 0.0,
) -> tuple[transforms.Compose, transforms.Compose]:
    """imagenet: RandomResizedCrop + flip / Resize(size/0.875) + CenterCrop (pytorch/examples).
    cifar: pad-4 RandomCrop + flip / the image as is (for 32x32 images, where a 0.08-scale crop destroys them).
    auto_augment: RandAugment (2 ops, magnitude 9) or TrivialAugmentWide after the crop and flip; random_erasing:
    the probability of RandomErasing on the tensor (timm's recipe). Every draw comes from the sample's own seed
    (`augmentation_seed`), so these stay exact across a resume like the crop.
    uint8: the images stay bytes (4x less to collate, pin and copy); `DeviceNormalize` finishes the job."""
    normalize = [transforms.PILToTensor()] if uint8 else [transforms.ToTensor(), transforms.Normalize(mean, std)]
    policy = {"randaugment": [transforms.RandAugment()], "trivialaugment": [transforms.TrivialAugmentWide()]}
    erasing = [transforms.RandomErasing(p=random_erasing)] if random_erasing > 0 else []
    if augment == "cifar":
        train = [
            transforms.Resize(image_size),
            transforms.RandomCrop(image_size, padding=image_size // 8),
            transforms.RandomHorizontalFlip(),
        ]
        val = [transforms.Resize(image_size), transforms.CenterCrop(image_size)]
    else:
        train = [transforms.RandomResizedCrop(image_size), transforms.RandomHorizontalFlip()]
        val = [transforms.Resize(round(image_size / 0.875)), transforms.CenterCrop(image_size)]
    train += policy.get(auto_augment, [])
    return transforms.Compose(train + normalize + erasing), transforms.Compose(val + normalize)


def image_folders(
    data_dir: str, transform_pair: tuple[transforms.Compose, transforms.Compose], seed: int = 0
) -> tuple[Dataset, Dataset, list[str]]:
    """DATA_DIR's train/ and val/ folders under `transform_pair` (training, validation: what `image_transforms`
    returns), and the class names."""
    train_dir, val_dir = check_image_folder(data_dir)
    train_transform, val_transform = transform_pair
    train = CheckedImageFolder(train_dir, train_transform, seed=seed)
    val = CheckedImageFolder(val_dir, val_transform, class_to_idx=train.class_to_idx)
    return train, val, train.classes


class DeviceNormalize:
    """uint8 batches -> normalised float on the device the batch is on (GPU: one fused kernel instead of a CPU
    pass per image in the loader workers); float batches pass through. Optionally channels_last."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], channels_last: bool = False) -> None:
        self.mean = torch.tensor(mean).view(1, -1, 1, 1) * 255
        self.std = torch.tensor(std).view(1, -1, 1, 1) * 255
        self.channels_last = channels_last

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype == torch.uint8:
            return self.scaled(images.float())
        return images.contiguous(memory_format=torch.channels_last) if self.channels_last else images

    def scaled(self, pixels: torch.Tensor) -> torch.Tensor:
        """Float pixels in 0..255 (changed in place) -> normalised, on their device; channels_last if asked."""
        if self.mean.device != pixels.device:  # moved once, not per batch
            self.mean, self.std = self.mean.to(pixels.device), self.std.to(pixels.device)
        images = pixels.sub_(self.mean).div_(self.std)
        return images.contiguous(memory_format=torch.channels_last) if self.channels_last else images

    def inputs(self, batch: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(images, targets) of an (images, targets) batch, the images normalised."""
        return self(batch[0]), batch[1]


class SyntheticImages(Dataset):
    """`--dummy`: the same random image for every index (no decoding cost), labels cycling over the classes."""

    def __init__(self, size: int, image_size: int, num_classes: int, uint8: bool = False):
        self.size, self.num_classes = size, num_classes
        generator = torch.Generator().manual_seed(0)
        self.image = (
            torch.randint(0, 256, (3, image_size, image_size), dtype=torch.uint8, generator=generator)
            if uint8
            else torch.randn(3, image_size, image_size, generator=generator)
        )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.image, index % self.num_classes
