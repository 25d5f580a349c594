"""scripts/imdb.py and the text pipeline: tokenizer, vocabulary, sources, bucketing, 2-process training."""

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, assert_clean_error, check_ok, launch, load_script, metrics_of, run_script, write

from ddp_accel.errors import UserError
from ddp_accel.text import sources
from ddp_accel.text.models import GCNN, NgramBag, TextModelConfig
from ddp_accel.text.pipeline import BucketBatchSampler
from ddp_accel.text.tokenizer import basic_english
from ddp_accel.text.vocab import Vocab

SHARED_IMDB = Path(__file__).resolve().parents[2] / "shared" / "data" / "imdb_train.jsonl.gz"


@pytest.mark.multiprocess
def test_without_datasets_the_script_says_which_extra_to_install_in_one_line():
    # datasets is the `text` extra: a missing module is None in sys.modules (how Python blocks an import)
    blocked = "import runpy, sys; sys.modules['datasets'] = None; sys.argv = ['scripts/imdb.py', '--help']; "
    blocked += "runpy.run_path('scripts/imdb.py', run_name='__main__')"
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    line = "error: scripts/imdb.py needs datasets: pip install -e '.[text]' (Hugging Face datasets)\n"
    assert result.stderr == line
    blocked = "import sys; sys.modules['datasets'] = None; from ddp_accel.__main__ import main; "
    blocked += "main(['shard', 'text', 'reviews.jsonl', 'shards'])"
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2 and result.stderr == line.replace("scripts/imdb.py", "ddp-accel shard text")


@pytest.mark.inprocess
def test_tokenizer_matches_basic_english():
    assert basic_english("Great movie!<br /><br />I LOVED it, (really).") == [
        "great",
        "movie",
        "!",
        "i",
        "loved",
        "it",
        ",",
        "(",
        "really",
        ")",
        ".",
    ]
    assert basic_english('Don\'t "quote" me; ok: fine?') == ["don", "'", "t", "quote", "me", "ok", "fine", "?"]
    assert basic_english("Amélie était très BELLE") == ["amélie", "était", "très", "belle"]


@pytest.mark.inprocess
def test_vocab_min_freq_max_size_and_round_trip(tmp_path):
    vocab = Vocab.build([["a", "b", "a"], ["a", "c", "b"], ["d"]], min_freq=2)
    assert vocab.itos == ["<unk>", "<pad>", "a", "b"]
    assert vocab.encode(["a", "zzz", "b"]) == [2, 0, 3]
    assert Vocab.build([["a", "b", "a"], ["c"]], max_size=3).itos == ["<unk>", "<pad>", "a"]
    vocab.save(tmp_path / "vocab.json")
    assert Vocab.load(tmp_path / "vocab.json").itos == vocab.itos


@pytest.mark.parametrize("epoch", [0, 1])
@pytest.mark.inprocess
def test_bucketing_keeps_every_sample_once_and_groups_lengths(epoch):
    lengths = [(i * 37) % 101 + 1 for i in range(1000)]
    sampler = BucketBatchSampler(lengths, batch_size=16, seed=3)
    sampler.set_epoch(epoch)
    batches = list(sampler)
    flat = [i for batch in batches for i in batch]
    assert sorted(flat) == list(range(1000))
    assert len(batches) == len(sampler)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert padded / sum(lengths) < 1.1  # random batches would pad ~1.9x here
    assert all(len(batch) == 16 for batch in batches[:-1]), "only the last batch may be short"
    other = BucketBatchSampler(lengths, batch_size=16, seed=3)
    other.set_epoch(epoch + 1)
    assert list(other) != batches


