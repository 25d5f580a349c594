"""ImageFolder / ImageNet classification: pytorch/examples imagenet/main.py on Accelerate.

    accelerate launch --config_file accelerate_configs/multi_gpu.yaml scripts/imagenet.py /data/imagenet -a resnet50
    python scripts/imagenet.py cifar10_mini -a cifar_resnet9_w24 --image-size 32 --augment cifar --epochs 40
    python scripts/imagenet.py /data/imagenet -e --resume outputs/imagenet/model_best.safetensors
    python scripts/imagenet.py --dummy -a resnet50 --channels-last --mixed-precision bf16 --max-steps 100

DATA_DIR holds train/<class>/*.jpg and val/<class>/*.jpg, or WebDataset tar shards train/*.tar and val/*.tar
(written by `ddp-accel shard images`; read in place, in one order at any world size: docs/data.md).
`-b/--batch-size` is per process (main.py's 256 for a whole 8-GPU node is `-b 32`). Unreadable images stop the
run with the file's name (see data.py).
"""

from __future__ import annotations

# A preemption signal during the imports below ends the process at once with its marker (ddp_accel/startup.py), and
# the DataLoader workers' forkserver imports beside them; only when run as a script: a program that imports this
# module keeps its own signal handling
if __name__ == "__main__":
    from ddp_accel.startup import start_worker_server_early, stop_during_imports

    stop_during_imports(default_output_dir="outputs/imagenet")
    start_worker_server_early(("-j", "--workers"), default=4)

import argparse
import os
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from torch.utils.data import DataLoader

from ddp_accel import (
    ArgumentParser,
    Run,
    RunRecord,
    StopSignals,
    Task,
    TrainConfig,
    UserError,
    add_training_args,
    check_memory,
    check_trained_with,
    classification_metrics,
    classification_names,
    classification_values,
    cli,
    convert_sync_batchnorm,
    evaluate,
    load_saved_weights,
    load_weights_file,
    make_identity,
    make_optimizer,
    run_main,
    write_json,
)
from ddp_accel.vision import (
    AUTO_AUGMENTS,
    IMAGENET_MEAN,
    IMAGENET_STD,
    BatchMixing,
    DeviceDecode,
    DeviceNormalize,
    ShardedImages,
    SyntheticImages,
    build_model,
    collate_encoded,
    encoded_image_folders,
    image_folders,
    image_transforms,
    is_sharded,
    list_archs,
    sharded_data_identity,
    sharded_image_sets,
    with_group_norm,
)

# where NHWC is the default (memory_format_nhwc): one CPU process, or CPU processes under DDP
CPU_DATA_PARALLEL = (DistributedType.NO, DistributedType.MULTI_CPU)
# what shapes the model and the data: a resume must use the same (ddp_accel.identity)
IDENTITY_OPTIONS = ("arch", "image_size", "augment", "mean", "std", "dummy", "dummy_classes", "dummy_images", "sync_bn")
RECIPE_OPTIONS = {"auto_augment": "none", "random_erasing": 0.0, "mixup_alpha": 0.0, "cutmix_alpha": 0.0}
RECIPE_OPTIONS |= {"mix_prob": 1.0, "mix_switch_prob": 0.5}
# the decoder and resampler shape the pixels (within one level of 255): recorded when not the workers' PIL
DECODER = {"decode_on": "loader"}
# what the validation images and so the predictions depend on: -e refuses weights trained with other values
EVALUATION_OPTIONS = ("arch", "image_size", "augment", "mean", "std")
# what the input means to weights fine-tuned (--pretrained FILE, --resume FILE.safetensors): another image size or
# augmentation is a choice (FixRes), another normalisation feeds values the weights never saw
FINE_TUNING_OPTIONS = ("mean", "std")
# what -e reads; any other option given is training's, and refused with -e (it would change nothing, without a word)
EVALUATE_READS = {"output_dir", "batch_size", "seed", "mixed_precision", "compile", "compile_backend", "timeout_s"}
EVALUATE_READS |= {"hang_timeout_s", "local_rank", "data", "arch", "list_archs", "workers", "print_freq", "resume"}
EVALUATE_READS |= {"evaluate", "tta_flip", "channels_last", "image_size", "augment", "mean", "std", "dummy"}
EVALUATE_READS |= {
    "decode_on",
    "dummy_classes",
    "dummy_images",
    "normalize_on",
    "deterministic",
    "help",
    "time_budget",
}  # (time_budget: its own line)


