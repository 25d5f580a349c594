"""--checkpointing-steps auto: the Young/Daly interval from the run's own measurements, the same on every rank."""

import math
import re

import pytest
from helpers import check_ok, checkpoint_steps, launch, run_script

from ddp_accel import interval
from ddp_accel.interval import AutoInterval, best_interval_s, expected_mtbf_s

inprocess, multiprocess = pytest.mark.inprocess, pytest.mark.multiprocess


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def time(self):
        return 1000.0 + self.now


@inprocess
def test_the_interval_is_daly_s_optimum_and_the_mtbf_learns_from_restarts():
    assert best_interval_s(0.5, 3600) == pytest.approx(math.sqrt(2 * 0.5 * 3600) - 0.5)
    assert best_interval_s(2000, 3600) == 3600  # a save longer than half the MTBF: once per MTBF
    assert expected_mtbf_s(24 * 3600, 0, 0) == 24 * 3600  # nothing observed: the prior
    assert expected_mtbf_s(24 * 3600, 3600, 2) == pytest.approx(25 * 3600 / 3)  # two restarts in an hour


@pytest.mark.parametrize("covered", [False, True])
@inprocess
def test_auto_saves_after_the_probe_then_at_the_interval_its_measurements_give(monkeypatch, covered):
    clock = FakeClock()
    monkeypatch.setattr(interval, "time", clock)
    auto = AutoInterval(mtbf_s=3600.0, covered=covered, restarts=1, launched_at=1000.0)
    due = []
    for step in range(1, interval.PROBE_STEPS + 1):  # 0.1 s a step; asked twice a step, as the loop does
        clock.now += 0.1
        due.append(auto.due(step))
        assert auto.due(step) == due[-1]
    assert due == [False] * (interval.PROBE_STEPS - 1) + [True]  # the probe's save
    auto.saved(interval.PROBE_STEPS, stall_s=0.5)
    mtbf = (clock.time() - 1000.0 + 3600.0) / 2  # one restart seen
    needing = mtbf / interval.UNCOVERED_SHARE if covered else mtbf
    steps = round((math.sqrt(2 * 0.5 * needing) - 0.5) / 0.1)
    assert auto.chosen is not None and auto.chosen[0] == steps
    assert auto.next_step == interval.PROBE_STEPS + steps
    assert not auto.due(auto.next_step - 1) and auto.due(auto.next_step)
    assert ("those a survivor's save cannot cover" in auto.describe()) == covered


@inprocess
def test_a_bad_checkpointing_steps_value_is_one_line(tmp_path):
    result = run_script("tests/probe.py", "--output-dir", tmp_path / "out", "--checkpointing-steps", "often")
    assert result.returncode == 2 and "a number of steps, 'epoch' or 'auto'" in result.stderr, result.stderr[-2000:]


@multiprocess
def test_two_ranks_agree_on_the_interval_they_measure_and_save_at_it(tmp_path):
    # each rank measures its own stall and pace; they save at the slowest rank's interval, together (else a hang)
    output_dir = tmp_path / "auto"
    args = ["--batch-size", "4", "--epochs", "6", "--train-size", "256", "--step-ms", "20"]
    args += ["--checkpointing-steps", "auto", "--mtbf", "1s"]
    output = check_ok(launch("tests/probe.py", "--output-dir", output_dir, *args))
    assert "checkpointing" in output and "Young/Daly" in output, output[-3000:]
    chosen = [int(match) for match in re.findall(r"checkpoints: every (\d+) steps", output)]
    assert chosen, output[-3000:]
    steps = checkpoint_steps(output_dir)
    assert steps[0] == interval.PROBE_STEPS, steps
    assert len(steps) >= 2 and steps[1] - steps[0] == chosen[0], (steps, chosen, output[-3000:])
