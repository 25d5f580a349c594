"""Reviews as jsonl/parquet shards read in place (ddp_accel.text.streamed): what the writer writes, the index of a
jsonl shard, the vocabulary and encoding against the in-memory pipeline, whole shards held out, a resume with
another worker count, and bad data in one line."""

import gzip
import json
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_clean_error, assert_same_weights, check_ok, launch, run_script
from safetensors.torch import load_file

from ddp_accel.errors import UserError
from ddp_accel.streaming import JsonlIndex, LengthBuckets, Place, ShardManifest, ShardReader, WindowShuffle
from ddp_accel.text.sources import synthetic_imdb
from ddp_accel.text.streamed import WINDOW, held_out_shards, review_of, text_manifest, write_text_shards
from ddp_accel.text.tokenizer import basic_english

inprocess = pytest.mark.inprocess
SMALL_BAG = ["--model", "bag", "--ngrams", "2", "--buckets", "1000", "--dim", "8", "--min-freq", "1"]


def reviews_file(tmp_path: Path, size: int) -> tuple[Path, list[tuple[str, int]]]:
    corpus = synthetic_imdb(size, seed=5)
    rows = list(zip(corpus["text"], corpus["label"], strict=True))
    path = tmp_path / "reviews.jsonl"
    path.write_text("".join(json.dumps({"text": text, "label": label}) + "\n" for text, label in rows))
    return path, rows


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
@inprocess
def test_the_writer_s_text_shards_hold_every_review_once_in_the_seed_s_order(tmp_path, kind):
    source, rows = reviews_file(tmp_path, 50)
    write_text_shards(source, tmp_path / "shards", samples_per_shard=12, seed=1, kind=kind)
    manifest = text_manifest(tmp_path / "shards")
    assert manifest.counts == [12, 12, 12, 12, 2] and {shard.name[-len(kind) :] for shard in manifest.shards} == {kind}
    reader = ShardReader(manifest)
    read = [review_of(*reader.read(index)) for index in range(len(manifest))]
    assert sorted(read) == sorted(rows) and read != rows  # every review once, in the seed's order
    # what a DataLoader worker receives: the manifest, not the indexes its parent built (it builds its own)
    sent = pickle.loads(pickle.dumps(reader))
    assert len(reader._indexes) == 5 and not sent._indexes and sent.read(13) == reader.read(13)


@inprocess
def test_a_jsonl_shard_s_index_skips_blank_lines_and_a_bad_row_is_named_by_its_line(tmp_path):
    shard = tmp_path / "000000.jsonl"
    rows = ['{"text": "a", "label": 1}', "", '{"text": "b", "label": "neg"}', '{"text": "c"}', "{not json"]
    shard.write_text("\n".join([*rows, '{"text": "d", "label": 0}']))  # the last line without its newline
    index = JsonlIndex(shard)
    assert len(index) == 5 and index.lines.tolist() == [1, 3, 4, 5, 6]
    assert review_of(str(shard), *index.read(1)) == ("b", 0)
    assert index.read(4) == ("line 6", {"text": "d", "label": 0})
    with pytest.raises(UserError, match=f"shard {shard}: line 4 has the label None"):
        review_of(str(shard), *index.read(2))
    with pytest.raises(UserError, match=f"shard {shard}: line 5 is not JSON"):
        index.read(3)


