"""Image classification: ImageFolder data and WebDataset tar shards, torchvision and CIFAR models, top-k metrics."""

from ddp_accel.vision.data import (
    AUTO_AUGMENTS,
    IMAGENET_MEAN,
    IMAGENET_STD,
    DeviceNormalize,
    SyntheticImages,
    image_folders,
    image_transforms,
    load_image,
)
from ddp_accel.vision.device_decode import DeviceDecode, collate_encoded, encoded_image_folders
from ddp_accel.vision.mixing import BatchMixing
from ddp_accel.vision.models import build_model, list_archs, with_group_norm
from ddp_accel.vision.shards import ShardedImages, is_sharded, sharded_data_identity, sharded_image_sets, write_shards

__all__ = [
    "AUTO_AUGMENTS",
    "BatchMixing",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "DeviceDecode",
    "DeviceNormalize",
    "ShardedImages",
    "SyntheticImages",
    "build_model",
    "with_group_norm",
    "collate_encoded",
    "encoded_image_folders",
    "image_folders",
    "image_transforms",
    "is_sharded",
    "list_archs",
    "load_image",
    "sharded_data_identity",
    "sharded_image_sets",
    "write_shards",
]
