"""IMDB sentiment: the classic multi-GPU text-classification recipe on Accelerate.

    accelerate launch --config_file accelerate_configs/multi_gpu.yaml scripts/imdb.py
    python scripts/imdb.py --model gcnn --train-file train.jsonl --test-file test.jsonl
    python scripts/imdb.py --train-file shards/ --val-fraction 0.1     # jsonl/parquet shards read in place
    python scripts/imdb.py --predict "A wonderful, moving film." --output-dir outputs/imdb

Models: `bag` (fastText: mean of token + hashed n-gram embeddings; --ngrams 1 is the recipe's EmbeddingBag)
and `gcnn` (the recipe's gated CNN). `--recipe` restores the classic hyper-parameters (BCE on sigmoid,
Adam 1e-3, clip 0.1, batch 128, vocabulary min frequency 20, dim 64). Labels: 1 = positive, 0 = negative.
"""

from __future__ import annotations

# A preemption signal during the imports below ends the process at once with its marker (ddp_accel/startup.py);
# only when run as a script: a program that imports this module keeps its own signal handling
if __name__ == "__main__":
    from ddp_accel.startup import TEXT_EXTRA, require, start_worker_server_early, stop_during_imports

    require(["datasets"], install=TEXT_EXTRA)
    stop_during_imports(default_output_dir="outputs/imdb")
    start_worker_server_early(("--workers",), default=0)

import argparse
import json
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from ddp_accel import (
    ArgumentParser,
    Optimizers,
    Run,
    RunRecord,
    SparseAdamW,
    StopSignals,
    Task,
    TrainConfig,
    UserError,
    add_training_args,
    check_memory,
    classification_names,
    classification_values,
    cli,
    make_identity,
    make_optimizer,
    process_rank,
    run_main,
)
from ddp_accel.text import (
    KERNEL_SIZE,
    STRIDE,
    PadCollate,
    TextModelConfig,
    TextOptions,
    TextSource,
    Vocab,
    basic_english,
    make_loader,
    prepare_text_data,
)

RECIPE = dict(
    loss="bce",
    optimizer="adam",
    lr=1e-3,
    weight_decay=0.0,
    max_grad_norm=0.1,
    batch_size=128,
    min_freq=20,
    dim=64,
    ngrams=1,
    pool="mean",
    dropout=0.0,
    lr_schedule="constant",
    warmup_epochs=0.0,
    kernel_size=KERNEL_SIZE,
    stride=STRIDE,
)


MODEL_OPTIONS = ("dim", "ngrams", "buckets", "pool", "dropout", "kernel_size", "stride", "nb_weights")
HELD_OUT = cli.number(float, low=0, high=1, high_open=True)  # 0 (nothing held out) up to, not including, 1
IDENTITY_OPTIONS = ("model", "dataset", "val_fraction", "fold", "min_freq", "max_vocab", "max_length", "loss", "recipe")
IDENTITY_OPTIONS += ("group_size", "nb_alpha")
UNSET = {"group_size": 1, "nb_alpha": 1.0}  # recorded where they differ: runs saved before the options resume
# values no single option sets: a refused resume names the options that decide them
LABELS = {"sparse_table": "the sparse embedding table (decided by --optimizer and --sparse)"}
NB_ALPHA = 4.0  # 5-fold CV, random folds and runs of 50 (docs/imdb.md): alpha 1 overrates a movie's names
# --lr-schedule linear's warm-up unless --warmup-epochs is given: this share of --epochs (imdb.py's own schedule
# warmed up over 5% of the steps; LearningRateSchedule rounds down to the same whole steps, docs/imdb.md)
WARMUP_SHARE = 0.05


