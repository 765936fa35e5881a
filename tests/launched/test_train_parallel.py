"""examples/train.py with tensor (--tp) and sequence (--sp) parallelism, launched on 2 ranks (the
4-rank layouts run in tests/mpi/test_tensor_parallel.py): the loss curve of every layout is the
data-parallel one, and a checkpoint moves between layouts."""
import json
import sys

import pytest
from conftest import REPO, launch_env, mpiexec_argv, run_command
from train_errors import assert_one_line_error, refused

TRAIN = REPO / "examples" / "train.py"
COMMON = ["--model", "tiny", "--steps", "10", "--global-batch", "8", "--seq-len", "32",
          "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress"]


def train(tmp_path, n, args, name=None):
    metrics = tmp_path / f"{name}.jsonl" if name else None
    extra = ["--metrics-jsonl", str(metrics)] if metrics else []
    proc = run_command(mpiexec_argv(n) + [sys.executable, TRAIN, *COMMON, *args, *extra],
                       outer_timeout_s=120, env=launch_env(RTXMPI_CACHE_DIR=tmp_path / "cache"))
    losses = ([json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
              if metrics and metrics.exists() else None)
    return proc, losses


@pytest.fixture(scope="module")
def dp2_curve(tmp_path_factory):
    """The 10-step loss curve of --dp 2 (every layout's, the one-process model's)."""
    proc, reference = train(tmp_path_factory.mktemp("dp2"), 2, ["--dp", "2"], "dp2")
    assert proc.returncode == 0, str(proc)
    return reference


def test_tp_and_sp_layouts_follow_the_data_parallel_loss_curve_across_a_checkpoint(tmp_path,
                                                                                   dp2_curve):
    reference = dp2_curve
    ckpt = str(tmp_path / "ckpt")
    proc, first = train(tmp_path, 2, ["--tp", "2", "--sequence-parallel", "--ckpt-dir", ckpt,
                                      "--stop-after-step", "5"], "tp")
    assert proc.returncode == 0, str(proc)
    # resume the tp 2 checkpoint at sp 2: it holds the full model, so any layout loads it
    proc, second = train(tmp_path, 2, ["--sp", "2", "--ckpt-dir", ckpt, "--resume"], "sp")
    assert proc.returncode == 0, str(proc)
    assert "resumed from" in proc.stdout
    assert len(first) == 5 and len(second) == 5
    assert first + second == pytest.approx(reference, rel=1e-5)


def test_zero3_dp2_tp2_checkpoint_resumes_at_plain_dp4_on_the_same_curve(tmp_path, dp2_curve):
    """ZeRO-3 sharded over dp of each tp slice (rtxmpi.parallel.zero_hybrid) writes the one-process
    model, so plain data parallelism at dp 4 continues its curve (tp 4: tests/mpi/test_zero_hybrid.py;
    the tiny model's 2 heads do not split 4 ways)."""
    ckpt = str(tmp_path / "ckpt")
    proc, first = train(tmp_path, 4, ["--dp", "2", "--tp", "2", "--zero-stage", "3",
                                      "--ckpt-dir", ckpt, "--stop-after-step", "5"], "zero3")
    assert proc.returncode == 0, str(proc)
    assert "(dp 2 x tp 2 x pp 1 x sp 1)" in proc.stdout and "ZeRO stage 3" in proc.stdout
    proc, second = train(tmp_path, 4, ["--dp", "4", "--ckpt-dir", ckpt, "--resume"], "dp4")
    assert proc.returncode == 0, str(proc)
    assert "ZeRO stage 3" in proc.stdout and "resumed from" in proc.stdout
    assert len(first) == 5 and len(second) == 5
    assert first + second == pytest.approx(dp2_curve, rel=1e-5)


BAD_LAYOUTS = [  # each refused on both ranks, in one launch (tests/launched/train_errors.py)
    (["--dp", "2", "--tp", "2"], "dp(2) * tp(2) * pp(1) * sp(1) = 4 != world_size(2)"),
    (["--sp", "2", "--seq-len", "31"], "sequence length 31 is not divisible by sp(2)"),
    (["--tp", "2", "--offload", "cpu"], "--offload cpu needs --zero-stage 1, 2 or 3"),
    (["--dp", "2", "--tp", "2", "--offload", "cpu"], "2 problems: (1) dp(2) * tp(2) * pp(1) * sp(1) = 4 "
                                                     "!= world_size(2); set dp=1 or use 4 ranks; (2) "
                                                     "--offload cpu needs --zero-stage 1, 2 or 3"),
]


@pytest.fixture(scope="module")
def bad_layout_runs(tmp_path_factory):
    return refused(2, [[*COMMON, *args] for args, _ in BAD_LAYOUTS],
                   tmp_path_factory.mktemp("bad_layouts"))


@pytest.mark.parametrize("case", range(len(BAD_LAYOUTS)), ids=[m for _, m in BAD_LAYOUTS])
def test_bad_layouts_exit_2_with_one_line_error(bad_layout_runs, case):
    assert_one_line_error(bad_layout_runs[case], BAD_LAYOUTS[case][1])