def write_sources(root: Path) -> dict:
    rows = [
        {"text": f"{'great wonderful' if i % 2 else 'awful boring'} film number {i}", "label": i % 2} for i in range(40)
    ]
    paths = {}
    with open(root / "reviews.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    paths["jsonl"] = root / "reviews.jsonl"
    with gzip.open(root / "reviews.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    paths["jsonl.gz"] = root / "reviews.jsonl.gz"
    import datasets

    table = datasets.Dataset.from_list([{**row, "label": "pos" if row["label"] else "neg"} for row in rows])
    table.to_csv(root / "reviews.csv")
    paths["csv"] = root / "reviews.csv"
    table.to_parquet(root / "reviews.parquet")
    paths["parquet"] = root / "reviews.parquet"
    return paths


@pytest.mark.inprocess
def test_every_file_format_loads_with_normalised_labels(tmp_path):
    for fmt, path in write_sources(tmp_path).items():
        loaded = sources.load_file(path)
        assert loaded.column_names == ["text", "label"], fmt
        assert len(loaded) == 40 and sorted(set(loaded["label"])) == [0, 1], fmt
        assert loaded[1]["label"] == 1 and "great" in loaded[1]["text"], fmt


@pytest.mark.inprocess
def test_aclimdb_folder_layout(tmp_path):
    for split in ("train", "test"):
        for label in ("pos", "neg"):
            folder = tmp_path / "aclImdb" / split / label
            folder.mkdir(parents=True)
            for i in range(3):
                (folder / f"{i}_7.txt").write_text(f"{label} review {i}<br />")
    (tmp_path / "aclImdb" / "train" / "unsup").mkdir()
    (tmp_path / "aclImdb" / "train" / "unsup" / "0_0.txt").write_text("ignored")
    train = sources.load_aclimdb(tmp_path, "train")
    assert len(train) == 6 and sum(train["label"]) == 3
    assert all(text.startswith("pos") for text, label in zip(train["text"], train["label"], strict=False) if label == 1)
    with pytest.raises(UserError, match="pos and"):
        sources.load_aclimdb(tmp_path / "aclImdb" / "train", "train")


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"review": "x", "label": 1}\n', "needs columns 'text' and 'label'"),
        ('{"text": "x", "label": 3}\n', "labels must be 0/1 or pos/neg"),
        ("", "empty file"),
    ],
)
@pytest.mark.inprocess
def test_bad_files_are_clear_errors(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(UserError, match=message):
        sources.load_file(path)


@pytest.mark.inprocess
def test_bad_input_from_the_command_line(tmp_path):
    result = run_script("scripts/imdb.py", "--output-dir", tmp_path, "--data-dir", tmp_path / "nope")
    assert_clean_error(result, "error: --data-dir")
    result = run_script("scripts/imdb.py", "--output-dir", tmp_path / "untrained", "--predict", "hello")
    assert_clean_error(result, "Train first")
    for model_choice in (["--model", "gcnn"], ["--recipe"]):  # neither has a sparse table: not a silent dense run
        result = run_script("scripts/imdb.py", "--output-dir", tmp_path / "dense", *model_choice, "--sparse", "on")
        assert_clean_error(result, "--sparse on: only --model bag")
        assert not (tmp_path / "dense").exists()


def imdb_own_linear_schedule(step: int, total_steps: int) -> float:
    """imdb.py's own schedule before the shared --lr-schedule linear replaced it (5% of the steps warming up)."""
    warmup = max(1, int(0.05 * total_steps))
    return min((step + 1) / warmup, max(0.0, (total_steps - step) / max(1, total_steps - warmup)))


@pytest.mark.inprocess
def test_gcnn_s_shared_linear_schedule_gives_the_lr_of_imdb_py_s_own_at_every_step():
    # the IMDB figures of gcnn were measured under imdb.py's own schedule: its default now, --lr-schedule linear with
    # a warm-up of 5% of --epochs, must give the same float at every step (the step after the last one included)
    from ddp_accel import TrainConfig
    from ddp_accel.schedules import LearningRateSchedule

    imdb = load_script("scripts/imdb.py")
    for epochs, steps_per_epoch in [(1, 1), (1, 7), (2, 10), (3, 352), (4, 57), (5, 20), (10, 391), (40, 97)]:
        args = imdb.parse_args(["--model", "gcnn", "--epochs", str(epochs)])
        assert args.lr_schedule == "linear" and args.warmup_epochs > 0
        total = epochs * steps_per_epoch
        schedule = LearningRateSchedule(TrainConfig.from_args(args), total, steps_per_epoch)
        factors = [schedule(step) for step in range(total + 1)]
        assert factors == [imdb_own_linear_schedule(step, total) for step in range(total + 1)], (epochs, total)
    # the warm-up's whole steps, over many shapes: the factors where it ends
    for epochs in range(1, 31):
        config = TrainConfig.from_args(imdb.parse_args(["--model", "gcnn", "--epochs", str(epochs)]))
        for steps_per_epoch in range(1, 1001):
            total = epochs * steps_per_epoch
            schedule = LearningRateSchedule(config, total, steps_per_epoch)
            end = max(1, int(0.05 * total))
            assert [schedule(end - 1), schedule(end)] == [imdb_own_linear_schedule(s, total) for s in (end - 1, end)]
    # bag's default and --recipe: constant, no warm-up; the old spellings are one line naming the new ones
    for options in ([], ["--recipe"], ["--recipe", "--model", "gcnn"]):
        args = imdb.parse_args(options)
        assert (args.lr_schedule, args.warmup_epochs) == ("constant", 0.0)
        assert not hasattr(args, "schedule") and not hasattr(args, "warmup")  # not in args.json
    assert imdb.parse_args(["--lr-schedule", "linear"]).warmup_epochs == 0.05 * 3  # linear's default warm-up
    assert imdb.parse_args(["--model", "gcnn", "--warmup-epochs", "0"]).warmup_epochs == 0.0  # given: kept


@pytest.mark.inprocess
def test_ngram_hashing_ignores_padding():
    bag = NgramBag(vocab_size=10, pad_id=1, config=TextModelConfig("bag", dim=4, ngrams=2, buckets=7))
    ids = bag.ngram_ids(torch.tensor([[2, 3, 1, 1]]))
    assert ids[0, :4].tolist() == [2, 3, 1, 1]
    bigrams = ids[0, 4:].tolist()
    assert bigrams[0] >= 10 and bigrams[1:] == [1, 1]  # (2,3) hashed; (3,pad), (pad,pad) are padding
    assert GCNN(vocab_size=10)(torch.ones(2, GCNN(10).min_length, dtype=torch.long)).shape == (2, 2)


@pytest.mark.inprocess
def test_ngram_hash_spreads_bigrams_over_the_buckets():
    # 200k distinct bigrams of a 50k vocabulary into 1M buckets: a uniform hash fills ~18% of them;
    # the old multiplier (1,000,003, i.e. 3 mod 10**6) squeezed them into 3a+b < 200k and collided far more
    bag = NgramBag(vocab_size=50_000, pad_id=1, config=TextModelConfig("bag", dim=2, ngrams=2, buckets=1_000_000))
    pairs = torch.unique(torch.randint(2, 50_000, (200_000, 2), generator=torch.Generator().manual_seed(0)), dim=0)
    buckets = bag.ngram_ids(pairs)[:, 2]
    assert buckets.min() >= 50_000 and buckets.max() < 1_050_000
    assert len(torch.unique(buckets)) > 0.98 * len(pairs) * (1 - len(pairs) / 2e6)


@pytest.mark.parametrize("max_length", [None, 4])
@pytest.mark.inprocess
def test_arrow_encoding_matches_the_python_tokenizer_and_vocab(tmp_path, max_length):
    from accelerate import Accelerator

    from ddp_accel.text.pipeline import TextOptions, TextSource, prepare_text_data

    texts = [
        "Great movie!<br />I LOVED it.",
        "Awful, awful film; zzz-unknown words",
        'Don\'t "quote" me',
        "a b c d e f g",
    ]
    rows = [{"text": f"{texts[i % 4]} {i}", "label": i % 2} for i in range(20)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    text = prepare_text_data(
        Accelerator(cpu=True),
        TextSource(train_file=str(tmp_path / "train.jsonl")),
        TextOptions(cache_dir=str(tmp_path / "cache"), val_fraction=0.2, min_freq=2, max_length=max_length),
    )
    split = sources.load_file(str(tmp_path / "train.jsonl")).train_test_split(test_size=0.2, seed=0)
    vocab = Vocab.build([basic_english(t) for t in split["train"]["text"]], min_freq=2)
    assert text.vocab.itos == vocab.itos
    for raw, encoded in ((split["train"], text.train), (split["test"], text.val)):
        expected = [vocab.encode(basic_english(t)) for t in raw["text"]]
        assert encoded["input_ids"][:] == [ids[:max_length] for ids in expected]
        assert encoded["full_length"][:] == [len(ids) for ids in expected]
        assert encoded["label"][:] == raw["label"][:]
    assert text.truncated == (sum(len(basic_english(t)) > 4 for t in split["train"]["text"]) if max_length else 0)


@pytest.mark.inprocess
def test_encoded_reviews_read_the_arrow_buffers_of_every_chunk(tmp_path):
    import datasets

    from ddp_accel.text.pipeline import EncodedReviews, PadCollate

    rows = [list(range(2, 2 + n)) for n in range(1, 30)]
    parts = [
        datasets.Dataset.from_dict(
            {"input_ids": rows[i::3], "label": [i % 2] * len(rows[i::3]), "length": [len(r) for r in rows[i::3]]}
        )
        for i in range(3)
    ]
    combined = datasets.concatenate_datasets(parts)  # several arrow chunks
    for dataset in (combined, combined.select([5, 0, 17, 3])):  # also an index view
        reviews = EncodedReviews(dataset)
        assert len(reviews) == len(dataset) and reviews.lengths == dataset["length"][:]
        for i in range(len(dataset)):
            ids, label = reviews[i]
            assert ids.tolist() == dataset[i]["input_ids"] and label == dataset[i]["label"]
        input_ids, labels = PadCollate(pad_id=1, min_length=3)(reviews.__getitems__([0, 1]))
        assert input_ids.shape == (2, max(3, *(len(dataset[i]["input_ids"]) for i in (0, 1))))
        assert input_ids[0, len(dataset[0]["input_ids"]) :].eq(1).all() and labels.tolist() == dataset["label"][:2]


@pytest.mark.parametrize("model", [pytest.param("bag", marks=pytest.mark.versions), "gcnn"])
@pytest.mark.multiprocess
def test_two_processes_learn_synthetic_sentiment_and_count_each_review_once(tmp_path, model):
    epochs = 3 if model == "bag" else 4
    # the default dataset (the hub's) out of reach: both processes fall back to the synthetic corpus in one line,
    # neither hanging in the download barrier. bag: HF_HUB_OFFLINE=1; gcnn: a hub that does not answer (the hub
    # client used to retry for ~40 s, "Retrying in 1s ... 8s"; one short connection attempt decides now)
    offline = {"HF_HUB_OFFLINE": "1"} if model == "bag" else {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": ""}
    output = check_ok(
        launch(
            "scripts/imdb.py",
            "--model",
            model,
            "--output-dir",
            tmp_path,
            "--epochs",
            epochs,
            "--batch-size",
            32,
            "--buckets",
            20_000,
            env=offline,
        )
    )
    metrics = metrics_of(tmp_path)
    # 3600 training reviews = 113 batches of 32, 57 per rank: every epoch runs to its end
    assert metrics["steps"] == epochs * 57, metrics["steps"]
    assert metrics["world_size"] == 2 and metrics["synthetic_data"] is True
    assert metrics["eval_samples"] == 400 and metrics["test_samples"] == 1000
    assert metrics["test_accuracy"] > 0.8, metrics
    assert "SYNTHETIC" in output
    assert_offline_fallback(output, steps=epochs * 57, output_dir=tmp_path)
    assert (tmp_path / "vocab.json").is_file()
    predicted = run_script(
        "scripts/imdb.py",
        "--output-dir",
        tmp_path,
        "--predict",
        "a wonderful superb film",
        "an awful boring mess",
    )
    lines = [line for line in check_ok(predicted).splitlines() if line.startswith(("positive", "negative"))]
    assert "trained on the built-in SYNTHETIC corpus" in predicted.stderr
    assert lines[0].startswith("positive") and lines[1].startswith("negative"), lines


def assert_offline_fallback(output: str, steps: int, output_dir) -> None:
    assert sum("IMDB cannot be reached" in line for line in output.splitlines()) == 1, output[-3000:]
    assert "Retrying" not in output, output[-3000:]
    # the run ends with one summary line: what it reached and where the outputs are
    done = next(line for line in output.splitlines() if line.startswith("done: "))
    assert f"{steps} steps" in done and f"model.safetensors, metrics.json in {output_dir}" in done, done


@pytest.mark.inprocess
def test_second_run_reuses_the_encoded_cache(tmp_path):
    common = ["--dataset", "synthetic", "--output-dir", tmp_path, "--max-steps", 2, "--buckets", 1000]
    common += ["--cache-dir", tmp_path / "cache"]
    check_ok(run_script("scripts/imdb.py", *common))
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert any(name.endswith("-ids.arrow") for name in files)
    mtimes = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir()}
    check_ok(run_script("scripts/imdb.py", *common, "--overwrite-output-dir"))
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir()} == mtimes


@pytest.mark.inprocess
def test_a_cache_written_by_another_datasets_version_is_not_read(tmp_path, monkeypatch):
    # an arrow file of datasets 5.x failed to load under 3.0 (TypeError): the version is part of each file's key
    import datasets

    common = ["--dataset", "synthetic", "--output-dir", tmp_path, "--max-steps", 2, "--buckets", 1000]
    common += ["--cache-dir", tmp_path / "cache"]
    check_ok(run_script("scripts/imdb.py", *common))
    first = {p.name for p in (tmp_path / "cache").iterdir()}
    monkeypatch.setattr(datasets, "__version__", "0.0.1")
    check_ok(run_script("scripts/imdb.py", *common, "--overwrite-output-dir"))
    written = {p.name for p in (tmp_path / "cache").iterdir()} - first
    assert any(name.endswith("-ids.arrow") for name in written), sorted(written)


@pytest.mark.inprocess
def test_a_fold_with_a_val_fraction_is_one_line_and_the_fraction_alone_keeps_its_default():
    imdb = load_script("scripts/imdb.py")
    assert imdb.parse_args(["--dataset", "synthetic"]).val_fraction == 0.1
    assert imdb.parse_args(["--dataset", "synthetic", "--fold", "2/5"]).fold == "2/5"
    result = run_script("scripts/imdb.py", "--dataset", "synthetic", "--fold", "2/5", "--val-fraction", "0.1")
    assert_clean_error(result, "--fold 2/5 holds out its own part of the data: give --fold or --val-fraction")


@pytest.mark.inprocess
def test_a_resume_under_another_optimizer_names_the_options_that_decide_the_sparse_table(tmp_path):
    # --optimizer sgd makes the table dense: the refusal said "--sparse-table was True", an option that does not exist
    common = ["--dataset", "synthetic", "--output-dir", tmp_path, "--buckets", 1000, "--checkpointing-steps", 2]
    check_ok(run_script("scripts/imdb.py", *common, "--max-steps", 2))
    result = run_script(
        "scripts/imdb.py", *common, "--max-steps", 4, "--optimizer", "sgd", "--resume-from-checkpoint", "latest"
    )
    line = assert_clean_error(
        result, "the sparse embedding table (decided by --optimizer and --sparse) was True, now False"
    )
    assert "--sparse-table" not in line


@pytest.mark.skipif(not SHARED_IMDB.is_file(), reason="../shared/data/imdb_train.jsonl.gz not present")
@pytest.mark.system
def test_nb_weighted_bag_on_real_imdb_reaches_92_percent_held_out(tmp_path):
    # the defaults (NB weights, trigrams in 4M buckets, sparse updates) for one epoch: 92.8% on this split (bigrams
    # in 1M gave 93.2% after 2 epochs, 91.3% without NB)
    check_ok(run_script("scripts/imdb.py", "--train-file", SHARED_IMDB, "--output-dir", tmp_path, "--epochs", 1))
    metrics = metrics_of(tmp_path)
    assert metrics["eval_samples"] == 2500
    assert metrics["eval_accuracy"] > 0.92, metrics


@pytest.mark.inprocess
def test_nb_weights_favour_the_features_that_tell_the_classes_apart():
    # token 2 only in positive reviews, 3 only in negative ones, 4 in both; padding (1) is no feature
    bag = NgramBag(vocab_size=6, pad_id=1, config=TextModelConfig("bag", dim=4, ngrams=1, nb_weights=True))
    reviews = torch.tensor([[2, 4, 1], [2, 4, 4], [3, 4, 1], [3, 4, 1]])
    bag.fit_nb_weights([(reviews[:2], torch.tensor([1, 1])), (reviews[2:], torch.tensor([0, 0]))])
    weights = bag.nb_weights
    assert weights[2] > 5 * weights[4] and weights[3] > 5 * weights[4], weights
    assert torch.isclose(weights[2], weights[3])  # |r|: the sign is the embedding's to learn
    occurrences = torch.tensor([2.0, 2, 4])  # reviews containing 2, 3, 4 (binarised)
    assert torch.isclose((weights[2:5] * occurrences).sum() / occurrences.sum(), torch.tensor(1.0))
    assert not bag.nb_weights.requires_grad and "nb_weights" in bag.state_dict()
    # a review is the nb-weighted mean of its features: padding adds nothing
    assert torch.allclose(bag(torch.tensor([[2, 4, 1, 1]])), bag(torch.tensor([[2, 4]])))

    # add-alpha smoothing: a feature in one review (a movie's name) loses weight against one in many as alpha grows
    rare_vs_common = []
    for alpha in (1.0, 16.0):
        bag = NgramBag(vocab_size=7, pad_id=1, config=TextModelConfig("bag", dim=4, ngrams=1, nb_weights=True))
        reviews = torch.tensor([[2, 5], [2, 4], [2, 4], [3, 4], [3, 4], [3, 4]])  # 5: one positive review
        bag.fit_nb_weights([(reviews, torch.tensor([1, 1, 1, 0, 0, 0]))], alpha=alpha)
        rare_vs_common.append((bag.nb_weights[5] / bag.nb_weights[2]).item())
    assert rare_vs_common[1] < 0.8 * rare_vs_common[0], rare_vs_common


@pytest.mark.inprocess
def test_val_fraction_0_trains_a_final_model_on_every_review_measured_by_the_test_split(tmp_path):
    # the NB weights and the model see all of the training file; the test file is the run's only figure
    from accelerate import Accelerator
    from safetensors.torch import load_file

    from ddp_accel.text.pipeline import PadCollate, TextOptions, TextSource, make_loader, prepare_text_data

    rows = [{"text": f"{'great fun' if i % 2 else 'awful mess'} film {i}", "label": i % 2} for i in range(60)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:20]))
    files = ["--train-file", tmp_path / "train.jsonl", "--test-file", tmp_path / "test.jsonl", "--min-freq", 1]
    options = [*files, "--ngrams", 2, "--buckets", 500, "--val-fraction", 0, "--epochs", 2, "--batch-size", 8]
    output = check_ok(run_script("scripts/imdb.py", *options, "--output-dir", tmp_path / "out"))
    assert re.search(r"train/val/test reviews\s+60/0/20", output), output
    metrics = metrics_of(tmp_path / "out")
    assert metrics["test_samples"] == 20 and "eval_accuracy" not in metrics, metrics
    text = prepare_text_data(
        Accelerator(cpu=True),
        TextSource(train_file=str(tmp_path / "train.jsonl")),
        TextOptions(val_fraction=0, min_freq=1),
    )
    assert text.val is None and len(text.train) == 60
    bag = NgramBag(len(text.vocab), text.vocab.pad_id, TextModelConfig("bag", ngrams=2, buckets=500, nb_weights=True))
    bag.fit_nb_weights(make_loader(text.train, 64, PadCollate(text.vocab.pad_id), shuffle=False, seed=0), alpha=4.0)
    assert torch.equal(load_file(str(tmp_path / "out" / "model.safetensors"))["nb_weights"], bag.nb_weights)
    for wrong, said in (
        (["--group-size", 50], "--group-size 50 holds out runs"),
        (
            ["--best-metric", "eval_accuracy"],
            "--best-metric eval_accuracy picks model_best.safetensors by an evaluation",
        ),
    ):
        result = run_script("scripts/imdb.py", *options, *wrong, "--output-dir", tmp_path / "x")
        assert_clean_error(result, said)