def parse_args(argv=None):
    parser = add_training_args(ArgumentParser(description=__doc__.splitlines()[0]))
    data = parser.add_argument_group("data")
    data.add_argument(
        "--dataset",
        choices=["imdb", "synthetic"],
        default="imdb",
        help="'imdb' from the Hugging Face hub (falls back to synthetic offline)",
    )
    data.add_argument("--data-dir", help="the aclImdb folder of the Stanford tarball (train/, test/)")
    data.add_argument(
        "--train-file",
        help="jsonl/csv/parquet with text and label columns, or a folder of jsonl/parquet shards read in place "
        "(ddp-accel shard text; docs/data.md)",
    )
    data.add_argument(
        "--test-file",
        help="jsonl/csv/parquet (or a folder of shards, with streamed training data) evaluated at the end",
    )
    data.add_argument(
        "--val-fraction",
        type=HELD_OUT,
        default=None,
        help="held out from the training data (default 0.1); 0: a final model on every review, measured only by the "
        "test split (--test-file, --data-dir's test/)",
    )
    data.add_argument(
        "--fold",
        type=cli.fold,
        metavar="I/K",
        help="hold out the I-th of K equal parts of the training data (shuffled by --seed) instead of "
        "--val-fraction: k-fold cross-validation, e.g. benchmarks/kfold.py",
    )
    data.add_argument(
        "--group-size",
        type=cli.positive_int,
        default=1,
        metavar="N",
        help="--val-fraction and --fold hold out whole runs of N consecutive reviews (the official split lists a "
        "movie's reviews together): held-out reviews of movies unseen in training, docs/imdb.md",
    )
    data.add_argument("--min-freq", type=cli.positive_int, default=2, help="vocabulary: minimum token count")
    data.add_argument("--max-vocab", type=cli.positive_int, default=None, help="keep the most frequent words only")
    data.add_argument("--max-length", type=cli.positive_int, default=None, help="truncate reviews to this many tokens")
    data.add_argument(
        "--cache-dir",
        default=None,
        help="encoded-data cache; default $XDG_CACHE_HOME/ddp_accel/imdb (~/.cache/ddp_accel/imdb)",
    )
    data.add_argument("--workers", type=cli.nonnegative_int, default=0, help="DataLoader worker processes")
    model = parser.add_argument_group("model")
    model.add_argument("--model", choices=["bag", "gcnn"], default="bag")
    model.add_argument("--dim", type=cli.positive_int, default=64, help="embedding (and GCNN channel) size")
    # trigrams in 4M buckets: 92.40% held out in 5-fold cross-validation, bigrams in 1M 92.09% (docs/imdb.md; both with
    # the weight decay and NB smoothing of then)
    model.add_argument(
        "--ngrams", type=cli.positive_int, default=3, help="bag: 2 adds hashed bigrams (fastText), 3 trigrams too"
    )
    model.add_argument("--buckets", type=cli.positive_int, default=4_000_000, help="bag: hash buckets for n-grams")
    model.add_argument("--pool", choices=["mean", "max"], default="max", help="gcnn: pooling over time")
    model.add_argument("--kernel-size", type=cli.positive_int, default=KERNEL_SIZE, help="gcnn: convolution width")
    model.add_argument("--stride", type=cli.positive_int, default=STRIDE, help="gcnn: convolution stride")
    model.add_argument(
        "--sparse",
        choices=["auto", "on", "off"],
        default="auto",
        help="bag: sparse gradients for the embedding table (auto: except on several GPUs, where NCCL "
        "cannot all-reduce them)",
    )
    model.add_argument(
        "--nb-weights",
        choices=["on", "off"],
        default="on",
        help="bag: scale each n-gram by its naive-Bayes log-count ratio, fitted on the training part (NBSVM)",
    )
    model.add_argument(
        "--nb-alpha",
        type=cli.number(float, low=0, high=1e6, low_open=True),  # far above 1e6, the counts vanish in float64
        default=None,
        help=f"bag: the count each class starts from in the NB ratios (add-alpha smoothing); larger values weigh "
        f"n-grams seen in a few reviews (a movie's names) less (default: {NB_ALPHA:g}, chosen by cross-validation "
        "with held-out movies)",
    )
    model.add_argument("--dropout", type=cli.probability, default=0.0, help="share of activations zeroed in training")
    optim = parser.add_argument_group("optimisation")
    optim.add_argument("--loss", choices=["ce", "bce"], default="ce", help="bce: the recipe's BCE on sigmoid(logits)")
    # imdb.py's own schedule, until the shared --lr-schedule replaced it: kept, hidden, to name the new spellings
    optim.add_argument("--schedule", help=argparse.SUPPRESS)
    optim.add_argument("--warmup", help=argparse.SUPPRESS)
    optim.add_argument("--recipe", action="store_true", help="the classic recipe's hyper-parameters")
    parser.add_argument(
        "--predict", nargs="+", metavar="TEXT", help="classify these texts with the model in --output-dir"
    )
    parser.add_argument(
        "--predict-file",
        nargs="+",
        metavar="FILE",
        help="classify each non-empty line of these UTF-8 files with the model in --output-dir",
    )
    parser.add_argument(
        "--predict-weights",
        choices=["model", "best", "ema"],
        default="model",
        help="which weights of --output-dir classify: model.safetensors, model_best or model_ema (--ema-decay)",
    )
    parser.set_defaults(output_dir="outputs/imdb", epochs=3, batch_size=64, lr=5e-3, log_steps=20)
    # --weight-decay (shared), unset: 0. bag: the sparse table's decay reaches only the rows a batch touches, so it
    # shrinks frequent words more than a movie's names (5-fold CV, docs/imdb.md: 0.5 costs 0.3 points with held-out
    # movies); gcnn: 0.5 costs 1 point
    # --lr-schedule (shared), unset: constant for bag (chosen by cross-validation, docs/imdb.md), linear for gcnn;
    # --warmup-epochs, unset: WARMUP_SHARE of --epochs for linear, else 0. Both settled after parsing
    parser.set_defaults(optimizer="adamw", weight_decay=0.0, warmup_epochs=None)
    args = parser.parse_args(argv)
    if args.schedule is not None:
        parser.error(f"--schedule is now --lr-schedule {args.schedule}")
    if args.warmup is not None:
        parser.error(renamed_warmup(args.warmup, args.epochs))
    del args.schedule, args.warmup  # not options any more: args.json and the trackers do not record them
    if args.fold and args.val_fraction is not None:  # --fold holds out 1/K: a given fraction would be read by nothing
        parser.error(f"--fold {args.fold} holds out its own part of the data: give --fold or --val-fraction, not both")
    if args.val_fraction is None:
        args.val_fraction = 0.1
    if args.val_fraction == 0 and args.group_size > 1:
        parser.error(
            f"--group-size {args.group_size} holds out runs of reviews: with --val-fraction 0 none is held out"
        )
    if args.recipe:  # the classic values, except where an option was given (a value other than its default)
        for key, value in RECIPE.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    if args.lr_schedule is None:
        args.lr_schedule = "constant" if our_bag(args) else "linear"
    if args.warmup_epochs is None:
        args.warmup_epochs = WARMUP_SHARE * args.epochs if args.lr_schedule == "linear" else 0.0
    fits_nb_weights = our_bag(args) and args.nb_weights == "on"
    if args.nb_alpha is not None and not fits_nb_weights:
        parser.error("--nb-alpha smooths the NB weights of --model bag with --nb-weights on (not --recipe)")
    if args.nb_alpha is None and fits_nb_weights:  # elsewhere it stays None (unused)
        args.nb_alpha = NB_ALPHA
    if args.sparse == "on" and not our_bag(args):  # rather than a silently dense table
        parser.error(
            "--sparse on: only --model bag has a sparse table, and --recipe keeps it dense; "
            "drop --sparse or use --sparse auto"
        )
    return args