@inprocess
def test_the_vocabulary_and_encoding_of_the_shards_are_the_in_memory_pipeline_s(tmp_path):
    from accelerate import Accelerator

    from ddp_accel.text.pipeline import PadCollate, TextOptions, TextSource, make_loader, prepare_text_data

    source, rows = reviews_file(tmp_path, 200)
    write_text_shards(source, tmp_path / "shards", samples_per_shard=64)
    options = TextOptions(cache_dir=str(tmp_path / "cache"), val_fraction=0, min_freq=2, max_length=12)
    memory = prepare_text_data(Accelerator(cpu=True), TextSource(train_file=str(source)), options)
    streamed = prepare_text_data(Accelerator(cpu=True), TextSource(train_file=str(tmp_path / "shards")), options)
    assert streamed.vocab.itos == memory.vocab.itos and streamed.truncated == memory.truncated > 0
    encoded = {text: ids for (text, _), ids in zip(rows, memory.train["input_ids"], strict=True)}
    reader = ShardReader(streamed.train.manifest)
    for index in range(len(streamed.train)):
        ids, label = streamed.train[index]
        text, expected_label = review_of(*reader.read(index))
        assert ids.dtype == np.int32 and ids.tolist() == encoded[text] and label == expected_label
    # each review's length in tokens (at most --max-length) counted by the vocabulary's pass
    texts = [review_of(*reader.read(index))[0] for index in range(len(streamed.train))]
    assert streamed.train.lengths.tolist() == [min(len(basic_english(text)), 12) for text in texts]
    # training in the canonical order of (seed, epoch, manifest), bucketed by length; evaluation in the manifest's
    shuffled = make_loader(streamed.train, 8, PadCollate(streamed.vocab.pad_id), shuffle=True, seed=3)
    canonical = WindowShuffle(streamed.train.manifest.counts, 3, WINDOW)
    places = list(shuffled.sampler)
    assert places == list(LengthBuckets(canonical, streamed.train.lengths, 8))
    assert [index for index, _ in places] != sorted(canonical)
    ids, _ = streamed.train[Place(places[0].sample, 40)]  # padded to its global micro-batch's width
    assert len(ids) == 40 and ids[12:].tolist() == [streamed.vocab.pad_id] * 28
    listed = make_loader(streamed.train, 8, PadCollate(streamed.vocab.pad_id), shuffle=False, seed=3)
    assert list(listed.sampler) == list(range(len(streamed.train)))


@inprocess
def test_length_buckets_keep_each_global_micro_batch_whole_and_of_one_width_at_any_world_size():
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    lengths = np.random.default_rng(0).integers(1, 500, 100).astype(np.int32)
    order = WindowShuffle([37, 50, 13], seed=5, window=32)
    buckets = LengthBuckets(order, lengths, chunk=8, pool=3)
    buckets.set_epoch(2)
    places, canonical = list(buckets), list(order)
    indices = [place.sample for place in places]
    for start in range(0, 100, 24):  # a pool: the canonical order's samples, in global micro-batches of 8
        assert sorted(indices[start : start + 24]) == sorted(canonical[start : start + 24])
    chunks = [places[start : start + 8] for start in range(0, 100, 8)]
    for chunk in chunks:  # sorted by length, each padded to the longest of its global micro-batch
        assert [lengths[index] for index, _ in chunk] == sorted(lengths[index] for index, _ in chunk)
        assert {width for _, width in chunk} == {max(lengths[index] for index, _ in chunk)}
    padded = sum(chunk[0].width for chunk in chunks)
    assert padded < 0.8 * sum(lengths[canonical[start : start + 8]].max() for start in range(0, 100, 8))
    fixed = WindowShuffle([37, 50, 13], seed=5, window=32, shuffle=False)  # the same pools every epoch
    fixed_buckets = LengthBuckets(fixed, lengths, chunk=8, pool=3)
    epochs = [fixed_buckets.set_epoch(epoch) or list(fixed_buckets) for epoch in (2, 3)]
    assert epochs[0] != epochs[1] and sorted(epochs[0]) == sorted(epochs[1])  # each epoch its own shuffle
    for processes, batch in ((1, 8), (2, 4), (4, 2)):  # Accelerate's batch sharding: the same global micro-batches
        shards = [
            list(BatchSamplerShard(BatchSampler(buckets, batch, False), processes, rank, even_batches=False))
            for rank in range(processes)
        ]
        steps = [sum((shard[step] for shard in shards), []) for step in range(len(shards[-1]))]
        assert steps == chunks[: len(steps)]