@pytest.mark.inprocess
def test_nb_weights_are_fitted_on_the_training_part_only(tmp_path):
    # the held-out part must not leak into the NB weights (they would score it as if they had seen its labels)
    from accelerate import Accelerator
    from safetensors.torch import load_file

    from ddp_accel.text.pipeline import PadCollate, TextOptions, TextSource, make_loader, prepare_text_data

    rows = [
        {"text": f"{'great fun' if i % 2 else 'awful mess'} film {i} word{i % 7}", "label": i % 2} for i in range(80)
    ]
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    options = ["--min-freq", 1, "--ngrams", 2, "--buckets", 500, "--val-fraction", 0.25, "--max-steps", 1]
    out = tmp_path / "out"
    check_ok(
        run_script("scripts/imdb.py", "--train-file", train_file, *options, "--nb-alpha", 2.5, "--output-dir", out)
    )
    trained = load_file(str(out / "model.safetensors"))["nb_weights"]
    text = prepare_text_data(
        Accelerator(cpu=True), TextSource(train_file=str(train_file)), TextOptions(val_fraction=0.25, min_freq=1)
    )
    bag = NgramBag(len(text.vocab), text.vocab.pad_id, TextModelConfig("bag", ngrams=2, buckets=500, nb_weights=True))
    bag.fit_nb_weights(make_loader(text.train, 64, PadCollate(text.vocab.pad_id), shuffle=False, seed=0), alpha=2.5)
    assert torch.equal(trained, bag.nb_weights)
    # the smoothing shapes the model: a resume under another one is refused, and where no NB weights are fitted
    # the option is one error line rather than silently ignored
    resume = ["--resume-from-checkpoint", "latest", "--output-dir", out, "--max-steps", 2]
    result = run_script("scripts/imdb.py", "--train-file", train_file, *options[:-2], *resume)
    assert_clean_error(result, "--nb-alpha", "2.5", "4")
    wrong_uses = (
        ["--nb-alpha", 0],
        ["--nb-alpha", 1e7],
        ["--nb-alpha", 2, "--model", "gcnn"],
        ["--nb-alpha", 2, "--recipe"],
        ["--nb-alpha", 2, "--nb-weights", "off"],
    )
    for wrong in wrong_uses:
        result = run_script("scripts/imdb.py", "--dataset", "synthetic", *wrong, "--output-dir", tmp_path / "x")
        assert_clean_error(result, "--nb-alpha")


