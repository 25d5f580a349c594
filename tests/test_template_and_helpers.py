"""scripts/template.py end to end, plus the small helpers (CLI aliases, plain-DDP checkpoint import)."""

import pytest
import torch
from helpers import check_ok, launch, metrics_of, run_script

from ddp_accel import ArgumentParser, UserError, add_training_args
from ddp_accel.plain_ddp import load_plain_ddp_checkpoint


@pytest.mark.multiprocess
def test_template_trains_validates_and_tests_on_two_processes_with_sync_bn(tmp_path):
    output = check_ok(
        launch(
            "scripts/template.py",
            "--output-dir",
            tmp_path,
            "--epochs",
            4,
            "--eval-interval",
            2,
            "--checkpointing-steps",
            "epoch",
            "--sync-bn",
        )
    )
    assert "SyncBatchNorm: 1 layers converted" in output  # on CPU processes too (its numbers: the test below)
    metrics = metrics_of(tmp_path)
    assert metrics["world_size"] == 2
    assert metrics["test_samples"] == 500 and metrics["eval_samples"] == 500
    assert metrics["test_accuracy"] > 0.9, metrics
    evaluations = [line for line in output.splitlines() if line.startswith("step ") and "eval_accuracy" in line]
    assert len(evaluations) == 2  # validated after epochs 2 and 4 only
    assert len(list((tmp_path / "checkpoints").iterdir())) == 4


@pytest.mark.inprocess
def test_template_no_val_then_resume(tmp_path):
    check_ok(
        run_script(
            "scripts/template.py",
            "--output-dir",
            tmp_path,
            "--epochs",
            2,
            "--no-val",
            "--checkpointing-steps",
            "epoch",
        )
    )
    output = check_ok(
        run_script(
            "scripts/template.py",
            "--output-dir",
            tmp_path,
            "--epochs",
            3,
            "--no_val",
            "--checkpointing_steps",
            "epoch",
            "--resume_from_checkpoint",
            "latest",
        )
    )
    assert "resumed from" in output and "eval_accuracy" not in output
    assert metrics_of(tmp_path)["test_samples"] == 500


@pytest.mark.multiprocess
def test_cpu_sync_batchnorm_equals_batchnorm_over_the_global_batch():
    # 2 ranks with 4 samples each == BatchNorm2d over all 8: outputs, input/weight grads, running stats
    output = check_ok(launch("tests/sync_bn_check.py", launcher="torchrun"))
    assert output.count("sync batchnorm matches the full batch") == 2


@pytest.mark.inprocess
def test_a_mistyped_option_gets_a_suggestion(capsys):
    parser = add_training_args(ArgumentParser(prog="x"))
    for typo, meant in (("--output-dri", "--output-dir"), ("--checkpointing_step", "--checkpointing-steps")):
        with pytest.raises(SystemExit):
            parser.parse_args([typo, "1"])
        assert f"did you mean {meant}?" in capsys.readouterr().err


@pytest.mark.inprocess
def test_underscore_and_dash_spellings_are_the_same_option():
    parser = add_training_args(ArgumentParser())
    dashed = parser.parse_args(["--output-dir", "a", "--max-grad-norm", "0.1", "--checkpointing-steps", "epoch"])
    underscored = parser.parse_args(["--output_dir=a", "--max_grad_norm", "0.1", "--checkpointing_steps", "epoch"])
    assert vars(dashed) == vars(underscored)
    assert dashed.checkpointing_steps == "epoch"


@pytest.mark.parametrize("prefix", ["module.", ""])
@pytest.mark.inprocess
def test_load_checkpoint_of_a_plain_ddp_script(tmp_path, prefix):
    source = torch.nn.Linear(10, 10)
    optimizer = torch.optim.SGD(source.parameters(), lr=0.1, momentum=0.9)
    source(torch.randn(2, 10)).sum().backward()
    optimizer.step()
    state = {prefix + key: value for key, value in source.state_dict().items()}
    torch.save(
        {
            "epoch": 3,
            "step": 500,
            "model_state_dict": state,
            "optimizer_state_dict": optimizer.state_dict(),
            "loss": 0.25,
        },
        tmp_path / "ckpt.pt",
    )
    target = torch.nn.Linear(10, 10)
    target_optimizer = torch.optim.SGD(target.parameters(), lr=0.1, momentum=0.9)
    extra = load_plain_ddp_checkpoint(tmp_path / "ckpt.pt", target, target_optimizer)
    assert extra == {"epoch": 3, "step": 500, "loss": 0.25}
    torch.testing.assert_close(target.weight, source.weight, rtol=0, atol=0)
    assert target_optimizer.state_dict()["state"]  # momentum buffers came along
    with pytest.raises(UserError, match="does not fit this model"):
        load_plain_ddp_checkpoint(tmp_path / "ckpt.pt", torch.nn.Linear(10, 3))