@inprocess
def test_validation_holds_out_whole_shards_drawn_from_the_seed(tmp_path):
    source, _ = reviews_file(tmp_path, 100)
    write_text_shards(source, tmp_path / "shards", samples_per_shard=10)
    manifest = ShardManifest.of(tmp_path / "shards", (".jsonl",))
    names = [shard.name for shard in manifest.shards]
    held = held_out_shards(manifest, 0.2, None, seed=0)
    assert len(held) == 2 and set(held) < set(names)
    assert any(held_out_shards(manifest, 0.2, None, seed=seed) != held for seed in range(1, 5))
    folds = [held_out_shards(manifest, 0, f"{i}/5", seed=0) for i in range(1, 6)]
    assert sorted(name for fold in folds for name in fold) == names  # each shard held out once
    assert len(held_out_shards(manifest, 0.01, None, seed=0)) == 1  # at least one
    with pytest.raises(UserError, match="--val-fraction 0.96 of 10 shard.* holds out all"):
        held_out_shards(manifest, 0.96, None, seed=0)
    with pytest.raises(UserError, match="10 shard.* cannot be split into 11 folds"):
        held_out_shards(manifest, 0, "1/11", seed=0)


@inprocess
def test_imdb_on_text_shards_resumed_mid_epoch_with_another_worker_count_ends_bitwise(tmp_path):
    source, _ = reviews_file(tmp_path, 96)
    write_text_shards(source, tmp_path / "shards", samples_per_shard=20)  # 5 shards, 1 held out: 76 reviews
    args = ["--train-file", tmp_path / "shards", *SMALL_BAG, "--epochs", "2", "--batch-size", "8"]
    args += ["--checkpointing-steps", "7", "--cache-dir", tmp_path / "cache"]
    check_ok(run_script("scripts/imdb.py", *args, "--workers", "2", "--output-dir", tmp_path / "full"))
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_7", tmp_path / "cut" / "checkpoints" / "step_7")
    shutil.copy(tmp_path / "full" / "history.json", tmp_path / "cut" / "history.json")
    output = check_ok(
        run_script("scripts/imdb.py", *args, "--workers", "0", "--output-dir", tmp_path / "cut", "--resume", "latest")
    )
    assert "skipping 7 batches" in output, output[-2000:]
    full, resumed = (load_file(tmp_path / run / "model.safetensors") for run in ("full", "cut"))
    assert all((full[key] == resumed[key]).all() for key in full)
    # other shards (the same reviews in another order) are other data: the resume is refused
    shutil.rmtree(tmp_path / "shards")
    write_text_shards(source, tmp_path / "shards", samples_per_shard=20, seed=1)
    output = run_script("scripts/imdb.py", *args, "--output-dir", tmp_path / "cut", "--resume", "latest")
    assert_clean_error(output, "train data: shard 000000.jsonl changed, shard 000001.jsonl changed")


@pytest.mark.multiprocess
def test_imdb_on_text_shards_bucketed_by_length_trains_bitwise_the_same_on_1_and_2_processes(tmp_path):
    # each process pads to its global micro-batch's width: 1 x 8 and 2 x 4 compute every piece of 2 reviews alike
    source, _ = reviews_file(tmp_path, 96)
    write_text_shards(source, tmp_path / "shards", samples_per_shard=16)  # 6 shards, 1 held out: 10 steps of 8
    args = ["--train-file", tmp_path / "shards", *SMALL_BAG, "--sparse", "off", "--exact-micro-batch", "2"]
    args += ["--epochs", "2", "--cache-dir", tmp_path / "cache"]
    check_ok(launch("scripts/imdb.py", *args, "--batch-size", "8", "--output-dir", tmp_path / "one", nproc=1))
    check_ok(launch("scripts/imdb.py", *args, "--batch-size", "4", "--output-dir", tmp_path / "two", nproc=2))
    assert_same_weights(tmp_path / "one", tmp_path / "two")


