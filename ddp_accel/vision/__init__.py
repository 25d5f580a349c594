"""Image classification: ImageFolder data, torchvision and CIFAR models, top-k metrics."""

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
from ddp_accel.vision.models import build_model, list_archs

__all__ = [
    "AUTO_AUGMENTS",
    "BatchMixing",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "DeviceDecode",
    "DeviceNormalize",
    "SyntheticImages",
    "build_model",
    "collate_encoded",
    "encoded_image_folders",
    "image_folders",
    "image_transforms",
    "list_archs",
    "load_image",
]
