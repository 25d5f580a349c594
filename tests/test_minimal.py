"""scripts/minimal.py: the same program under accelerate launch and torchrun is one world-size-2 job."""

import re

import pytest
from helpers import check_ok, launch, metrics_of, run_script


@pytest.mark.parametrize("launcher", ["accelerate", "torchrun"])
@pytest.mark.multiprocess
def test_two_processes_form_one_world(tmp_path, launcher):
    output = check_ok(launch("scripts/minimal.py", "--output-dir", tmp_path, launcher=launcher))
    ranks = sorted(re.findall(r"^rank (\d) local_rank (\d) world_size (\d)", output, re.M))
    assert ranks == [("0", "0", "2"), ("1", "1", "2")], output
    assert re.search(r"distributed_type\s+MULTI_CPU", output) and re.search(r"backend\s+gloo", output), output
    gathered = re.search(r"all_gather_object: (.*)", output).group(1)
    assert "'rank': 0" in gathered and "'rank': 1" in gathered
    metrics = metrics_of(tmp_path)
    assert metrics["world_size"] == 2 and metrics["eval_samples"] == 20
    assert {p.name for p in tmp_path.iterdir()} >= {"args.json", "metrics.json", "model.safetensors"}


@pytest.mark.inprocess
def test_single_process_plain_python(tmp_path):
    output = check_ok(run_script("scripts/minimal.py", "--output-dir", tmp_path, curves=True))
    assert "world_size 1" in output
    assert metrics_of(tmp_path)["world_size"] == 1
    assert (tmp_path / "training_curves.png").is_file()  # the one in-process run that draws its curves