@pytest.mark.inprocess
def test_nb_alpha_is_part_of_the_identity_where_nb_weights_are_fitted_and_old_runs_resume_with_alpha_1():
    from ddp_accel.identity import compare_identity, make_identity

    imdb = load_script("scripts/imdb.py")

    def identity(*argv):
        args = imdb.parse_args(["--dataset", "synthetic", *map(str, argv)])
        return make_identity(imdb.identity_options(args), unset=imdb.UNSET)

    default, alpha_1 = identity(), identity("--nb-alpha", 1)
    assert default["options"]["nb_alpha"] == 4.0 and "nb_alpha" not in alpha_1["options"]
    # a bag run saved before --nb-alpha (fitted with alpha 1) has no nb_alpha in its identity, as alpha_1
    with pytest.raises(UserError, match=r"--nb-alpha was not given \(1.0\), now 4.0"):
        compare_identity(alpha_1, default, "checkpoint x")
    assert compare_identity(alpha_1, identity("--nb-alpha", 1.0), "checkpoint x") is None
    with pytest.raises(UserError, match="--nb-alpha was 4.0, now 1.0"):
        compare_identity(default, alpha_1, "checkpoint x")
    # no NB weights: no alpha, so runs of gcnn, of --nb-weights off and of --recipe resume as before
    for argv in (["--model", "gcnn"], ["--nb-weights", "off"], ["--recipe"]):
        assert "nb_alpha" not in identity(*argv)["options"]
        assert imdb.parse_args(["--dataset", "synthetic", *argv]).nb_alpha is None