def renamed_warmup(share: str, epochs: int) -> str:
    """--warmup's error line: its replacement counts epochs, not a share of the steps."""
    try:
        equivalent = f" (--warmup {share} with --epochs {epochs}: --warmup-epochs {float(share) * epochs:g})"
    except ValueError:
        equivalent = ""
    return f"--warmup is now --warmup-epochs, in epochs instead of a share of the steps{equivalent}"


def our_bag(args) -> bool:
    """`bag` with our additions (a sparse table, NB weights); `--recipe` keeps the classic bag."""
    return args.model == "bag" and not args.recipe


def loss_function(kind: str):
    def loss_fn(model, batch):
        input_ids, labels = batch
        logits = model(input_ids)
        if kind == "bce":  # the recipe: sigmoid + BCE against one-hot labels
            return torch.nn.functional.binary_cross_entropy_with_logits(
                logits, torch.nn.functional.one_hot(labels, 2).to(logits.dtype)
            )
        return torch.nn.functional.cross_entropy(logits, labels)

    return loss_fn


def eval_fn(model, batch):
    input_ids, labels = batch
    return classification_values(model(input_ids), labels)  # per-sample loss and accuracy


def sparse_tables(args, accelerator) -> tuple[bool, str]:
    """Sparse embedding gradients (only the rows a batch touches are all-reduced and updated) for `bag`, unless
    NCCL would have to all-reduce them: it has no sparse all-reduce, so several GPUs keep the table dense."""
    if not our_bag(args) or args.sparse == "off":
        return False, "dense"
    if args.optimizer not in ("adam", "adamw"):  # the sparse table's optimizer is an Adam
        if args.sparse == "on":
            raise UserError(
                f"--sparse on: the sparse table is updated by an AdamW; not with --optimizer {args.optimizer}"
            )
        return False, f"dense (--optimizer {args.optimizer})"
    if accelerator.distributed_type.name == "MULTI_GPU" or accelerator.state.backend == "nccl":
        if args.sparse == "on":
            raise UserError("--sparse on: NCCL has no sparse all-reduce; on several GPUs use --sparse auto or off")
        return False, "dense (NCCL has no sparse all-reduce)"
    return True, "sparse (SparseAdamW on the table, AdamW on the rest)"


