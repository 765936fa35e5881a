"""examples/train_vit.py (a ViT on scikit-learn's digits), launched under its own mpiexec."""
import re
import sys

import pytest
from conftest import REPO, launch_env, mpiexec_argv, run_command


def train_vit(n, args, timeout_s=240):
    return run_command(mpiexec_argv(n) + [sys.executable, REPO / "examples" / "train_vit.py", *args],
                       outer_timeout_s=timeout_s, env=launch_env())


@pytest.mark.slow
@pytest.mark.parametrize("engine", [[], ["--zero-stage", "3"]], ids=["dp", "zero3"])
def test_100_steps_at_2_ranks_learn_the_digits(engine):
    proc = train_vit(2, ["--steps", "100", "--log-every", "25", *engine])
    assert proc.returncode == 0, str(proc)
    losses = [float(m.group(1)) for m in re.finditer(r"^step \d+ loss ([\d.]+)", proc.stdout, re.M)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5, str(proc)
    found = re.search(r"^held-out accuracy ([\d.]+) \((\d+)/359\)", proc.stdout, re.M)
    assert found and float(found.group(1)) > 0.4, str(proc)  # chance is 0.1
    assert "2 rank(s)" in proc.stdout


def test_a_bad_flag_exits_2_with_one_error_line():
    proc = train_vit(2, ["--batch", "1"], timeout_s=120)
    assert proc.returncode == 2 and not proc.outer_timeout, str(proc)
    assert "global batch 1 is smaller than the data-parallel size 2" in proc.stderr
    assert proc.stderr.count("error: ") == 1 and "Traceback" not in proc.stderr, proc.stderr
