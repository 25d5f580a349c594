"""The accelerate config file a process runs under (ddp_accel/config_file.py): the file an `accelerate launch` command
line gives its script, refused as check-config refuses it; check-config's two kinds of problem (invalid anywhere,
exit 2; valid but not on this machine, exit 3); an error raised while the Accelerator is built or prepares, told in
one line by the setting it names. The launched runs are in tests/test_configs.py."""

import pytest
from helpers import ROOT

from ddp_accel.__main__ import main as ddp_accel_main
from ddp_accel.config_file import (
    NotOnThisMachine,
    Setting,
    check_launched_config,
    has_accelerator,
    launched_config,
    settings_named,
)
from ddp_accel.errors import UserError

pytestmark = pytest.mark.inprocess
CONFIGS = ROOT / "accelerate_configs"


def variant(tmp_path, name: str, old: str, new: str):
    text = (CONFIGS / name).read_text()
    assert old in text
    path = tmp_path / f"variant_{name}"
    path.write_text(text.replace(old, new))
    return path


def launch(*arguments) -> list[str]:
    return ["/venv/bin/python", "/venv/bin/accelerate", "launch", *map(str, arguments), "train.py", "--lr", "0.1"]


def test_the_config_file_of_an_accelerate_launch_command_line(tmp_path, monkeypatch):
    path = CONFIGS / "multi_gpu.yaml"
    assert launched_config(launch("--config_file", path, "--num_processes", 2)) == str(path)
    assert launched_config(launch(f"--config-file={path}")) == str(path)
    assert launched_config(["python", "-m", "accelerate.commands.launch", "--config_file", str(path), "t.py"]) == str(
        path
    )
    assert launched_config(["torchrun", "--nproc_per_node", "2", "train.py", "--config_file", "x.yaml"]) is None
    # without --config_file: Accelerate's default file where there is one (HF_HOME holds it)
    from accelerate.commands.config import config_args

    monkeypatch.setattr(config_args, "default_config_file", str(tmp_path / "default_config.yaml"))
    assert launched_config(launch("--num_processes", 2)) is None
    (tmp_path / "default_config.yaml").write_text((CONFIGS / "cpu.yaml").read_text())
    assert launched_config(launch("--num_processes", 2)) == str(tmp_path / "default_config.yaml")
    assert launched_config(launch("--cpu", "--num_processes", 2)) is None  # (accelerate launch skips it too)


def test_a_launched_script_refuses_its_file_as_check_config_does(tmp_path):
    # a misspelt key in fsdp_config: accelerate launch drops it before the script starts, and the run would train
    # without it; a precision this machine cannot run
    typo = variant(tmp_path, "fsdp.yaml", "fsdp_offload_params: false", "fsdp_offload_parms: true")
    with pytest.raises(UserError, match="fsdp_config has no key fsdp_offload_parms: did you mean fsdp_offload_params"):
        check_launched_config(launch("--config_file", typo))
    assert ddp_accel_main(["check-config", str(typo)]) == 2
    for name in ("multi_gpu.yaml", "fsdp.yaml", "cpu.yaml"):
        check_launched_config(launch("--config_file", CONFIGS / name))
    check_launched_config(["torchrun", "train.py"])  # no file: nothing to check
    if has_accelerator():
        return
    fp16 = variant(tmp_path, "multi_gpu.yaml", "mixed_precision: 'no'", "mixed_precision: fp16")
    with pytest.raises(NotOnThisMachine, match="mixed_precision fp16 needs a GPU, and this machine has none"):
        check_launched_config(launch("--config_file", fp16))
    check_launched_config(launch("--config_file", fp16), precision="bf16")  # the run's own, over the file's


def test_check_config_tells_invalid_anywhere_from_valid_but_not_on_this_machine(tmp_path, capsys):
    fp8 = variant(tmp_path, "multi_gpu.yaml", "mixed_precision: 'no'", "mixed_precision: fp8")
    bad = variant(tmp_path, "cpu.yaml", "num_machines: 1", "num_machines: zero")
    assert ddp_accel_main(["check-config", str(CONFIGS / "multi_gpu.yaml")]) == 0
    assert ddp_accel_main(["check-config", str(fp8)]) == 3  # (no fp8 backend is installed here)
    err = capsys.readouterr().err
    assert err.startswith("valid, but not on this machine: ") and "mixed_precision fp8 needs one of" in err, err
    assert ddp_accel_main(["check-config", str(fp8), str(bad)]) == 2  # invalid anywhere wins
    err = capsys.readouterr().err
    assert err.count("error: ") == 1 and "num_machines must be a whole number" in err, err


SETTINGS = (
    Setting("mixed_precision", "fp8", "my.yaml"),
    Setting("fsdp_config.fsdp_transformer_layer_cls_to_wrap", "Block,NoSuchLayer", "my.yaml"),
    Setting("fsdp_config.fsdp_version", "2", "my.yaml"),
    Setting("main_training_function", "main", "my.yaml"),
    Setting("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR", "the environment"),
)


def raised_in(error: Exception, hints=None) -> BaseException:
    with pytest.raises(BaseException) as raised, settings_named(hints, SETTINGS):
        raise error
    return raised.value


def test_an_error_that_names_a_setting_is_one_line_naming_it_and_its_fix():
    error = raised_in(ValueError("Could not find the transformer layer class NoSuchLayer in the model."))
    assert isinstance(error, UserError) and str(error) == (
        "my.yaml: fsdp_config.fsdp_transformer_layer_cls_to_wrap Block,NoSuchLayer: Could not find the transformer "
        "layer class NoSuchLayer in the model; change it in my.yaml; `ddp-accel check-config FILE` checks a file "
        "before a launch"
    )
    hinted = raised_in(ValueError("no layer class NoSuchLayer"), lambda: {"fsdp_transformer_layer_cls_to_wrap": "X"})
    assert str(hinted).endswith("; X")
    error = raised_in(RuntimeError("Using `fp8` precision requires\n `transformer_engine` to be installed."))
    assert "my.yaml: mixed_precision fp8: Using `fp8` precision requires `transformer_engine` to be installed" in str(
        error
    ) and "mixed_precision takes no, bf16" in str(error)
    # a setting's key named in the message; an environment variable's fix by its option's name
    assert str(raised_in(ValueError("bad fsdp_version"))).startswith("my.yaml: fsdp_config.fsdp_version 2: bad")
    assert "ACCELERATE_DYNAMO_BACKEND INDUCTOR" in str(raised_in(TypeError("backend INDUCTOR is not known")))


def test_an_error_that_names_no_setting_stays_as_it_was():
    # numbers, common words and parts of longer names point at no setting: the error is not the config's
    for message in ("tensor 2 has no grad", "the main process failed", "NoSuchLayerNorm missing", "fp80 overflow"):
        error = ValueError(message)
        assert raised_in(error) is error
    # what only the launcher reads is no setting of the Accelerator's: torch's messages name "c10d" often
    from ddp_accel.config_file import settings_in

    read = settings_in(
        {"rdzv_backend": "c10d", "num_processes": 8, "distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}},
        "my.yaml",
    )
    assert read == [Setting("fsdp_config.fsdp_version", "2", "my.yaml")]
    mistake = UserError("a user's mistake, said as it is")
    assert raised_in(mistake) is mistake
    with pytest.raises(KeyboardInterrupt), settings_named(None, SETTINGS):
        raise KeyboardInterrupt