@inprocess
def test_a_refused_resume_names_the_shards_that_changed_went_or_came():
    from ddp_accel.identity import compare_identity, make_identity, shards_identity

    saved = make_identity(
        {"lr": 0.1}, {"train data": shards_identity({"a.jsonl": "1", "b.jsonl": "2", "c.jsonl": "3"})}
    )
    now = make_identity({"lr": 0.1}, {"train data": shards_identity({"a.jsonl": "1", "b.jsonl": "9", "d.jsonl": "4"})})
    assert compare_identity(saved, saved, "the checkpoint") is None
    with pytest.raises(UserError) as refused:
        compare_identity(saved, now, "the checkpoint")
    assert "train data: shard b.jsonl changed, shard c.jsonl is gone, shard d.jsonl is new since the checkpoint" in str(
        refused.value
    )


@pytest.mark.multiprocess
def test_a_bad_text_shard_met_by_the_vocabulary_s_pass_is_one_line_on_2_processes(tmp_path):
    # the pass runs on rank 0 inside main_process_first: its error reaches rank 1 instead of leaving it at the barrier
    source, _ = reviews_file(tmp_path, 40)
    shards = tmp_path / "shards"
    write_text_shards(source, shards, samples_per_shard=10)
    first = shards / "000000.jsonl"
    lines = first.read_text().splitlines(keepends=True)
    first.write_text(
        "".join(
            [*lines[:2], lines[2].replace('"label": 1', '"label": 7').replace('"label": 0', '"label": 8'), *lines[3:]]
        )
    )
    (shards / "manifest.json").unlink()
    args = ["--train-file", shards, *SMALL_BAG, "--max-steps", "1", "--cache-dir", tmp_path / "cache"]
    result = launch("scripts/imdb.py", *args, "--output-dir", tmp_path / "run")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"shard {first}: line 3 has the label" in errors[0], output[-3000:]
    assert "lost contact" not in output, output[-3000:]  # rank 1 ended on the same error, not on a lost peer
    assert re.search(r"traceback\s*:\s*error: shard", output), output[-3000:]  # the launcher's report: our line


@inprocess
def test_bad_text_shards_are_one_line_naming_the_shard_and_the_row(tmp_path):
    source, _ = reviews_file(tmp_path, 40)
    shards = tmp_path / "shards"
    write_text_shards(source, shards, samples_per_shard=10)
    args = ["--train-file", shards, *SMALL_BAG, "--max-steps", "1", "--cache-dir", tmp_path / "cache"]
    first = shards / "000000.jsonl"
    lines = first.read_text().splitlines(keepends=True)
    changed = lines[2].replace('"label": 1', '"label": 7').replace('"label": 0', '"label": 8')
    first.write_text("".join([*lines[:2], changed, *lines[3:]]))  # the same size, another content
    output = run_script("scripts/imdb.py", *args, "--output-dir", tmp_path / "a")
    assert_clean_error(output, f"shard {first} changed since its manifest.json was written")
    (shards / "manifest.json").unlink()  # without a manifest, the row itself is read and named
    output = run_script("scripts/imdb.py", *args, "--output-dir", tmp_path / "b")
    assert_clean_error(output, f"shard {first}: line 3 has the label")
    for shard in shards.glob("*.jsonl"):
        shard.with_suffix(".jsonl.gz").write_bytes(gzip.compress(shard.read_bytes()))
        shard.unlink()
    output = run_script("scripts/imdb.py", *args, "--output-dir", tmp_path / "c")
    assert_clean_error(output, "a compressed file cannot be read in place")
    write_text_shards(source, tmp_path / "parquet", samples_per_shard=10, kind="parquet")
    cut = tmp_path / "parquet" / "000001.parquet"
    cut.write_bytes(cut.read_bytes()[:-100])
    (tmp_path / "parquet" / "manifest.json").unlink()  # else named by its size: the footer itself is read
    output = run_script("scripts/imdb.py", *args[2:], "--train-file", tmp_path / "parquet", "--output-dir", tmp_path)
    assert_clean_error(output, f"shard {cut} cannot be read")
