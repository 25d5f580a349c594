"""scripts/minimal.py: the same program under accelerate launch and torchrun is one world-size-2 job."""

import re

import pytest
from helpers import check_ok, launch, metrics_of, run_script


def assert_one_world_of_two(output: str, output_dir) -> None:
    # (not anchored at a line's start: two ranks' unbuffered prints can share a line, each before its newline)
    ranks = sorted(re.findall(r"rank (\d) local_rank (\d) world_size (\d)", output))
    assert ranks == [("0", "0", "2"), ("1", "1", "2")], output
    assert re.search(r"distributed_type\s+MULTI_CPU", output) and re.search(r"backend\s+gloo", output), output
    gathered = re.search(r"all_gather_object: (.*)", output).group(1)
    assert "'rank': 0" in gathered and "'rank': 1" in gathered
    metrics = metrics_of(output_dir)
    assert metrics["world_size"] == 2 and metrics["eval_samples"] == 20
    assert {p.name for p in output_dir.iterdir()} >= {"args.json", "metrics.json", "model.safetensors"}


# under accelerate launch: test_accelerate_config.py's questionnaire launches this script with the YAML it wrote
# (multi_gpu.yaml: every test of the shared short job)
@pytest.mark.multiprocess
def test_two_processes_form_one_world_under_torchrun(tmp_path):
    output = check_ok(launch("scripts/minimal.py", "--output-dir", tmp_path, launcher="torchrun"))
    assert_one_world_of_two(output, tmp_path)


@pytest.mark.parametrize("curves", [True, False], ids=["curves", "DDP_ACCEL_CURVES=0"])
@pytest.mark.inprocess
def test_single_process_plain_python(tmp_path, curves):
    output = check_ok(run_script("scripts/minimal.py", "--output-dir", tmp_path, curves=curves))
    assert "world_size 1" in output
    assert metrics_of(tmp_path)["world_size"] == 1
    # the start-up's moments, in their order (the imports are marked by a script's own start only: not in-process)
    phases = metrics_of(tmp_path)["startup_phases"]
    assert list(phases) == ["accelerator", "data_and_model", "prepared", "started", "first_batch", "first_step"]
    assert list(phases.values()) == sorted(phases.values()), phases
    # the one in-process run that draws its curves; without them the last line does not name them
    assert (tmp_path / "training_curves.png").is_file() == curves
    done = next(line for line in output.splitlines() if line.startswith("done: "))
    assert done.endswith(f"metrics.json{' and training_curves.png' if curves else ''} in {tmp_path}")