def make_model_optimizer(model, args, lr: float) -> torch.optim.Optimizer:
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]  # not the NB weights
    if not getattr(model, "sparse", False):
        # fused: one kernel over all parameters; on CPU 7x faster than the default per-tensor loop, and the
        # dense update of the n-gram table is most of a dense `bag` step
        return make_optimizer(trainable, args, lr=lr, fused=True)
    table = model.embedding.weight
    rest = [parameter for parameter in trainable if parameter is not table]
    return Optimizers(
        SparseAdamW([table], lr=lr, betas=tuple(args.betas), weight_decay=args.weight_decay),
        make_optimizer(rest, args, lr=lr, fused=True),
    )


def model_config(args) -> TextModelConfig:
    return TextModelConfig(
        args.model,
        dim=args.dim,
        ngrams=args.ngrams,
        buckets=args.buckets,
        pool=args.pool,
        dropout=args.dropout,
        kernel_size=getattr(args, "kernel_size", KERNEL_SIZE),
        stride=getattr(args, "stride", STRIDE),
        nb_weights=getattr(args, "nb_weights", "off") == "on" and our_bag(args),
    )


def train(args: argparse.Namespace, signals: StopSignals) -> None:
    config = TrainConfig.from_args(args)
    run = Run(config, signals)
    accelerator = run.accelerator
    text = prepare_text_data(
        accelerator,
        TextSource(args.dataset, args.data_dir, args.train_file, args.test_file),
        TextOptions(
            val_fraction=args.val_fraction,
            fold=args.fold,
            group_size=args.group_size,
            min_freq=args.min_freq,
            max_vocab=args.max_vocab,
            max_length=args.max_length,
            seed=config.seed,
            cache_dir=args.cache_dir,
            skip_bad_samples=config.skip_bad_samples,
        ),
    )
    if args.model == "bag" and accelerator.distributed_type.name == "FSDP":  # its table is updated by rows
        raise UserError(
            "--model bag under FSDP: its n-gram table is fitted (NB weights) and updated by rows outside a sharded "
            "forward; train it with DDP (accelerate_configs/multi_gpu.yaml), or use --model gcnn under FSDP"
        )
    sparse, embedding_gradients = sparse_tables(args, accelerator)
    # the embedding table with its gradient and two Adam moments
    rows = len(text.vocab) + (args.buckets if args.model == "bag" and args.ngrams > 1 else 0)
    check_memory(rows * args.dim * 4 * 4, f"a table of {rows:,} rows x --dim {args.dim}")
    model = model_config(args).build(len(text.vocab), text.vocab.pad_id, sparse=sparse)
    task = make_task(args, run, text, model)
    banner = {
        "data": ("SYNTHETIC corpus (offline fallback)" if text.synthetic else text.source),
        "train/val/test reviews": "/".join(str(len(part) if part else 0) for part in (text.train, text.val, text.test)),
        "vocabulary": len(text.vocab),
        "truncated_reviews": text.truncated,
        "preprocess_s": round(text.preprocess_s, 1),
        "model": args.model
        + (f" ({args.ngrams}-grams in {args.buckets:,} buckets)" if our_bag(args) and args.ngrams > 1 else ""),
        **({"nb_weights": f"|log-count ratio|, alpha {args.nb_alpha:g}"} if model_config(args).nb_weights else {}),
        "parameters": sum(p.numel() for p in model.parameters()),
        "embedding_gradients": embedding_gradients,
    }
    record = RunRecord(
        title="imdb (SYNTHETIC data)" if text.synthetic else "imdb",
        banner=banner,
        extra_metrics={
            "data": banner["data"],
            "synthetic_data": text.synthetic,
            "preprocess_s": text.preprocess_s,
            "vocabulary": len(text.vocab),
        },
        artifacts={"vocab.json": text.vocab_path},  # --predict reads it beside the model
        identity=make_identity(
            {**identity_options(args), "sparse_table": sparse}, text.sources, unset=UNSET, labels=LABELS
        ),
    )
    run.fit(task, record)


