"""The main job, examples/train.py, launched as users launch it: under its own mpiexec."""
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "examples", "train.py")


def mpiexec(n, args, timeout_s, tmp_path):
    """Run `mpiexec -n n python examples/train.py args` with a hard outer timeout."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", RTXMPI_CACHE_DIR=str(tmp_path / "cache"))
    cmd = ["mpiexec", "--oversubscribe", "--mca", "mpi_yield_when_idle", "1", "--bind-to", "none",
           "-n", str(n), sys.executable, TRAIN, *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    return proc, time.monotonic() - start


@pytest.mark.slow
def test_train_30_steps_at_2_ranks_lowers_the_loss(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    proc, _ = mpiexec(2, ["--model", "tiny", "--steps", "30", "--global-batch", "16",
                          "--seq-len", "64", "--eval-every", "15", "--metrics-jsonl", str(metrics),
                          "--no-progress", "--sample-tokens", "40"], 240, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))
    for r in records:
        assert {"step", "loss", "tokens_per_s", "step_time_ms", "world_size"} <= set(r)
        assert r["world_size"] == 2 and r["tokens_per_s"] > 0
    evaluated = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [15, 30]
    first, last = sum(r["loss"] for r in records[:3]) / 3, sum(r["loss"] for r in records[-3:]) / 3
    assert last < first - 0.5, f"loss did not fall: {first:.3f} -> {last:.3f}"
    assert evaluated[-1]["val_loss"] < evaluated[0]["val_loss"]
    assert "---- sample ----" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--global-batch", "6"], "--global-batch 6 is not divisible by the data-parallel size 4"),
    (["--data", "/nonexistent/corpus"], "--data /nonexistent/corpus: no such file or directory"),
    (["--model", "huge"], "invalid choice: 'huge'"),
])
def test_bad_flags_exit_nonzero_fast_with_one_line_error(tmp_path, args, message):
    proc, elapsed = mpiexec(4, ["--steps", "5", "--no-progress", *args], 120, tmp_path)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert elapsed < 60


def test_readme_loops_run_and_differ_in_at_most_10_lines(tmp_path):
    single = open(os.path.join(ROOT, "examples", "loop_single.py")).read().splitlines()
    dp = open(os.path.join(ROOT, "examples", "loop_dp.py")).read().splitlines()
    assert len([line for line in dp if line not in single]) <= 10
    env = dict(os.environ, OMP_NUM_THREADS="1", RTXMPI_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "loop_single.py")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "step 20 loss" in proc.stdout
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run(["mpiexec", "--oversubscribe", "-n", "2", sys.executable,
                           os.path.join(ROOT, "examples", "loop_dp.py")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("step 20 loss") == 1  # rank 0 prints
