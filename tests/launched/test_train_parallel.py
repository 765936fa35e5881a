"""examples/train.py with tensor (--tp) and sequence (--sp) parallelism, launched on 2 ranks (the
4-rank layouts run in tests/mpi/test_tensor_parallel.py): the loss curve of every layout is the
data-parallel one, and a checkpoint moves between layouts."""
import json
import sys

import pytest
from conftest import REPO, launch_env, mpiexec_argv, run_command

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


def test_tp_and_sp_layouts_follow_the_data_parallel_loss_curve_across_a_checkpoint(tmp_path):
    proc, reference = train(tmp_path, 2, ["--dp", "2"], "dp2")
    assert proc.returncode == 0, str(proc)
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


@pytest.mark.parametrize("args, message", [
    (["--dp", "2", "--tp", "2"], "dp(2) * tp(2) * pp(1) * sp(1) = 4 != world_size(2)"),
    (["--sp", "2", "--seq-len", "31"], "sequence length 31 is not divisible by sp(2)"),
    (["--tp", "2", "--zero-stage", "1"], "ZeRO stage 1 with tp(2) or sp(1) > 1 is not supported"),
])
def test_bad_layouts_exit_2_with_one_line_error(tmp_path, args, message):
    proc, _ = train(tmp_path, 2, args)
    assert proc.returncode == 2 and not proc.outer_timeout, str(proc)
    assert message in proc.stderr, proc.stderr
    assert proc.stderr.count("error: ") == 1 and "Traceback" not in proc.stderr