def parse_args(argv=None):
    parser = add_training_args(ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("data", nargs="?", help="DATA_DIR with train/ and val/ ImageFolder trees")
    parser.add_argument(
        "-a",
        "--arch",
        default="resnet18",
        help="any torchvision classification model, or cifar_resnet9[_w16/24/32], cifar_resnet20/32/56",
    )
    parser.add_argument("--list-archs", action="store_true", help="print the architectures and exit")
    parser.add_argument(
        "--norm",
        choices=("batch", "group"),
        default="batch",
        help="the model's normalisation layers: BatchNorm as built, or GroupNorm in their place (statistics of each "
        "sample alone: what --exact-micro-batch needs)",
    )
    parser.add_argument("-j", "--workers", type=cli.nonnegative_int, default=4, help="DataLoader workers per process")
    parser.add_argument(
        "-b", dest="batch_size", type=cli.positive_int, default=argparse.SUPPRESS, help="= --batch-size (per process)"
    )
    # pytorch/examples' name for --weight-decay (a shared option, default 1e-4 here)
    parser.add_argument(
        "--wd", dest="weight_decay", type=cli.nonnegative, default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    parser.add_argument(
        "-p", "--print-freq", dest="log_steps", type=cli.positive_int, default=argparse.SUPPRESS, help="= --log-steps"
    )
    parser.add_argument("--resume", help="= --resume-from-checkpoint (a checkpoint, 'latest'), or a .safetensors file")
    parser.add_argument("-e", "--evaluate", action="store_true", help="validate the --resume model and exit")
    parser.add_argument(
        "--pretrained",
        nargs="?",
        const="default",
        metavar="PATH",
        help="torchvision's weights (cached or downloaded), or a local state-dict file",
    )
    parser.add_argument(
        "--sync-bn", action="store_true", help="SyncBatchNorm across processes (GPUs, and CPU processes over gloo)"
    )
    parser.add_argument(
        "--tta-flip",
        action="store_true",
        help="evaluate each image and its mirror image, averaging their logits (test-time augmentation; twice "
        "the evaluation's compute; also with -e)",
    )
    parser.add_argument(
        "--label-smoothing", type=cli.probability, default=0.0, help="share of the target spread over all classes"
    )
    parser.add_argument(
        "--channels-last",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="NHWC memory format: faster convolutions on the CPU (the default there) and on GPUs with mixed "
        "precision (--no-channels-last: NCHW)",
    )
    parser.add_argument("--image-size", type=cli.positive_int, default=224, help="training and validation crop size")
    parser.add_argument(
        "--augment",
        choices=["imagenet", "cifar"],
        default="imagenet",
        help="imagenet: RandomResizedCrop; cifar: pad-4 random crop (small images)",
    )
    recipes = parser.add_argument_group("augmentation recipes (each draw seeded: exact across a resume)")
    recipes.add_argument(
        "--auto-augment",
        choices=AUTO_AUGMENTS,
        default="none",
        help="RandAugment (2 ops, magnitude 9) or TrivialAugmentWide",
    )
    recipes.add_argument("--random-erasing", type=cli.chance, default=0.0, help="RandomErasing's probability")
    recipes.add_argument("--mixup-alpha", type=cli.nonnegative, default=0.0, help="MixUp's Beta(a, a); 0: off")
    recipes.add_argument("--cutmix-alpha", type=cli.nonnegative, default=0.0, help="CutMix's Beta(a, a); 0: off")
    recipes.add_argument("--mix-prob", type=cli.chance, default=1.0, help="share of batches mixed")
    recipes.add_argument(
        "--mix-switch-prob", type=cli.chance, default=0.5, help="with both alphas: CutMix's share of mixed batches"
    )
    parser.add_argument(
        "--mean", type=cli.number(float), nargs=3, default=list(IMAGENET_MEAN), help="per-channel normalisation"
    )
    parser.add_argument("--std", type=cli.positive, nargs=3, default=list(IMAGENET_STD))
    parser.add_argument("--dummy", action="store_true", help="synthetic images (throughput runs, no data needed)")
    parser.add_argument("--dummy-classes", type=cli.number(int, low=2), default=1000, help="--dummy: number of classes")
    parser.add_argument(
        "--dummy-images",
        type=cli.number(int, low=1),
        help="--dummy: training images (default 100 x -b; validation: a tenth). Give it to resume at another -b "
        "(or with --recover in-process, where the survivors' -b grows) on the same images",
    )
    parser.add_argument(
        "--normalize-on",
        choices=["auto", "device", "loader"],
        default="auto",
        help="device: the loader sends uint8 images, normalised on the GPU (4x fewer bytes to "
        "collate, pin and copy); loader: float images from the workers; auto: device on a GPU",
    )
    parser.add_argument(
        "--decode-on",
        choices=["auto", "device", "loader"],
        default="auto",
        help="device: the workers read the JPEG files and draw the crops, the device decodes a batch at once (nvJPEG "
        "on a GPU) and crops, resizes, flips and normalises it; loader: PIL in the workers; auto: device on a GPU "
        "with --augment imagenet and no --auto-augment or --random-erasing",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic cuDNN/cuBLAS kernels (bitwise-repeatable GPU runs, somewhat slower)",
    )
    # shared options with main.py's recipe: SGD (momentum 0.9, weight decay 1e-4), x0.1 every 30 epochs
    parser.set_defaults(
        output_dir="outputs/imagenet", epochs=90, batch_size=32, lr=0.1, log_steps=10, lr_schedule="step"
    )
    parser.set_defaults(optimizer="sgd", momentum=0.9, weight_decay=1e-4)
    args = parser.parse_args(argv)
    if args.evaluate:
        check_evaluation_options(parser, args)
    if args.resume and not args.resume.endswith(".safetensors"):
        args.resume_from_checkpoint = args.resume
    mixing = args.mixup_alpha > 0 or args.cutmix_alpha > 0
    if not mixing and any(getattr(args, key) != RECIPE_OPTIONS[key] for key in ("mix_prob", "mix_switch_prob")):
        parser.error("--mix-prob and --mix-switch-prob set how batches are mixed: give --mixup-alpha or --cutmix-alpha")
    if args.mix_switch_prob != RECIPE_OPTIONS["mix_switch_prob"] and not (args.mixup_alpha and args.cutmix_alpha):
        parser.error("--mix-switch-prob chooses between MixUp and CutMix: give both --mixup-alpha and --cutmix-alpha")
    if args.dummy and (args.auto_augment != "none" or args.random_erasing > 0):
        parser.error("--auto-augment and --random-erasing change DATA_DIR's images; --dummy images have none to change")
    if args.evaluate and args.time_budget:
        parser.error("--time-budget plans a training run's epochs; -e only evaluates")
    if not (args.list_archs or args.dummy or args.data):
        parser.error("give DATA_DIR (with train/ and val/), or --dummy for synthetic images")
    if args.dummy_images is not None and not args.dummy:
        parser.error("--dummy-images sizes the synthetic set of --dummy")
    if args.dummy and args.dummy_images is None:  # resolved: the run identity records the size the images had
        args.dummy_images = 100 * args.batch_size
    args.uint8 = args.normalize_on == "device" or args.normalize_on == "auto" and torch.cuda.is_available()
    args.decode_on = decode_place(parser, args)
    return args


def decode_place(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """Where the JPEGs are decoded: --decode-on, with auto resolved (device on a GPU, where the PIL path's CPU
    work per image bounds the run) and what the device path cannot do said in one line."""
    pil_only = {
        "--augment cifar": args.augment == "cifar",
        f"--auto-augment {args.auto_augment}": args.auto_augment != "none",
        "--random-erasing": args.random_erasing > 0,
        "--dummy": args.dummy,
        "--normalize-on loader": args.normalize_on == "loader",
    }
    given = [option for option, used in pil_only.items() if used]
    if args.decode_on == "device" and given:
        parser.error(
            f"--decode-on device decodes, crops and normalises JPEGs on the device: {given[0]} needs the "
            "workers' PIL path (--decode-on loader)"
        )
    if args.decode_on == "auto":
        return "device" if torch.cuda.is_available() and not given else "loader"
    return args.decode_on


def batch_form(args) -> str:
    if args.decode_on == "device":
        return "JPEG bytes, decoded, cropped and normalised on the device"
    return "uint8, normalised on the device" if args.uint8 else "float"


def check_evaluation_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """-e evaluates the --resume weights: an option of training given with it would be read by nothing."""
    given = [
        action.option_strings[-1]
        for action in parser._actions  # (argparse keeps no public list of a parser's options)
        if action.dest not in EVALUATE_READS and getattr(args, action.dest, action.default) != action.default
    ]
    if given:
        parser.error(
            f"-e only evaluates the --resume weights: {', '.join(given)} "
            + ("is an option" if len(given) == 1 else "are options")
            + " of training, read by nothing here; drop them"
        )


def datasets_for(args):
    if args.dummy:
        return (
            SyntheticImages(args.dummy_images, args.image_size, args.dummy_classes, args.uint8),
            SyntheticImages(-(-args.dummy_images // 10), args.image_size, args.dummy_classes, args.uint8),
            [str(i) for i in range(args.dummy_classes)],
        )
    sharded = is_sharded(args.data)
    if args.decode_on == "device":
        if sharded:
            raise UserError("--decode-on device reads JPEG files of an ImageFolder; tar shards: --decode-on loader")
        return encoded_image_folders(args.data, args.seed)
    transform_pair = image_transforms(
        args.image_size, args.mean, args.std, args.augment, args.uint8, args.auto_augment, args.random_erasing
    )
    if sharded:
        return sharded_image_sets(args.data, transform_pair, args.seed)
    return image_folders(args.data, transform_pair, args.seed)


def loader(dataset, args, shuffle: bool, run: Run | None = None) -> DataLoader:
    # workers are not persistent: new workers each epoch take that epoch's seed, which keeps augmentations
    # exact across a resume (ddp_accel.vision.data.augmentation_seed); starting them costs ~1 s an epoch
    # tar shards: their canonical order (ddp_accel.streaming), the same at any number of processes and workers
    sampler = dataset.sampler(shuffle) if isinstance(dataset, ShardedImages) else None
    return DataLoader(
        run.skipping_bad_samples(dataset) if run else dataset,  # training: --skip-bad-samples
        batch_size=args.batch_size,
        shuffle=shuffle and sampler is None,
        sampler=sampler,
        num_workers=args.workers,
        pin_memory=torch.cuda.is_available(),
        collate_fn=collate_encoded if args.decode_on == "device" else None,
    )


def make_model_input(args) -> DeviceNormalize | DeviceDecode:
    """What turns a batch into the model's input on its device: JPEGs decoded there, or images normalised."""
    if args.decode_on == "device":
        return DeviceDecode(args.image_size, args.mean, args.std, args.channels_last)
    return DeviceNormalize(args.mean, args.std, args.channels_last)


def make_eval_fn(model_input: DeviceNormalize | DeviceDecode, tta_flip: bool = False):
    def eval_fn(model, batch):
        images, targets = model_input.inputs(batch)
        logits = model(images)
        if tta_flip:  # test-time augmentation: the mean of the image's and its mirror image's logits
            logits = (logits + model(torch.flip(images, dims=[3]))) / 2
        return classification_values(logits, targets, topk=(1, 5), per_class=True)

    return eval_fn


def identity_of(args, accelerator, evaluation: bool = False, data_sets: tuple = ()) -> dict:
    """What shapes the model and the data: a resume must match it; an evaluation, what its predictions depend on."""
    if evaluation:
        return make_identity({key: getattr(args, key) for key in EVALUATION_OPTIONS})
    options = {key: getattr(args, key) for key in (*IDENTITY_OPTIONS, *RECIPE_OPTIONS, *DECODER)}
    sources = {"data": None if args.dummy else args.data}  # by content; an --output-dir inside it is not data
    if data_sets and isinstance(data_sets[0], ShardedImages):  # by the manifests: a refusal names the changed shards
        sources["data"] = sharded_data_identity(*data_sets)
    # the recipes recorded only when used: a run from before they existed resumes
    unset = RECIPE_OPTIONS | DECODER
    return make_identity(options, sources, exclude=[args.output_dir], accelerator=accelerator, unset=unset)


def set_backends(args) -> None:
    if args.deterministic:  # pytorch/examples does this with --seed; here it is its own choice
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    else:
        torch.backends.cudnn.benchmark = True  # fixed image size: let cuDNN time its conv algorithms once
    if args.dummy:  # the classifier alone: up to 2048 features per class, with its gradient and momentum
        check_memory(args.dummy_classes * 2048 * 4 * 3, f"--dummy-classes {args.dummy_classes}")


def check_fine_tuning(args) -> None:
    """Weights of one of this project's runs (a metrics.json beside them) fine-tuned under their normalisation."""
    for option, file in (("--pretrained", args.pretrained), ("--resume", args.resume)):
        if file and file != "default" and file.endswith((".safetensors", ".pth", ".pt")) and Path(file).is_file():
            identity = make_identity({key: getattr(args, key) for key in FINE_TUNING_OPTIONS})
            check_trained_with(Path(file), identity, f"Give {option} {file} the --mean and --std it was trained with")


def memory_format_nhwc(asked: bool | None, accelerator) -> bool:
    """--channels-last, else NHWC where it is faster: oneDNN's convolutions on the CPU. FSDP2 shards contiguous
    (NCHW) parameters only."""
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    if asked and fsdp:
        raise UserError("--channels-last under FSDP: FSDP2 shards NCHW (contiguous) parameters only; leave it out")
    if asked is None:
        return accelerator.device.type == "cpu" and accelerator.distributed_type in CPU_DATA_PARALLEL
    return asked


def make_model(args, accelerator, classes: list[str]) -> tuple[torch.nn.Module, int]:
    """The model, and how many BatchNorm layers became SyncBatchNorm."""
    if not args.evaluate:
        check_fine_tuning(args)
    model = build_model(args.arch, len(classes), args.pretrained)
    if args.norm == "group":
        model, _ = with_group_norm(model)
    sync_bn_layers = 0
    if args.sync_bn and accelerator.num_processes > 1:
        model, sync_bn_layers = convert_sync_batchnorm(model, accelerator.device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, sync_bn_layers


def evaluate_saved(args, accelerator, model, val_set, eval_fn, metrics_fn) -> None:
    """-e: the --resume weights on the validation set, under the options they were trained with."""
    if not args.resume:
        raise UserError("--evaluate needs --resume (a checkpoint folder, 'latest', or model_best.safetensors)")
    output_dir = Path(args.output_dir)
    if output_dir.exists() and not output_dir.is_dir():  # said before the evaluation, not after it
        raise UserError(f"--output-dir {output_dir} is a file; evaluate.json goes into a folder")
    saved = load_saved_weights(
        accelerator, model, args.resume, output_dir, identity_of(args, accelerator, evaluation=True)
    )
    val_loader = accelerator.prepare(loader(val_set, args, False))
    metrics = evaluate(accelerator, saved.model, val_loader, eval_fn, metrics_fn)
    at_step = f" (step {saved.step})" if saved.step is not None else ""
    accelerator.print(
        f"top1 {metrics['eval_top1']:.4f}"
        + (f" top5 {metrics['eval_top5']:.4f}" if "eval_top5" in metrics else "")
        + f" on {metrics['eval_samples']} images; the weights of {saved.source}{at_step}"
    )
    if accelerator.is_main_process:  # what was evaluated, and how: beside the figures
        output_dir.mkdir(parents=True, exist_ok=True)
        what = {"weights": str(saved.source), "step": saved.step, "asked": args.resume, "tta_flip": args.tta_flip}
        write_json(output_dir / "evaluate.json", {**metrics, **what})


def banner_lines(args, classes: int, images: tuple[int, int], sync_bn_layers: int, model) -> dict:
    """What the banner says of the data, the model and the recipes."""
    recipes = ", ".join(
        f"{key} {getattr(args, key)}" for key, off in RECIPE_OPTIONS.items() if getattr(args, key) != off
    )
    return {
        "arch": args.arch,
        "classes": classes,
        "train/val images": f"{images[0]}/{images[1]}",
        "data": "SYNTHETIC (--dummy)" if args.dummy else args.data,
        "image_size": args.image_size,
        "channels_last": args.channels_last,
        "batches": batch_form(args),
        "sync_bn_layers": sync_bn_layers,
        "recipes": recipes or "none",
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def main(signals: StopSignals) -> None:
    args = parse_args()
    if args.list_archs:
        print("\n".join(list_archs()))
        return
    config = TrainConfig.from_args(args)
    set_backends(args)
    run = Run(config, signals, check_output_dir=not args.evaluate)
    accelerator = run.accelerator
    args.channels_last = memory_format_nhwc(args.channels_last, accelerator)
    train_set, val_set, classes = datasets_for(args)
    model, sync_bn_layers = make_model(args, accelerator, classes)
    model_input = make_model_input(args)
    eval_fn = make_eval_fn(model_input, args.tta_flip)

    def metrics_fn(values):
        return classification_metrics(values, classes)

    if args.evaluate:
        return evaluate_saved(args, accelerator, model, val_set, eval_fn, metrics_fn)
    if args.resume and args.resume.endswith(".safetensors"):  # fine-tune from these weights
        load_weights_file(model, Path(args.resume))
    optimizer = make_optimizer(model.parameters(), config)

    mixing = BatchMixing(
        len(classes), args.seed, args.mixup_alpha, args.cutmix_alpha, args.mix_prob, args.mix_switch_prob
    )

    def loss_fn(model, batch):
        images, targets = mixing(*model_input.inputs(batch))  # soft targets when mixing
        return torch.nn.functional.cross_entropy(model(images), targets, label_smoothing=args.label_smoothing)

    task = Task(
        model,
        optimizer,
        loader(train_set, args, True, run),
        loss_fn,
        eval_loader=loader(val_set, args, False),
        eval_fn=eval_fn,
        metrics_fn=metrics_fn,
        best_metric="eval_top1",  # model_best.safetensors, and best_top1 in metrics.json
        metric_names=classification_names(len(classes), topk=(1, 5)),
    )
    banner = banner_lines(args, len(classes), (len(train_set), len(val_set)), sync_bn_layers, model)
    identity = identity_of(args, accelerator, data_sets=(train_set, val_set))
    record = RunRecord(title="imagenet", banner=banner, identity=identity)
    metrics = run.fit(task, record, callbacks=[mixing] if mixing.active else [])
    best = metrics["best_metric"].removeprefix("eval_")
    accelerator.print(f"best {best} {metrics['best_' + best]:.4f}; model_best.safetensors in {config.output_dir}")


if __name__ == "__main__":
    run_main(main)
