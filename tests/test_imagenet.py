"""scripts/imagenet.py: 2-process training on a generated ImageFolder, exact eval, top-k, best model, bad input."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_clean_error, check_ok, launch, load_script, metrics_of, run_script
from PIL import Image
from safetensors.torch import load_file

from ddp_accel.errors import UserError
from ddp_accel.metrics import classification_metrics, classification_values
from ddp_accel.runtime import cpu_has_fast_bf16
from ddp_accel.vision import BatchMixing
from ddp_accel.vision.models import build_model

# the small tests' model: Page's ResNet-9 at width 16 (8 convolutions; about half the step time of a ResNet-20's 19)
SMALL_ARCH = "cifar_resnet9_w16"
SMALL = ["-a", SMALL_ARCH, "--image-size", "16", "--augment", "cifar", "-j", "0", "-b", "4", "--lr", "0.05"]
EVALUATE = SMALL[:-2]  # -e refuses the options of training (--lr)


def make_image_folder(root: Path, classes: int = 6, train: int = 8, val: int = 3) -> Path:
    """Class c's images are noise around a brightness of its own: learnable in a few steps."""
    rng = np.random.default_rng(0)
    for split, count in (("train", train), ("val", val)):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                Image.fromarray((rng.random((16, 16, 3)) * 60 + c * 35).astype("uint8")).save(folder / f"{i}.jpg")
    return root


@pytest.mark.multiprocess
def test_two_processes_train_count_every_val_image_once_and_evaluate_reproduces_the_best(tmp_path):
    data = make_image_folder(tmp_path / "images", val=3)  # 18 val images: 2 ranks x batch 4 do not divide them
    out = tmp_path / "out"
    output = check_ok(
        launch(
            "scripts/imagenet.py",
            data,
            *SMALL,
            "--epochs",
            "2",
            "--checkpointing-steps",
            "epoch",
            "--lr-schedule",
            "cosine",
            "--warmup-epochs",
            "0.5",
            "--label-smoothing",
            "0.1",
            "--sync-bn",
            "--output-dir",
            out,
            env={"DDP_ACCEL_CURVES": "1"},
        )
    )
    assert re.search(r"sync_bn_layers\s+8\b", output)  # ResNet-9: one after each of its 8 convolutions
    metrics = metrics_of(out)
    assert metrics["world_size"] == 2 and metrics["eval_samples"] == 18
    assert set(metrics["eval_per_class_top1"]) == {f"class{c}" for c in range(6)}
    assert 0 <= metrics["eval_top1"] <= metrics["eval_top5"] <= 1
    history = json.loads((out / "history.json").read_text())
    assert [round(record["epoch"]) for record in history] == [1, 2]
    assert metrics["best_top1"] == max(record["eval_top1"] for record in history)
    for name in ("model_best.safetensors", "model.safetensors", "training_curves.png"):
        assert (out / name).is_file(), name

    best = check_ok(
        launch(
            "scripts/imagenet.py",
            data,
            *EVALUATE,
            "-e",
            "--resume",
            out / "model_best.safetensors",
            "--output-dir",
            out,
        )
    )
    evaluated = json.loads((out / "evaluate.json").read_text())
    assert evaluated["eval_top1"] == pytest.approx(metrics["best_top1"], abs=1e-6)
    assert evaluated["weights"] == str(out / "model_best.safetensors") and evaluated["tta_flip"] is False
    assert "on 18 images" in best
    latest = check_ok(
        run_script("scripts/imagenet.py", data, *EVALUATE, "-e", "--resume", "latest", "--output-dir", out)
    )
    evaluated = json.loads((out / "evaluate.json").read_text())
    assert evaluated["eval_top1"] == pytest.approx(metrics["eval_top1"], abs=1e-6)
    newest = max(int(path.name.split("_")[1]) for path in (out / "checkpoints").glob("step_*"))
    # which checkpoint `latest` was, in the line and in evaluate.json
    assert (evaluated["asked"], evaluated["step"]) == ("latest", newest), evaluated
    assert evaluated["weights"] == str(out / "checkpoints" / f"step_{newest}")
    assert f"the weights of {out / 'checkpoints' / f'step_{newest}'} (step {newest})" in latest, latest[-2000:]
    # the weights under other evaluation options than they were trained with: one line, no evaluate.json written
    (out / "evaluate.json").unlink()
    for weights in (out / "model_best.safetensors", "latest"):
        other = [
            *EVALUATE,
            "--image-size",
            "24",
            "--std",
            "1",
            "1",
            "1",
            "-e",
            "--resume",
            weights,
            "--output-dir",
            out,
        ]
        refused = assert_clean_error(run_script("scripts/imagenet.py", data, *other), "--image-size was 16, now 24")
        assert "--std was [0.229, 0.224, 0.225], now [1.0, 1.0, 1.0]" in refused
        assert not (out / "evaluate.json").exists()
    # fine-tuning the run's weights under another normalisation: one line (another image size is a choice)
    for option in ("--resume", "--pretrained"):
        tune = [*SMALL, "--mean", "0", "0", "0", option, out / "model.safetensors", "--output-dir", tmp_path / "tune"]
        refused = assert_clean_error(run_script("scripts/imagenet.py", data, *tune), "--mean was [0.485, 0.456, 0.406]")
        assert f"Give {option} {out / 'model.safetensors'} the --mean and --std it was trained with" in refused
    tuned = [*SMALL, "--image-size", "24", "--max-steps", "1", "--pretrained", out / "model.safetensors"]
    check_ok(run_script("scripts/imagenet.py", data, *tuned, "--output-dir", tmp_path / "tune"))


