"""Image classification from WebDataset tar shards read in place (ddp_accel.streaming): DATA_DIR/train/*.tar and
DATA_DIR/val/*.tar, each sample an image (.jpg, .jpeg, .png or .webp) and its class index (.cls). `write_shards`
writes them from an ImageFolder (`ddp-accel shard`)."""

from __future__ import annotations

import dataclasses
import io
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from ddp_accel.bad_samples import BadSample
from ddp_accel.errors import UserError
from ddp_accel.identity import shards_identity
from ddp_accel.streaming import SHARD_SUFFIX, WINDOW, ShardManifest, ShardReader, WindowShuffle
from ddp_accel.vision.data import augmentation_seed, check_image_folder, load_image, named_if_unreadable, walk_images

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")


def is_sharded(data_dir: str | Path) -> bool:
    """DATA_DIR holds train/*.tar and val/*.tar."""
    root = Path(data_dir)
    return all(any((root / split).glob(f"*{SHARD_SUFFIX}")) for split in ("train", "val"))


class ShardedImages(Dataset):
    """The samples of one split's shards by global index: (transformed image, class index)."""

    def __init__(self, folder: Path, transform: Callable[[Any], torch.Tensor], seed: int = 0):
        self.manifest = ShardManifest.of(folder)
        self.reader = ShardReader(self.manifest)
        self.transform, self.seed, self.epoch = transform, seed, 0

    def __len__(self) -> int:
        return len(self.manifest)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def sampler(self, shuffle: bool, window: int = WINDOW) -> WindowShuffle:
        """The canonical order of its samples (streaming.WindowShuffle), from this dataset's seed."""
        return WindowShuffle(self.manifest.counts, self.seed, window, shuffle)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, key, files = self.reader.read(index)
        image = next((files[extension] for extension in IMAGE_EXTENSIONS if extension in files), None)
        if image is None:
            raise BadSample(f"shard {path}: sample {key} has no image ({', '.join(IMAGE_EXTENSIONS)})")
        if "cls" not in files:
            raise BadSample(f"shard {path}: sample {key} has no label (.cls)")
        try:
            target = int(files["cls"].decode().strip())
        except ValueError:
            raise BadSample(
                f"shard {path}: sample {key}'s label is not a class index ({files['cls'][:20]!r})"
            ) from None
        with named_if_unreadable(f"{key} in shard {path}"):
            picture = load_image(io.BytesIO(image))
        with augmentation_seed(self.seed, self.epoch, index):
            return self.transform(picture), target


def sharded_image_sets(
    data_dir: str, transform_pair: tuple[Callable, Callable], seed: int = 0
) -> tuple[ShardedImages, ShardedImages, list[str]]:
    """DATA_DIR's train/ and val/ shards under `transform_pair` (training, validation), and the class names
    (the manifest's, else the class indices)."""
    root = Path(data_dir)
    train = ShardedImages(root / "train", transform_pair[0], seed)
    val = ShardedImages(root / "val", transform_pair[1], seed)
    classes = list(train.manifest.classes)
    if not classes:
        raise UserError(
            f"{root / 'train'} has no manifest.json naming its classes; write the shards with ddp-accel shard"
        )
    return train, val, classes


def sharded_data_identity(train: ShardedImages, val: ShardedImages) -> dict:
    """The train/ and val/ shards by their manifests (a run's identity: a resume names the changed shards)."""
    return shards_identity({**train.manifest.identity("train/"), **val.manifest.identity("val/")})


def write_shards(source: str | Path, output: str | Path, samples_per_shard: int = 1000, seed: int = 0) -> list[Path]:
    """An ImageFolder's train/ and val/ as WebDataset tar shards under `output` (train/000000.tar, ...), each with
    its manifest.json; the images' bytes as they are (no re-encoding). The training images in a random order drawn
    from `seed` (an ImageFolder lists them class by class, and a run shuffles within a window of neighbours), the
    validation images as listed. Returns the manifests written."""
    train_dir, val_dir = check_image_folder(source)
    classes = sorted(entry.name for entry in train_dir.iterdir() if entry.is_dir())
    index = {name: number for number, name in enumerate(classes)}
    written = []
    for split, folder in (("train", train_dir), ("val", val_dir)):
        present = [name for name in classes if (folder / name).is_dir()]
        images = [(path, index[name]) for name in present for path in walk_images(folder / name)]
        if split == "train":
            images = [images[i] for i in np.random.default_rng(seed).permutation(len(images))]
        written.append(write_split(images, Path(output) / split, samples_per_shard, classes))
    return written


def write_split(images: Sequence[tuple[Path, int]], out: Path, samples_per_shard: int, classes: list[str]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    names = []
    with tqdm(total=len(images), desc=f"shards of {out.name}", unit="image") as progress:
        for first in range(0, len(images), samples_per_shard):
            name = f"{first // samples_per_shard:06d}{SHARD_SUFFIX}"
            with tarfile.open(out / name, "w") as archive:
                for number, (path, label) in enumerate(images[first : first + samples_per_shard], start=first):
                    extension = path.suffix.lower().lstrip(".")
                    archive.add(path, arcname=f"{number:09d}.{extension}")
                    add_bytes(archive, f"{number:09d}.cls", str(label).encode())
                    progress.update()
            names.append(name)
    manifest = ShardManifest.scanned(out, names)
    return dataclasses.replace(manifest, classes=tuple(classes)).write()


def add_bytes(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))