def make_task(args: argparse.Namespace, run: Run, text, model: torch.nn.Module) -> Task:
    """Loaders (length-bucketed), the NB weights and the optimizer around `model`."""
    config, min_length = run.config, getattr(model, "min_length", 1)

    def loader(split, shuffle, training=False):
        return make_loader(
            split,
            config.batch_size,
            PadCollate(text.vocab.pad_id, min_length),
            shuffle=shuffle,
            seed=config.seed,
            workers=args.workers,
            read_through=run.skipping_bad_samples if training else None,  # --skip-bad-samples
        )

    if getattr(model, "nb_weights", None) is not None:  # every process fits the same weights on the same reviews
        model.fit_nb_weights(loader(text.train, False, training=True), alpha=args.nb_alpha)

    return Task(
        model,
        make_model_optimizer(model, args, config.lr),
        loader(text.train, True, training=True),
        loss_function(args.loss),
        eval_loader=loader(text.val, False) if text.val is not None else None,
        eval_fn=eval_fn,
        test_loader=loader(text.test, False) if text.test is not None else None,
        metric_names=classification_names(2),
    )  # the schedule: the shared --lr-schedule (parse_args settles it)


def identity_options(args: argparse.Namespace) -> dict:
    """What shapes the model, the vocabulary and the encoded data (ddp_accel.identity): a resume or --predict
    under other values stops with a line naming them."""
    options = {**model_config(args).options(), **{key: getattr(args, key) for key in IDENTITY_OPTIONS}}
    if not options["nb_weights"]:  # no NB weights fitted: recorded as runs from before --nb-alpha were
        options["nb_alpha"] = UNSET["nb_alpha"]
    return options


