"""--skip-bad-samples N (ddp_accel.bad_samples): a training sample that cannot be read is replaced by the next
readable one, said once, listed and counted; one more than N is the error it would have been without the option."""

import json
import pickle

import pytest
import torch
from helpers import assert_clean_error, assert_same_weights, check_ok, metrics_of, run_script
from test_imagenet import SMALL_ARCH, make_image_folder
from test_text_shards import SMALL_BAG, reviews_file

from ddp_accel.bad_samples import BadSample, SkippingBadSamples, listed
from ddp_accel.streaming import read_members
from ddp_accel.text.streamed import write_text_shards
from ddp_accel.vision.shards import write_shards

pytestmark = pytest.mark.inprocess
IMAGENET = ["-a", SMALL_ARCH, "--image-size", "16", "--augment", "cifar", "-b", "2", "--epochs", "2"]


class Numbers(torch.utils.data.Dataset):
    """0..size-1, where the indices in `bad` cannot be read."""

    def __init__(self, size: int, bad: set[int]):
        self.size, self.bad, self.epoch = size, bad, 0

    def __len__(self) -> int:
        return self.size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getitem__(self, index: int) -> int:
        if index in self.bad:
            raise BadSample(f"sample {index} cannot be read")
        return index


def test_a_bad_sample_is_replaced_by_the_next_readable_one_said_once_and_listed(tmp_path, capsys):
    log = tmp_path / "bad_samples.jsonl"
    numbers = SkippingBadSamples(Numbers(8, {2, 3, 7}), log, limit=3)
    assert [numbers[index] for index in range(8)] == [0, 1, 4, 4, 4, 5, 6, 0]  # the last wraps to the first
    assert listed(log) == {2: "sample 2 cannot be read", 3: "sample 3 cannot be read", 7: "sample 7 cannot be read"}
    said = capsys.readouterr().err
    assert said.count("warning: skipped a bad sample") == 3 and "(3 of at most 3): sample 7" in said
    # another process (a worker of the next epoch, another rank) meets them again: nothing said, nothing added
    again = pickle.loads(pickle.dumps(numbers))
    again.set_epoch(1)  # the dataset's own attributes are reached through the wrapper
    assert again.dataset.epoch == 1 and [again[index] for index in (2, 7)] == [4, 0]
    assert "warning" not in capsys.readouterr().err and len(log.read_text().splitlines()) == 3


def test_one_bad_sample_more_than_the_limit_is_its_own_error(tmp_path):
    numbers = SkippingBadSamples(Numbers(6, {1, 4}), tmp_path / "bad_samples.jsonl", limit=1)
    assert numbers[1] == 2
    with pytest.raises(BadSample, match=r"sample 4 cannot be read \(bad sample 2: more than --skip-bad-samples 1\)"):
        numbers[4]


def corrupt_an_image(shards, number: int) -> str:
    """Overwrite the image bytes of the training shards' `number`-th sample (its size, and so the manifest, kept);
    returns its key."""
    shard = sorted((shards / "train").glob("*.tar"))[0]
    member = read_members(shard)[number]
    offset, size = member.files["png"] if "png" in member.files else member.files["jpg"]
    with open(shard, "r+b") as file:
        file.seek(offset)
        file.write(b"\0" * size)
    return member.key


def test_imagenet_on_shards_skips_a_bad_image_the_same_with_1_and_2_workers(tmp_path):
    images = make_image_folder(tmp_path / "images", classes=2, train=4, val=1)
    shards = tmp_path / "shards"
    write_shards(images, shards, samples_per_shard=10)
    key = corrupt_an_image(shards, 3)
    assert_clean_error(run_script("scripts/imagenet.py", shards, *IMAGENET, "--output-dir", tmp_path / "refused"), key)
    outputs = {}
    for workers in (1, 2):
        run = tmp_path / f"j{workers}"
        args = [*IMAGENET, "-j", workers, "--skip-bad-samples", "1", "--output-dir", run]
        outputs[workers] = check_ok(run_script("scripts/imagenet.py", shards, *args))
        assert metrics_of(run)["bad_samples"] == 1
        assert [json.loads(line)["index"] for line in (run / "bad_samples.jsonl").read_text().splitlines()] == [3]
    # (a worker's warning goes to its own stderr: the first test reads it)
    assert f"skipped 1 bad sample(s), listed in {tmp_path / 'j2' / 'bad_samples.jsonl'}" in outputs[2]
    assert_same_weights(tmp_path / "j1", tmp_path / "j2")
    second = corrupt_an_image(shards, 5)
    args = [*IMAGENET, "-j", 0, "--skip-bad-samples", "1", "--output-dir", tmp_path / "over"]
    assert_clean_error(run_script("scripts/imagenet.py", shards, *args), second, "more than --skip-bad-samples 1")


def test_an_image_folder_s_unreadable_image_is_skipped_as_a_shard_s_is(tmp_path):
    images = make_image_folder(tmp_path / "images", classes=2, train=4, val=1)
    (images / "train" / "class1" / "2.jpg").write_bytes(b"not an image")
    args = [*IMAGENET, "-j", 0, "--epochs", "1", "--output-dir", tmp_path / "run"]
    assert_clean_error(run_script("scripts/imagenet.py", images, *args), "cannot read image", "class1/2.jpg")
    output = check_ok(run_script("scripts/imagenet.py", images, *args, "--skip-bad-samples", "3"))
    assert "warning: skipped a bad sample (1 of at most 3): cannot read image" in output
    assert metrics_of(tmp_path / "run")["bad_samples"] == 1


def test_a_bad_review_of_text_shards_is_left_out_of_the_vocabulary_and_skipped(tmp_path):
    source, _ = reviews_file(tmp_path, 40)
    shards = tmp_path / "shards"
    write_text_shards(source, shards, samples_per_shard=10)
    first = sorted(shards.glob("*.jsonl"))[0]
    lines = first.read_text().splitlines(keepends=True)
    first.write_text("".join([*lines[:2], "not json\n", *lines[3:]]))
    (shards / "manifest.json").unlink()  # read from the shards themselves
    args = ["--train-file", shards, *SMALL_BAG, "--max-steps", "4", "--val-fraction", "0"]
    refused = run_script("scripts/imdb.py", *args, "--cache-dir", tmp_path / "c1", "--output-dir", tmp_path / "a")
    assert_clean_error(refused, f"shard {first}: line 3 is not JSON")
    skip = ["--skip-bad-samples", "1", "--cache-dir", tmp_path / "c2", "--output-dir", tmp_path / "b"]
    output = check_ok(run_script("scripts/imdb.py", *args, *skip))
    assert "line 3 is not JSON" in output and metrics_of(tmp_path / "b")["bad_samples"] == 1


def test_a_script_whose_loader_reads_its_samples_itself_refuses_the_option(tmp_path):
    result = run_script("scripts/minimal.py", "--skip-bad-samples", "2", "--output-dir", tmp_path)
    assert_clean_error(result, "--skip-bad-samples 2", "run.skipping_bad_samples(dataset)")
