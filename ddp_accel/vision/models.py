"""Image classifiers: every torchvision classification model, plus small CIFAR ResNets, and their weights."""

from __future__ import annotations

import difflib
from pathlib import Path

import torch
import torchvision
from torch import nn

from ddp_accel.errors import UserError
from ddp_accel.plain_ddp import load_weights, strip_module_prefix


def _conv_bn_relu(in_channels: int, channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, channels, 3, 1, 1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(inplace=True)
    )


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class CifarResNet(nn.Module):
    """He et al. 2016's CIFAR ResNet (3 stages of 3x3 convolutions, no stem downsampling): depth = 6n + 2.

    ImageNet ResNets downsample 4x in their stem, which leaves a 32x32 image 8x8 before the first block.
    """

    def __init__(self, depth: int = 20, width: int = 16, num_classes: int = 10):
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError("CIFAR ResNet depth is 6n + 2 (20, 32, 44, 56, 110)")
        blocks = (depth - 2) // 6
        self.stem = _conv_bn_relu(3, width)
        layers, in_channels = [], width
        for stage, channels in enumerate((width, width * 2, width * 4)):
            for block in range(blocks):
                layers.append(BasicBlock(in_channels, channels, 2 if stage > 0 and block == 0 else 1))
                in_channels = channels
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(in_channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


class _Residual(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.body = nn.Sequential(_conv_bn_relu(channels, channels), _conv_bn_relu(channels, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class _Scale(nn.Module):
    """Page's 0.125 on the logits: max-pooled features are large, and unscaled logits saturate the softmax early."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class CifarResNet9(nn.Sequential):
    """David Page's DAWNBench ResNet-9 (widths w, 2w, 4w, 8w; w=64 in the original).

    Few layers, wide, downsampled early: more capacity per second on a CPU than ResNet-20, whose 16-channel
    convolutions at 32x32 keep the matrix units idle (benchmarks in the README).
    """

    def __init__(self, width: int = 64, num_classes: int = 10):
        w = width
        super().__init__(
            _conv_bn_relu(3, w),
            _conv_bn_relu(w, 2 * w),
            nn.MaxPool2d(2),
            _Residual(2 * w),
            _conv_bn_relu(2 * w, 4 * w),
            nn.MaxPool2d(2),
            _conv_bn_relu(4 * w, 8 * w),
            nn.MaxPool2d(2),
            _Residual(8 * w),
            nn.AdaptiveMaxPool2d(1),
            nn.Flatten(),
            nn.Linear(8 * w, num_classes),
            _Scale(0.125),
        )


CIFAR_ARCHS = {
    "cifar_resnet20": (CifarResNet, dict(depth=20)),
    "cifar_resnet32": (CifarResNet, dict(depth=32)),
    "cifar_resnet56": (CifarResNet, dict(depth=56)),
    "cifar_resnet20_w32": (CifarResNet, dict(depth=20, width=32)),
    "cifar_resnet9": (CifarResNet9, dict(width=64)),
    "cifar_resnet9_w16": (CifarResNet9, dict(width=16)),
    "cifar_resnet9_w24": (CifarResNet9, dict(width=24)),
    "cifar_resnet9_w32": (CifarResNet9, dict(width=32)),
}


def list_archs() -> list[str]:
    return sorted(torchvision.models.list_models(module=torchvision.models)) + sorted(CIFAR_ARCHS)


def build_model(arch: str, num_classes: int, pretrained: str | None = None) -> nn.Module:
    """`pretrained`: None, "default" (torchvision's weights, from its cache or downloaded) or a file path."""
    if arch not in list_archs():
        close = difflib.get_close_matches(arch, list_archs(), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UserError(f"unknown --arch {arch!r}{hint} (python scripts/imagenet.py --list-archs lists all)")
    if arch in CIFAR_ARCHS:
        cls, kwargs = CIFAR_ARCHS[arch]
        model = cls(num_classes=num_classes, **kwargs)
        if pretrained:
            _load_into(model, _load_state_dict_file(pretrained, arch), pretrained, arch)
        return model
    if not pretrained:
        return torchvision.models.get_model(arch, num_classes=num_classes)
    model = torchvision.models.get_model(arch)
    if pretrained == "default":
        model.load_state_dict(_torchvision_weights(arch))
    else:
        _load_into(model, _load_state_dict_file(pretrained, arch), pretrained, arch)
    if num_classes != _output_features(model):
        _replace_head(model, num_classes)
    return model


def with_group_norm(model: nn.Module) -> tuple[nn.Module, int]:
    """Every BatchNorm2d of `model` as a GroupNorm of the same channels (32 groups, or the most that divide them),
    its affine weights kept: statistics of each sample alone, the same at any batch and number of processes (what
    `--exact-micro-batch` needs). Returns the model and how many layers changed."""
    changed = 0
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.BatchNorm2d):
                groups = next(g for g in range(min(32, child.num_features), 0, -1) if child.num_features % g == 0)
                norm = nn.GroupNorm(groups, child.num_features, eps=child.eps, affine=child.affine)
                if child.affine:
                    with torch.no_grad():
                        norm.weight.copy_(child.weight)
                        norm.bias.copy_(child.bias)
                setattr(parent, name, norm)
                changed += 1
    return model, changed


def _torchvision_weights(arch: str) -> dict:
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name
    try:
        return weights.get_state_dict(progress=False, check_hash=False)
    except Exception as error:  # offline, proxy, partial download
        raise UserError(
            f"cannot get the pretrained weights of {arch} ({type(error).__name__}: {error}). On a machine "
            f"with internet: curl -L -o {cached} {weights.url} (or pass --pretrained PATH)"
        ) from None


def _load_state_dict_file(path: str, arch: str) -> dict:
    """A state dict from a .safetensors or torch file; a checkpoint dict holding one (`state_dict`,
    `model_state_dict`, `model`) is unwrapped. Anything else is one line."""
    if not Path(path).is_file():
        raise UserError(f"--pretrained {path}: no such file (a state dict of {arch}, .pth or .safetensors)")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            loaded: object = load_file(path)
        else:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated, not a torch file, or pickled objects weights_only refuses
        first = str(error).strip().splitlines()[0][:150] if str(error).strip() else ""
        raise UserError(f"--pretrained {path}: cannot be read as weights ({type(error).__name__}: {first})") from None
    if isinstance(loaded, dict):
        for key in ("state_dict", "model_state_dict", "model"):
            if isinstance(loaded.get(key), dict):
                loaded = loaded[key]
                break
    if not isinstance(loaded, dict) or not all(isinstance(value, torch.Tensor) for value in loaded.values()):
        raise UserError(
            f"--pretrained {path}: not a state dict (a mapping of names to tensors); found {type(loaded).__name__}"
        )
    return loaded


def _load_into(model: nn.Module, weights: dict, path: str, arch: str) -> None:
    load_weights(model, strip_module_prefix(weights), f"--pretrained {path}", f"-a {arch}")


def _last_linear(model: nn.Module) -> tuple[nn.Module, str, nn.Linear]:
    """The classifier head: the last Linear layer registered, as (its parent, its name, the layer)."""
    found = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    if not found:
        raise UserError("this architecture has no Linear head to replace; train it without --pretrained")
    return found[-1]


def _output_features(model: nn.Module) -> int:
    return _last_linear(model)[2].out_features


def _replace_head(model: nn.Module, num_classes: int) -> None:
    parent, name, head = _last_linear(model)
    setattr(parent, name, nn.Linear(head.in_features, num_classes))