@pytest.mark.inprocess
def test_k_folds_hold_out_every_review_exactly_once(tmp_path):
    # --fold I/K (benchmarks/kfold.py): the K held-out parts are disjoint, cover the training data, and each
    # run trains on the rest; a fold that is not I/K with 1 <= I <= K is one line
    import datasets
    from accelerate import Accelerator

    from ddp_accel.text.pipeline import TextOptions, TextSource, _fold_split, _group_split, prepare_text_data

    reviews = datasets.Dataset.from_dict({"number": list(range(31))})
    held_out, trained = [], []
    for fold in ("1/3", "2/3", "3/3"):
        train, val = _fold_split(reviews, fold, seed=0, source="test")
        held_out.append(set(val["number"]))
        trained.append(set(train["number"]))
    assert sorted(len(part) for part in held_out) == [10, 10, 11]
    assert set().union(*held_out) == set(range(31)) and sum(map(len, held_out)) == 31  # each review once
    assert all(train.isdisjoint(val) and len(train | val) == 31 for train, val in zip(trained, held_out, strict=True))
    assert held_out[0] != set(_fold_split(reviews, "1/3", seed=1, source="test")[1]["number"])  # --seed shuffles
    assert held_out[0] == set(np.random.default_rng(0).permutation(31)[:10].tolist())  # the split of earlier runs

    # --group-size 4: whole runs of 4 consecutive reviews on one side of every split, folds and --val-fraction
    groups = [{n // 4 for n in _fold_split(reviews, f"{i}/3", 0, "test", group_size=4)[1]["number"]} for i in (1, 2, 3)]
    assert sorted(map(len, groups)) == [2, 3, 3] and set().union(*groups) == set(range(8))  # 8 runs, each once
    for train, val in (_fold_split(reviews, "2/3", 0, "test", 4), _group_split(reviews, 0.25, 0, "test", 4)):
        assert not {n // 4 for n in train["number"]} & {n // 4 for n in val["number"]}
        assert len(train) + len(val) == 31
    assert len({n // 4 for n in _group_split(reviews, 0.25, 0, "test", 4)[1]["number"]}) == 2  # a quarter of 8

    rows = [{"text": f"{'good' if i % 2 else 'bad'} review number {i}", "label": i % 2} for i in range(31)]
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    text = prepare_text_data(
        Accelerator(cpu=True),
        TextSource(train_file=str(train_file)),
        TextOptions(fold="3/3", min_freq=1, cache_dir=str(tmp_path / "cache")),
    )
    assert (len(text.train), len(text.val)) == (20, 11)
    result = run_script("scripts/imdb.py", "--train-file", train_file, "--fold", "4/3", "--output-dir", tmp_path / "x")
    assert_clean_error(result, "--fold", "I/K needs K of at least 2 and I from 1 to K")
    result = run_script(
        "scripts/imdb.py",
        "--train-file",
        train_file,
        "--fold",
        "1/3",
        "--group-size",
        20,
        "--output-dir",
        tmp_path / "y",
    )
    assert_clean_error(result, "in runs of --group-size 20 cannot be split into 3 folds")


@pytest.mark.inprocess
def test_the_nbsvm_reference_runs_on_imdb_py_s_folds(tmp_path, monkeypatch):
    # benchmarks/imdb_nbsvm.py: the folds of both protocols, each review held out once (in whole runs with a group
    # size), and a model that learns the sentiment words and not the review numbers
    pytest.importorskip("sklearn", reason="scikit-learn is not installed (benchmarks/imdb_nbsvm.py needs it)")
    nbsvm = load_script("benchmarks/imdb_nbsvm.py")
    held = [set(nbsvm.fold_indices(40, f"{i}/4", 0, 5)[1].tolist()) for i in (1, 2, 3, 4)]
    assert set().union(*held) == set(range(40)) and sum(map(len, held)) == 40
    assert all(part == {n for n in range(40) if n // 5 in {m // 5 for m in part}} for part in held)  # whole runs
    words = ["plot", "actor", "scene", "music", "ending"]
    rows = [
        {"text": f"{'a great and wonderful' if i % 2 else 'an awful and boring'} {words[i % 5]} {i}", "label": i % 2}
        for i in range(60)
    ]
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "nbsvm.json"
    argv = ["imdb_nbsvm.py", "--train-file", str(train_file), "--folds", "3", "--ngrams", "2", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", [*argv, "--group-size", "1", "4"])
    nbsvm.main()
    results = json.loads(out.read_text())
    assert sorted(results) == ["NBSVM, n-grams up to 2, random folds", "NBSVM, n-grams up to 2, runs of 4", "setup"]
    assert results.pop("setup") == {"train_file": "train.jsonl", "reviews": 60, "seed": 0, "folds": 3}
    assert all(list(scores) == ["1/3", "2/3", "3/3"] for scores in results.values())
    assert all(score == 100.0 for scores in results.values() for score in scores.values()), results
    monkeypatch.setattr(sys, "argv", [*argv, "--seed", "1"])  # other folds: not mixed into this file's
    with pytest.raises(SystemExit):
        nbsvm.main()


@pytest.mark.inprocess
def test_predict_file_gives_one_prediction_per_line_reads_jsonl_texts_and_refuses_what_it_cannot_read(tmp_path):
    out = tmp_path / "out"
    check_ok(
        run_script("scripts/imdb.py", "--dataset", "synthetic", "--max-steps", 2, "--buckets", 100, "--output-dir", out)
    )

    def predict(path):
        return run_script("scripts/imdb.py", "--output-dir", out, "--predict-file", path)

    def predictions(result):
        return [line for line in check_ok(result).splitlines() if line.startswith(("positive", "negative"))]

    # real reviews hold U+0085 (NEL) and U+2028: str.splitlines() made 5 of 500 IMDB reviews two predictions each
    lines = write(tmp_path / "reviews.txt", "a fine film\u0085really\na dull\u2028film\r\n\nthe end\n")
    assert len(predictions(predict(lines))) == 3
    jsonl = write(tmp_path / "reviews.jsonl", '{"text": "a fine film", "label": 1}\n\n{"text": "a dull film"}\n')
    assert [line.split("\t")[2] for line in predictions(predict(jsonl))] == ["a fine film", "a dull film"]
    # under a launcher every process runs --predict: rank 0 alone prints
    rank_1 = run_script(
        "scripts/imdb.py", "--output-dir", out, "--predict", "a film", env={"WORLD_SIZE": "2", "RANK": "1"}
    )
    assert check_ok(rank_1).strip() == "", rank_1
    assert_clean_error(predict(write(tmp_path / "bad.jsonl", '{"label": 1}\n')), "bad.jsonl: line 1 has no")
    assert_clean_error(predict(write(tmp_path / "empty.txt", "\n\n")), "empty.txt: no text to classify")
    # a vocab.json of another run beside the model: one line, not a size-mismatch traceback
    vocab = json.loads((out / "vocab.json").read_text())
    (out / "vocab.json").write_text(json.dumps({"tokens": [*vocab["tokens"], "a word of another run"]}))
    assert_clean_error(
        run_script("scripts/imdb.py", "--output-dir", out, "--predict", "a film"), "come from different runs"
    )


@pytest.mark.multiprocess
def test_a_damaged_shard_of_a_multi_process_map_is_built_again(tmp_path, capsys):
    # above 5,000 reviews the tokenisation runs in worker processes and writes NAME_0000i_of_0000n.arrow shards
    import datasets

    from ddp_accel.text.pipeline import cache_files, cached_map

    reviews = datasets.Dataset.from_dict({"text": [f"review number {i}" for i in range(200)]})
    name = str(tmp_path / "tokens.arrow")

    def tokens(batch):
        return {"tokens": [text.split() for text in batch["text"]]}

    expected = cached_map(reviews, tokens, cache_file_name=name, batched=True, num_proc=2)["tokens"][:]
    shards = cache_files(tmp_path / "tokens.arrow")
    assert [shard.name for shard in shards] == ["tokens_00000_of_00002.arrow", "tokens_00001_of_00002.arrow"]
    shards[1].write_bytes(shards[1].read_bytes()[:100])  # cut short: a full disk, a killed run
    again = cached_map(reviews, tokens, cache_file_name=name, batched=True, num_proc=2)
    assert again["tokens"][:] == expected
    assert "tokens.arrow is damaged" in capsys.readouterr().out