def predict(args) -> None:
    """Classify texts with a trained output dir: its vocab.json, args.json and model.safetensors. One line per text,
    printed by one process (under a launcher, rank 0)."""
    output_dir = Path(args.output_dir)
    trained = trained_options(args, output_dir)
    texts = [*given_texts(args.predict or []), *(text for name in args.predict_file or [] for text in file_texts(name))]
    if not texts:
        raise UserError(f"--predict-file {' '.join(args.predict_file)}: no text to classify (empty lines are skipped)")
    vocab = Vocab.load(output_dir / "vocab.json")
    model = model_config(argparse.Namespace(**trained)).build(len(vocab), vocab.pad_id)
    weights = weights_file(args)
    try:
        model.load_state_dict(load_file(str(output_dir / weights)))
    except RuntimeError as error:
        raise UserError(
            f"{output_dir}: {weights} does not fit vocab.json ({len(vocab)} words; "
            f"{str(error).splitlines()[-1].strip()}): the two files come from different runs"
        ) from None
    model.eval()
    if process_rank() != 0:  # every process of a launch would print the same lines
        return
    metrics = output_dir / "metrics.json"
    if metrics.is_file() and json.loads(metrics.read_text()).get("synthetic_data"):
        print(
            f"note: the model in {output_dir} was trained on the built-in SYNTHETIC corpus, not on real reviews",
            file=sys.stderr,
        )
    min_length = getattr(model, "min_length", 1)
    with torch.no_grad():
        for text in texts:
            ids = vocab.encode(basic_english(text))[: trained.get("max_length") or None] or [vocab.unk_id]
            ids += [vocab.pad_id] * (min_length - len(ids))
            probability = torch.softmax(model(torch.tensor([ids])).float(), dim=1)[0, 1].item()
            label = "positive" if probability >= 0.5 else "negative"
            print(f"{label}\t{max(probability, 1 - probability):.3f}\t{text[:80]}")


def weights_file(args) -> str:
    return "model.safetensors" if args.predict_weights == "model" else f"model_{args.predict_weights}.safetensors"


def trained_options(args, output_dir: Path) -> dict:
    """args.json of a trained output dir; options given now must be the ones the model was trained with."""
    needed = [output_dir / name for name in ("vocab.json", "args.json", weights_file(args))]
    missing = [path.name for path in needed if not path.is_file()]
    if missing:
        raise UserError(
            f"--predict needs a trained --output-dir; {output_dir} lacks {', '.join(missing)}. "
            f"Train first: python scripts/imdb.py --output-dir {output_dir}"
        )
    trained = json.loads((output_dir / "args.json").read_text())
    defaults = vars(parse_args([]))
    given = {key: value for key, value in vars(args).items() if key in IDENTITY_OPTIONS + MODEL_OPTIONS}
    differing = [
        f"--{key.replace('_', '-')} {value} (the model was trained with {trained.get(key)})"
        for key, value in given.items()
        if value != defaults.get(key) and key in trained and trained[key] != value
    ]
    if differing:
        raise UserError(
            f"--predict uses the options the model in {output_dir} was trained with; drop " + ", ".join(differing)
        )
    return trained


def given_texts(texts: list[str]) -> list[str]:
    for text in texts:
        if not text.strip():
            raise UserError("--predict got an empty text; give the review itself")
        if Path(text).exists() or re.fullmatch(r"\S+\.(txt|jsonl?|csv|tsv|gz)", text):
            raise UserError(
                f"--predict {text!r} looks like a file name; --predict takes texts, use --predict-file {text}"
            )
    return texts


def file_texts(name: str) -> list[str]:
    """The texts of a --predict-file: one per line, split at line feeds only (a review may hold U+0085 or U+2028,
    which str.splitlines() would also split at); a .jsonl file: the `text` field of each line."""
    path = Path(name)
    if not path.is_file():
        raise UserError(f"--predict-file {name}: {'a directory' if path.is_dir() else 'no such file'}")
    try:
        lines = [line.removesuffix("\r") for line in path.read_text(encoding="utf-8").split("\n")]
    except UnicodeDecodeError as error:
        line = path.read_bytes()[: error.start].count(b"\n") + 1
        raise UserError(f"--predict-file {name}: line {line} is not UTF-8 text (byte {error.start})") from None
    if path.suffix not in (".jsonl", ".json"):
        return [line for line in lines if line.strip()]
    texts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise UserError(
                f"--predict-file {name}: line {number} is not JSON (a .jsonl file holds one object a line)"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise UserError(f'--predict-file {name}: line {number} has no "text" string')
        texts.append(record["text"])
    return texts


def main(signals: StopSignals) -> None:
    args = parse_args()
    predict(args) if args.predict or args.predict_file else train(args, signals)


if __name__ == "__main__":
    run_main(main)
