"""The benchmark tasks both loops train, on fixed random data (compute-bound, no I/O).

mlp: an MLP classifier (`hidden` wide); resnet20: the CIFAR ResNet-20 of scripts/imagenet.py on 32x32 images.
"""

import torch
from torch.utils.data import TensorDataset


def build_task(task: str = "mlp", hidden: int = 512, classes: int = 10):
    generator = torch.Generator().manual_seed(0)
    if task == "resnet20":
        from ddp_accel.vision.models import CifarResNet

        inputs = torch.randn(4096, 3, 32, 32, generator=generator)
        model = CifarResNet(depth=20, num_classes=classes)
    else:
        inputs = torch.randn(16384, 256, generator=generator)
        model = torch.nn.Sequential(
            torch.nn.Linear(256, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, classes),
        )
    labels = torch.randint(0, classes, (len(inputs),), generator=generator)

    def loss_fn(model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    return model, TensorDataset(inputs, labels), loss_fn
