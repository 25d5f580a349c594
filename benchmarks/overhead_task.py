"""The benchmark task both loops train: an MLP classifier on fixed random data (compute-bound, no I/O)."""

import torch
from torch.utils.data import TensorDataset


def build_task(samples: int = 16384, features: int = 256, hidden: int = 512, classes: int = 10):
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(samples, features, generator=generator)
    labels = torch.randint(0, classes, (samples,), generator=generator)
    model = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes))

    def loss_fn(model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    return model, TensorDataset(inputs, labels), loss_fn