@pytest.mark.inprocess
def test_top1_top5_and_per_class_match_a_hand_computed_case():
    logits = torch.tensor(
        [
            [0.0, 1, 2, 3, 4, 5],  # target 5: top-1 hit
            [5.0, 4, 3, 2, 1, 0],  # target 4: 5th best -> top-5 hit only
            [5.0, 4, 3, 2, 1, 0],
        ]
    )  # target 5: worst -> neither
    targets = torch.tensor([5, 4, 5])
    values = classification_values(logits, targets, topk=(1, 5), per_class=True)
    assert values["top1"].tolist() == [1, 0, 0] and values["top5"].tolist() == [1, 1, 0]
    metrics = classification_metrics(values, [f"c{i}" for i in range(6)])
    assert metrics["top1"] == pytest.approx(1 / 3) and metrics["top5"] == pytest.approx(2 / 3)
    assert metrics["per_class_top1"] == {"c4": 0.0, "c5": 0.5}
    assert metrics["loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, targets).item())
    assert "top5" not in classification_values(logits[:, :3], torch.tensor([0, 1, 2]), topk=(1, 5))
    # the text and template jobs: top-1 is called accuracy
    plain = classification_values(logits, targets)
    assert set(plain) == {"loss", "accuracy"} and plain["accuracy"].tolist() == [1, 0, 0]


@pytest.mark.inprocess
def test_dummy_data_and_torchvision_arch_run(tmp_path):
    out = check_ok(
        run_script(
            "scripts/imagenet.py",
            "--dummy",
            "-a",
            "mobilenet_v3_small",
            "--image-size",
            "32",
            "--dummy-classes",
            "10",
            "-b",
            "4",
            "-j",
            "0",
            "--max-steps",
            "6",
            "-p",
            "2",
            "--channels-last",
            "--output-dir",
            tmp_path,
        )
    )
    assert "SYNTHETIC" in out
    metrics = metrics_of(tmp_path)
    assert metrics["steps"] == 6 and metrics["train_samples"] == 24
    assert metrics["steady_samples_per_s"] > 0 and metrics["train_samples_per_s"] > 0  # steady: steps 3-6 only


@pytest.mark.inprocess
def test_dummy_images_fix_the_synthetic_set_whatever_the_batch_and_a_resume_that_changes_it_is_refused():
    from ddp_accel.identity import compare_identity

    imagenet = load_script("scripts/imagenet.py")
    common = ["--dummy", "--dummy-classes", "4", "--image-size", "16"]

    def synthetic(*options):
        args = imagenet.parse_args([*common, *options])
        train, val, _ = imagenet.datasets_for(args)
        return (len(train), len(val)), imagenet.identity_of(args, None)

    # survivors of --recover in-process take a larger -b: with --dummy-images they read the same images
    sizes, saved = synthetic("-b", "32", "--dummy-images", "3200")
    assert sizes == synthetic("-b", "48", "--dummy-images", "3200")[0] == (3200, 320)
    assert compare_identity(saved, synthetic("-b", "48", "--dummy-images", "3200")[1], "the checkpoint") is None
    # the default follows -b: a resume at another -b would read another set, and is refused in one line
    default_sizes, default_identity = synthetic("-b", "8")
    assert default_sizes == (800, 80)
    with pytest.raises(UserError, match="--dummy-images was 800, now 1600"):
        compare_identity(default_identity, synthetic("-b", "16")[1], "the checkpoint")


@pytest.mark.inprocess
@pytest.mark.parametrize(("option", "nhwc"), [([], True), (["--no-channels-last"], False)])
def test_on_the_cpu_the_model_runs_in_nhwc_unless_told_not_to(tmp_path, option, nhwc):
    # oneDNN's convolutions are faster in NHWC on the CPU (docs/benchmarks.md): the default there
    args = ["--dummy", "-a", "cifar_resnet20", "--image-size", "32", "--dummy-classes", "4", "-b", "4", "-j", "0"]
    out = check_ok(run_script("scripts/imagenet.py", *args, "--max-steps", "1", *option, "--output-dir", tmp_path))
    assert re.search(rf"channels_last\s+{nhwc}\n", out), out


@pytest.mark.inprocess
def test_bad_input_gives_one_clear_line(tmp_path):
    data = make_image_folder(tmp_path / "images", classes=3, train=2, val=1)

    def run(*args):
        return run_script("scripts/imagenet.py", *args, "-j", "0", "--output-dir", tmp_path / "out")

    assert "did you mean resnet18" in assert_clean_error(run(data, "-a", "resnet19"))
    assert "no complete checkpoint" in assert_clean_error(run(data, "-e", "--resume", "latest"))
    (tmp_path / "no_val" / "train" / "a").mkdir(parents=True)
    assert "no val/ folder" in assert_clean_error(run(tmp_path / "no_val"))
    (data / "train" / "empty").mkdir()
    assert "train/empty has no images" in assert_clean_error(run(data))
    (data / "train" / "empty").rmdir()
    (data / "train" / "class0" / "0.jpg").write_bytes(b"not a jpeg")
    assert "0.jpg" in assert_clean_error(run(data, *SMALL, "--epochs", "1"), "cannot read image")


@pytest.mark.inprocess
def test_pretrained_offline_says_how_to_get_the_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # an empty cache
    import torchvision

    def offline(*args, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(torchvision.models.WeightsEnum, "get_state_dict", offline)
    from ddp_accel.errors import UserError

    with pytest.raises(UserError, match="curl -L -o .*resnet18"):
        build_model("resnet18", 10, pretrained="default")
    torch.save(build_model("resnet18", 1000).state_dict(), tmp_path / "r18.pth")
    model = build_model("resnet18", 7, pretrained=str(tmp_path / "r18.pth"))  # fine-tuning head replaced
    assert model.fc.out_features == 7


@pytest.mark.parametrize("arch", ["cifar_resnet20", "cifar_resnet9_w16"])
@pytest.mark.inprocess
def test_cifar_archs_classify_32x32_images_and_learn(arch):
    torch.manual_seed(0)
    model = build_model(arch, 7)
    images, targets = torch.randn(8, 3, 32, 32), torch.arange(8) % 7
    assert model(images).shape == (8, 7)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(15):  # one fixed batch: the loss must fall if gradients reach every layer
        loss = torch.nn.functional.cross_entropy(model(images), targets)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < 0.5 * losses[0]
    assert all(parameter.grad is not None for parameter in model.parameters())


SHARED_CIFAR = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10_mini.tar.gz"


@pytest.mark.skipif(not SHARED_CIFAR.is_file(), reason="../shared/data/cifar10_mini.tar.gz not present")
@pytest.mark.system
def test_two_processes_learn_real_cifar10_mini(tmp_path):
    import tarfile

    with tarfile.open(SHARED_CIFAR) as archive:
        # filter= exists from Python 3.11.4 (and 3.10.12); Debian 12's 3.11.2 lacks it
        archive.extractall(tmp_path, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    data = next(path.parent for path in tmp_path.rglob("train") if (path.parent / "val").is_dir())
    out = tmp_path / "out"
    check_ok(
        launch(
            "scripts/imagenet.py",
            data,
            "-a",
            "cifar_resnet9_w16",
            "--image-size",
            "32",
            "--augment",
            "cifar",
            "--mean",
            0.4914,
            0.4822,
            0.4465,
            "--std",
            0.247,
            0.243,
            0.261,
            "-j",
            "1",
            "-b",
            "64",
            "--lr",
            "0.1",
            "--wd",
            "5e-4",
            "--lr-schedule",
            "cosine",
            "--warmup-epochs",
            "0.5",
            "--label-smoothing",
            "0.1",
            "--epochs",
            "2",
            "--channels-last",
            *(["--mixed-precision", "bf16"] if cpu_has_fast_bf16() else []),
            "--output-dir",
            out,
            timeout=900,
        )
    )
    metrics = metrics_of(out)
    assert metrics["world_size"] == 2 and metrics["eval_samples"] == 2000
    assert len(metrics["eval_per_class_top1"]) == 10
    assert metrics["best_top1"] > 0.4, metrics  # chance is 0.1; 48.8% measured (2 epochs: 38% after the first)


RECIPES = {
    "workers-1-then-2": ["--auto-augment", "trivialaugment", "--random-erasing", "0.5", "--mixup-alpha", "0.4"],
    "main-process": ["--auto-augment", "randaugment", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0"],
    # the JPEGs decoded, cropped and flipped where the model runs (its boxes: the PIL path's, tested below)
    "decode-on-device": ["--augment", "imagenet", "--decode-on", "device", "--mixup-alpha", "0.2"],
}


@pytest.mark.parametrize(
    "workers", [("1", "2"), ("0", "0"), ("0", "0")], ids=["workers-1-then-2", "main-process", "decode-on-device"]
)
@pytest.mark.inprocess
def test_resume_mid_epoch_with_augmentation_is_exact_with_another_worker_count(tmp_path, workers, request):
    # random crops and flips, RandAugment / TrivialAugment and random erasing: each sample's augmentation has a seed
    # of its own (in workers the epoch's loader seed and its index; with -j 0 the run's seed, the epoch and the
    # index), so neither the worker that gets it, nor a restart, nor the batches a resume skips without loading
    # them change it; mixup / cutmix: each batch's draws from the run's seed and its position in training
    data = make_image_folder(tmp_path / "images", classes=3, train=8, val=2)  # 24 images: 6 steps an epoch
    args = [
        data,
        "-a",
        SMALL_ARCH,
        "--image-size",
        "16",
        "--augment",
        "cifar",
        "-b",
        "4",
        "--lr",
        "0.05",
        "--epochs",
        "3",
        "--checkpointing-steps",
        "4",
        *RECIPES[request.node.callspec.id],
    ]
    check_ok(run_script("scripts/imagenet.py", *args, "-j", workers[0], "--output-dir", tmp_path / "full"))
    import shutil

    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_8", tmp_path / "cut" / "checkpoints" / "step_8")
    shutil.copy(tmp_path / "full" / "history.json", tmp_path / "cut" / "history.json")
    output = check_ok(
        run_script(
            "scripts/imagenet.py",
            *args,
            "-j",
            workers[1],
            "--output-dir",
            tmp_path / "cut",
            "--resume",
            "latest",
        )
    )
    assert "step 8, epoch 1, skipping 2 batches" in output
    full, cut = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("full", "cut"))
    assert all(torch.equal(full[key], cut[key]) for key in full)
    steps = [record["step"] for record in json.loads((tmp_path / "cut" / "history.json").read_text())]
    assert steps == [6, 12, 18], steps  # each evaluation recorded once


@pytest.mark.parametrize("checkpointing", ["6", "epoch"])
@pytest.mark.inprocess
def test_resume_right_after_an_evaluation_does_not_evaluate_again_and_keeps_the_best(tmp_path, checkpointing):
    data = make_image_folder(tmp_path / "images", classes=3, train=8, val=2)
    args = [data, *SMALL, "--epochs", "2", "--checkpointing-steps", checkpointing]  # step 6 ends epoch 1
    check_ok(run_script("scripts/imagenet.py", *args, "--output-dir", tmp_path / "full"))
    import shutil

    history = json.loads((tmp_path / "full" / "history.json").read_text())
    saved = json.loads((tmp_path / "full" / "checkpoints" / "step_6" / "training_state.json").read_text())
    if checkpointing == "epoch":  # written after the epoch's evaluation: it carries it and the best metric
        assert saved["last_eval_step"] == 6 and saved["best_metric"] == history[0]["eval_top1"], saved
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_6", tmp_path / "cut" / "checkpoints" / "step_6")
    shutil.copy(tmp_path / "full" / "history.json", tmp_path / "cut" / "history.json")
    output = check_ok(run_script("scripts/imagenet.py", *args, "--output-dir", tmp_path / "cut", "--resume", "latest"))
    assert "step 6: eval_loss" not in output
    assert [r["step"] for r in json.loads((tmp_path / "cut" / "history.json").read_text())] == [6, 12]
    assert metrics_of(tmp_path / "cut")["best_top1"] == metrics_of(tmp_path / "full")["best_top1"]


@pytest.mark.inprocess
def test_uint8_batches_normalised_on_the_device_equal_the_loader_path():
    from ddp_accel.vision.data import DeviceNormalize, image_transforms

    image = Image.fromarray((np.random.default_rng(0).random((40, 48, 3)) * 255).astype("uint8"))
    mean, std = (0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261)
    _, float_val = image_transforms(32, mean, std, "imagenet", uint8=False)
    _, uint8_val = image_transforms(32, mean, std, "imagenet", uint8=True)
    raw = uint8_val(image)
    assert raw.dtype == torch.uint8  # 4x fewer bytes through the loader
    normalised = DeviceNormalize(mean, std, channels_last=True)(raw[None])
    torch.testing.assert_close(normalised, float_val(image)[None], atol=1e-5, rtol=0)
    assert normalised.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.inprocess
def test_an_output_dir_inside_the_data_and_a_copy_of_the_data_resume(tmp_path):
    # the fingerprint was by mtimes over everything under DATA_DIR: the run's own checkpoints changed it, and a copy
    # of the same images (a requeued job staging them again) was other data
    import shutil

    data = make_image_folder(tmp_path / "images", classes=3, train=8, val=2)
    inside = data / "runs" / "one"
    check_ok(
        run_script(
            "scripts/imagenet.py", data, *SMALL, "--epochs", "1", "--checkpointing-steps", "3", "--output-dir", inside
        )
    )
    (inside / "model.safetensors").unlink()
    (inside / "metrics.json").unlink()
    copy = shutil.copytree(data, tmp_path / "scratch" / "images", ignore=shutil.ignore_patterns("runs"))
    output = check_ok(
        run_script("scripts/imagenet.py", copy, *SMALL, "--epochs", "2", "--output-dir", inside, "--resume", "latest")
    )
    assert "resumed from" in output and metrics_of(inside)["steps"] == 12, output[-2000:]


NO_CXX = "inductor needs a C++ compiler (apt-get install g++); the eager backend is tested in test_training.py"


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason=NO_CXX)
@pytest.mark.system
def test_compiled_with_inductor_the_weights_load_into_the_bare_model_and_evaluate(tmp_path):
    # torch.compile's wrapper wrote every key starting with `_orig_mod.`; `-e --resume` refused them
    out = tmp_path / "compiled"
    dummy = ["--dummy", "--dummy-classes", "10", *SMALL]
    check_ok(run_script("scripts/imagenet.py", *dummy, "--compile", "--max-steps", "2", "--output-dir", out))
    from ddp_accel.vision import build_model

    weights = load_file(str(out / "model.safetensors"))
    build_model(SMALL_ARCH, 10).load_state_dict(weights)  # the bare nn.Module, strict
    evaluate = ["--dummy", "--dummy-classes", "10", *EVALUATE, "--compile"]  # -e refuses training's options (--lr)
    for name in ("model.safetensors", "model_best.safetensors"):
        check_ok(run_script("scripts/imagenet.py", *evaluate, "-e", "--resume", out / name, "--output-dir", out))
    assert json.loads((out / "evaluate.json").read_text())["eval_samples"] > 0


@pytest.mark.inprocess
def test_each_batch_is_mixed_from_its_position_in_training_not_from_the_global_generator():
    mixing = BatchMixing(num_classes=5, seed=3, mixup_alpha=0.4, cutmix_alpha=1.0)
    images, targets = torch.rand(6, 3, 8, 8), torch.tensor([0, 1, 2, 3, 4, 0])

    def mixed_at(step: int, micro_batch: int, global_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(global_seed)  # whatever the process drew before (dropout, another rank's history)
        mixing.step, mixing.micro_batch = step, micro_batch
        before = torch.random.get_rng_state()
        result = mixing(images, targets)
        assert torch.equal(torch.random.get_rng_state(), before), "the global generator is put back"
        return result

    first, again = mixed_at(7, 1, global_seed=0), mixed_at(7, 1, global_seed=123)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert torch.allclose(first[1].sum(1), torch.ones(6)) and not torch.equal(first[0], images)
    others = [mixed_at(step, micro, 0)[1] for step, micro in ((7, 0), (8, 1), (9, 0))]
    assert not all(torch.equal(first[1], other) for other in others), "each position draws anew"
    unmixed = BatchMixing(num_classes=5, seed=3, mixup_alpha=0.4, probability=0.0)(images, targets)
    assert torch.equal(unmixed[0], images) and torch.equal(unmixed[1].argmax(1), targets)


@pytest.mark.inprocess
def test_tta_flip_scores_the_mean_of_an_image_and_its_mirror_image_and_runs_with_evaluate(tmp_path):
    from ddp_accel.vision.data import DeviceNormalize

    imagenet = load_script("scripts/imagenet.py")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 7))  # not mirror-symmetric
    images, targets = torch.rand(5, 3, 4, 4), torch.tensor([0, 1, 2, 3, 4])
    plain = imagenet.make_eval_fn(DeviceNormalize([0.0] * 3, [1.0] * 3))(model, (images, targets))
    tta = imagenet.make_eval_fn(DeviceNormalize([0.0] * 3, [1.0] * 3), tta_flip=True)(model, (images, targets))
    expected = torch.nn.functional.cross_entropy((model(images) + model(images.flip(3))) / 2, targets, reduction="none")
    assert torch.allclose(tta["loss"], expected) and not torch.allclose(tta["loss"], plain["loss"])
    out = tmp_path / "out"
    dummy = ["--dummy", "--dummy-classes", 4, "-a", SMALL_ARCH, "--image-size", 16, "-b", 8, "-j", 0]
    check_ok(run_script("scripts/imagenet.py", *dummy, "--max-steps", 1, "--output-dir", out))
    weights = out / "model.safetensors"
    check_ok(run_script("scripts/imagenet.py", *dummy, "--tta-flip", "-e", "--resume", weights, "--output-dir", out))
    assert (out / "evaluate.json").is_file()


def make_mixed_folder(root: Path) -> Path:
    """JPEGs of ImageNet's shapes (landscape, portrait), a grey and a CMYK JPEG, and a PNG, in each split."""
    rng = np.random.default_rng(1)
    for split in ("train", "val"):
        for c in ("a", "b"):
            folder = root / split / c
            folder.mkdir(parents=True, exist_ok=True)
            for name, (height, width), mode in (
                ("wide.jpg", (75, 100), "RGB"),
                ("tall.jpg", (90, 60), "RGB"),
                ("grey.jpg", (60, 80), "L"),
                ("cmyk.jpg", (50, 70), "CMYK"),
                ("lossless.png", (40, 52), "RGB"),
            ):
                coarse = Image.fromarray((rng.random((height // 10 + 2, width // 10 + 2, 3)) * 255).astype("uint8"))
                image = coarse.resize((width, height), Image.BICUBIC).convert(mode)
                image.save(folder / name, **({"quality": 90} if name.endswith(".jpg") else {}))
    return root


@pytest.mark.inprocess
def test_jpegs_decoded_on_the_device_are_the_pil_paths_images_within_a_level_of_255(tmp_path):
    # the same crop boxes and flips from the same per-sample seeds, the same resize and centre crop: a run can move
    # between the paths' machines and see its images; what the device decoder cannot take is decoded in the worker
    from ddp_accel.vision import DeviceDecode, collate_encoded, encoded_image_folders, image_folders, image_transforms

    data = make_mixed_folder(tmp_path / "images")
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    pil_train, pil_val, _ = image_folders(str(data), image_transforms(32, mean, std, "imagenet"), seed=5)
    train, val, classes = encoded_image_folders(str(data), seed=5)
    assert classes == ["a", "b"] and len(train) == len(pil_train) == 10
    for epoch in (0, 1):
        for pil, encoded in ((pil_train, train), (pil_val, val)):
            pil.set_epoch(epoch), encoded.set_epoch(epoch)
            batch = collate_encoded([encoded[i] for i in range(len(encoded))])
            assert [item.dim() for item in batch["images"].data] == [
                3,
                1,
                3,
                1,
                1,
            ] * 2  # cmyk, grey, png, tall, wide: the CMYK and the PNG as pixels
            images, targets = DeviceDecode(32, mean, std).inputs(batch)
            expected = torch.stack([pil[i][0] for i in range(len(pil))])
            assert targets.tolist() == [pil[i][1] for i in range(len(pil))]
            level = 1 / 255 / min(std)  # one level of 255, normalised
            difference = (images - expected).abs()
            assert difference.max() < 2 * level and difference.mean() < level / 2, (
                epoch,
                difference.max(),
            )  # PIL rounds


@pytest.mark.inprocess
def test_on_the_device_path_a_damaged_jpeg_is_named_and_what_it_cannot_do_is_one_line(tmp_path):
    from ddp_accel.vision import DeviceDecode, collate_encoded, encoded_image_folders

    data = make_mixed_folder(tmp_path / "images")
    damaged = data / "val" / "a" / "wide.jpg"
    damaged.write_bytes(damaged.read_bytes()[:-200])  # the header reads, the pixels do not
    _, val, _ = encoded_image_folders(str(data))
    batch = collate_encoded([val[i] for i in range(len(val))])
    with pytest.raises(UserError, match=f"cannot decode image {damaged} "):
        DeviceDecode(32, (0.5,) * 3, (0.5,) * 3).inputs(batch)
    for option in (["--augment", "cifar"], ["--random-erasing", "0.25"], ["--normalize-on", "loader"]):
        result = run_script("scripts/imagenet.py", data, "--decode-on", "device", *option)
        assert_clean_error(result, f"--decode-on device decodes, crops and normalises JPEGs on the device: {option[0]}")
