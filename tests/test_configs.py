"""Every shipped accelerate YAML loads with accelerate's own loader; those that can run on CPU do run."""

import subprocess

import accelerate
import pytest
from accelerate.commands.config.config_args import load_config_from_file
from helpers import BIN, ROOT, check_ok, free_port, metrics_of

from ddp_accel import sharding, versions
from ddp_accel.__main__ import main as ddp_accel_main

CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))


@pytest.mark.inprocess
def test_every_topology_has_a_config():
    assert {path.stem for path in CONFIGS} >= {"cpu", "single_gpu", "multi_gpu", "multi_node", "fsdp"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
@pytest.mark.inprocess
def test_config_loads_and_documents_itself(path):
    config = load_config_from_file(str(path))
    assert config.num_processes >= 1
    first_lines = path.read_text().splitlines()[:3]
    assert all(line.startswith("#") for line in first_lines), "each YAML opens with a comment block"
    assert ddp_accel_main(["check-config", str(path)]) == 0


# multi_gpu.yaml with 2 processes: the shared short job (tests/conftest.py, accelerate launch); cpu.yaml:
# test_training.py's dynamo test launches it
@pytest.mark.parametrize("name,world_size", [("single_gpu", 1)])
@pytest.mark.multiprocess
def test_cpu_runnable_configs_launch(tmp_path, name, world_size):
    result = subprocess.run(
        [
            str(BIN / "accelerate"),
            "launch",
            "--config_file",
            str(ROOT / "accelerate_configs" / f"{name}.yaml"),
            "--main_process_port",
            str(free_port()),
            str(ROOT / "scripts" / "minimal.py"),
            "--output-dir",
            str(tmp_path),
            "--epochs",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    check_ok(result)
    assert metrics_of(tmp_path)["world_size"] == world_size


def fsdp_yaml(tmp_path, old: str, new: str):
    """accelerate_configs/fsdp.yaml with one setting changed."""
    text = (ROOT / "accelerate_configs" / "fsdp.yaml").read_text()
    assert old in text
    path = tmp_path / "fsdp_variant.yaml"
    path.write_text(text.replace(old, new))
    return path


# each a class of mistake: a misspelt key, a version or value Accelerate has not, a state-dict type FSDP2 has not,
# and what a machine without GPUs cannot run (they passed check-config, then every rank ended in a traceback)
FSDP_REFUSED = [
    ("fsdp_version: 2", "fsdp_versoin: 2", "fsdp_config has no key fsdp_versoin: did you mean fsdp_version?"),
    ("fsdp_version: 2", "fsdp_version: 3", "fsdp_version 3: Accelerate has FSDP 1 and 2"),
    ("SHARDED_STATE_DICT", "LOCAL_STATE_DICT", "FSDP2 does not support LOCAL_STATE_DICT"),
    ("SIZE_BASED_WRAP", "BOGUS_WRAP", "Invalid auto wrap policy: BOGUS_WRAP"),
    ("fsdp_reshard_after_forward: true", "fsdp_reshard_after_forward: maybe", "invalid truth value maybe"),
    ("fsdp_cpu_ram_efficient_loading: false", "fsdp_cpu_ram_efficient_loading: true", "accelerate#3898"),
    ("fsdp_version: 2", "fsdp_version: 1", "runs torch's FSDP2 only: set `fsdp_version: 2`"),
]


@pytest.mark.parametrize(
    "old, new, fragment", FSDP_REFUSED, ids=[case[1].split(":")[0] + case[1][-6:] for case in FSDP_REFUSED]
)
@pytest.mark.inprocess
def test_check_config_knows_what_accelerate_reads_of_an_fsdp_config(tmp_path, capsys, old, new, fragment):
    from ddp_accel.runtime import has_accelerator

    if has_accelerator() and ("ram_efficient" in new or "version: 1" in new):
        pytest.skip("refused on machines without GPUs only")
    path = fsdp_yaml(tmp_path, old, new)
    if "ram_efficient" in new and versions.major_minor(accelerate.__version__) >= sharding.LOADING_KEEPS_BUFFERS:
        assert ddp_accel_main(["check-config", str(path)]) == 0  # (tests/test_fsdp.py trains with it)
        return
    machine_s = "ram_efficient" in new or "version: 1" in new  # what a machine without GPUs lacks: valid elsewhere
    assert ddp_accel_main(["check-config", str(path)]) == (3 if machine_s else 2)
    err = capsys.readouterr().err
    said = "valid, but not on this machine: " if machine_s else "error: "
    assert err.count(said) == 1 and fragment in err and "Traceback" not in err, err


@pytest.mark.inprocess
def test_an_fsdp1_key_in_an_fsdp2_config_is_said_to_change_nothing(tmp_path, capsys):
    path = fsdp_yaml(tmp_path, "  fsdp_version: 2\n", "  fsdp_version: 2\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n")
    assert ddp_accel_main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "fsdp_sharding_strategy changes nothing under fsdp_version 2 (Accelerate ignores it)" in out, out
    assert "fsdp_state_dict_type changes nothing" not in out  # (a key at FSDP2's own default is not ignored)


# what a launched script meets at each boundary: the file it was launched with (a key accelerate launch drops without
# a word), Accelerate's plugin built from it, and Accelerate's prepare of the model
LAUNCH_REFUSED = [
    ("fsdp_offload_params: false", "fsdp_offload_parms: true", "fsdp_config has no key fsdp_offload_parms"),
    ("SIZE_BASED_WRAP", "BOGUS_WRAP", "Invalid auto wrap policy: BOGUS_WRAP"),
    (
        "SIZE_BASED_WRAP",
        "TRANSFORMER_BASED_WRAP\n  fsdp_transformer_layer_cls_to_wrap: NoSuchLayer",
        "fsdp_config.fsdp_transformer_layer_cls_to_wrap NoSuchLayer: Could not find the transformer layer class "
        "NoSuchLayer in the model; name classes of the model's layers",
    ),
]


@pytest.mark.parametrize("old, new, line", LAUNCH_REFUSED, ids=["typo", "plugin", "prepare"])
@pytest.mark.multiprocess
def test_a_launch_of_an_fsdp_config_accelerate_cannot_run_is_one_line_naming_the_setting(tmp_path, old, new, line):
    path = fsdp_yaml(tmp_path, old, new)
    command = [str(BIN / "accelerate"), "launch", "--config_file", str(path), "--main_process_port", str(free_port())]
    command += [str(ROOT / "scripts" / "minimal.py"), "--output-dir", str(tmp_path / "out")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and len(lines) == 1, result.stderr[-3000:]  # one per run
    assert lines[0].startswith(f"error: {path}: ") and line in lines[0], lines
    assert "Traceback (most recent call last)" not in result.stderr.split("error: ")[0], result.stderr[-3000:]
    assert not (tmp_path / "out").exists()
