"""Deterministic mode, the write-ahead log and resume parity, with examples/train.py as users launch it.

The reference at each ZeRO stage is one uninterrupted 2-rank --deterministic run of 20 steps with a
checkpoint every 10 steps. A run ended early with --stop-after-step 10 and resumed must end bitwise
equal to it; a run killed while saving step 15 (checkpoint at 10, log durable to 15) resumed with
--deterministic re-runs 11..15, passes the parity check and ends bitwise equal; a tampered log
fails the check with a one-line error.
"""
import json
import shutil
import sys

import h5py
import numpy as np
import pytest
from conftest import REPO, launch_env, mpiexec_argv, run_command

from rtxmpi.checkpoint import load_checkpoint
from rtxmpi.wal import read_wal

TRAIN = REPO / "examples" / "train.py"
ARGS = ["--model", "tiny", "--steps", "20", "--global-batch", "8", "--seq-len", "32",
        "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress",
        "--wal-every", "5"]


def train(tmp, ckpt_dir, *extra, metrics=None, n=2, **env):
    args = [*ARGS, "--ckpt-dir", ckpt_dir, *extra]
    if metrics:
        args += ["--metrics-jsonl", metrics]
    return run_command(mpiexec_argv(n) + [sys.executable, TRAIN, *args], outer_timeout_s=90,
                       env=launch_env(RTXMPI_CACHE_DIR=tmp / "cache", **env))


def losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def assert_same_checkpoint(got_dir, want_dir, step=20):
    got, want = load_checkpoint(None, got_dir, step), load_checkpoint(None, want_dir, step)
    assert sorted(got.tensors) == sorted(want.tensors)
    for name in want.tensors:
        assert np.array_equal(got.read(name), want.read(name)), name  # bitwise


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """straight(zero_stage) -> folder with ckpt/ (steps 10 and 20, wal.h5) and m.jsonl."""
    runs = {}

    def run(zero_stage):
        if zero_stage not in runs:
            tmp = tmp_path_factory.mktemp(f"straight{zero_stage}")
            proc = train(tmp, tmp / "ckpt", "--deterministic", "--ckpt-every", "10",
                         "--zero-stage", str(zero_stage), metrics=tmp / "m.jsonl")
            assert proc.returncode == 0, str(proc)
            runs[zero_stage] = tmp
        return runs[zero_stage]

    return run


def without_last_checkpoint(src, dst):
    """A copy of a reference's ckpt/ whose latest committed checkpoint is step 10 (log to 20)."""
    shutil.copytree(src / "ckpt", dst)
    shutil.rmtree(dst / "step_00000020")
    return dst


def test_two_deterministic_runs_are_bitwise_equal(straight, tmp_path):
    ref = straight(0)
    proc = train(tmp_path, tmp_path / "ckpt", "--deterministic", metrics=tmp_path / "m.jsonl")
    assert proc.returncode == 0, str(proc)
    assert "deterministic: bitwise reproducible at world size 2" in proc.stdout
    assert losses(tmp_path / "m.jsonl") == losses(ref / "m.jsonl")
    assert_same_checkpoint(tmp_path / "ckpt", ref / "ckpt")
    got, want = read_wal(tmp_path / "ckpt" / "wal.h5"), read_wal(ref / "ckpt" / "wal.h5")
    assert list(got["step"]) == list(range(1, 21))
    for field in ("loss", "lr", "grad_norm", "samples_consumed", "params_digest"):
        assert np.array_equal(got[field], want[field]), field
    last = load_checkpoint(None, tmp_path / "ckpt", 20)
    for rank in (0, 1):  # each rank's generator, seeded from (seed, rank), is in its rank_state
        assert last.rank_state(rank)["rng"] == np.random.default_rng([0, rank]).bit_generator.state


def test_stop_after_step_10_then_resume_equals_the_straight_run(straight, tmp_path):
    ref = straight(0)
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    common = ["--deterministic", "--ckpt-every", "10", "--zero-stage", "0"]
    proc = train(tmp_path, ckpt, *common, "--stop-after-step", "10", metrics=metrics)
    assert proc.returncode == 0, str(proc)
    assert "stopped after step 10 (--stop-after-step)" in proc.stdout
    assert sorted(losses(metrics)) == list(range(1, 11))
    proc = train(tmp_path, ckpt, *common, "--resume", metrics=metrics)
    assert proc.returncode == 0 and "continuing at step 11" in proc.stdout, str(proc)
    assert "wal: the log ends at step 10, the checkpoint's step" in proc.stdout
    assert losses(metrics) == losses(ref / "m.jsonl")  # all 20 steps, bit for bit
    assert_same_checkpoint(ckpt, ref / "ckpt")
    assert list(read_wal(ckpt / "wal.h5")["step"]) == list(range(1, 21))


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_zero_stage_resume_from_step_10_equals_the_straight_run(straight, tmp_path, zero_stage):
    """The straight run's own step-10 checkpoint (its log runs to 20), resumed in a new job: steps
    11..20 re-run bit for bit (the parity check against the log, the losses, the step-20
    checkpoint). Stopping at step 10 itself is the same at every stage (the test above)."""
    ref = straight(zero_stage)
    ckpt, metrics = without_last_checkpoint(ref, tmp_path / "ckpt"), tmp_path / "m.jsonl"
    proc = train(tmp_path, ckpt, "--deterministic", "--ckpt-every", "10", "--zero-stage",
                 str(zero_stage), "--resume", metrics=metrics)
    assert proc.returncode == 0 and "continuing at step 11" in proc.stdout, str(proc)
    assert "wal: resume parity ok: steps 11..20 reproduce the log bit for bit" in proc.stdout, str(proc)
    want = losses(ref / "m.jsonl")
    assert losses(metrics) == {step: want[step] for step in range(11, 21)}
    assert_same_checkpoint(ckpt, ref / "ckpt")
    assert list(read_wal(ckpt / "wal.h5")["step"]) == list(range(1, 21))


def test_four_ranks_stop_and_resume_equal_the_straight_run(tmp_path):
    """At 4 ranks the sums are no longer a + b: Open MPI's algorithm, fixed for a message size and
    communicator, must add in the same order in every run: a second job resumed from the straight
    run's step-10 checkpoint re-runs 11..20 bit for bit."""
    common = ["--deterministic", "--ckpt-every", "10"]
    proc = train(tmp_path, tmp_path / "straight", *common, n=4, metrics=tmp_path / "a.jsonl")
    assert proc.returncode == 0, str(proc)
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "b.jsonl"
    shutil.copytree(tmp_path / "straight", ckpt)
    shutil.rmtree(ckpt / "step_00000020")
    proc = train(tmp_path, ckpt, *common, "--resume", n=4, metrics=metrics)
    assert proc.returncode == 0, str(proc)
    assert "wal: resume parity ok: steps 11..20" in proc.stdout, str(proc)
    want = losses(tmp_path / "a.jsonl")
    assert losses(metrics) == {step: want[step] for step in range(11, 21)}
    assert_same_checkpoint(ckpt, tmp_path / "straight")


def test_killed_after_step_15_resumes_deterministic_and_parity_passes(straight, tmp_path):
    ref, ckpt = straight(0), tmp_path / "ckpt"
    proc = train(tmp_path, ckpt, "--deterministic", "--ckpt-every", "5",
                 RTXMPI_TEST_CRASH_IN_SAVE="1:15")  # log durable to 15, latest checkpoint 10
    assert proc.returncode != 0 and not proc.outer_timeout, str(proc)
    assert (ckpt / "latest").read_text().strip() == "step_00000010"
    assert list(read_wal(ckpt / "wal.h5")["step"]) == list(range(1, 16))
    proc = train(tmp_path, ckpt, "--deterministic", "--ckpt-every", "5", "--resume")
    assert proc.returncode == 0, str(proc)
    assert "wal: last logged step 15; re-running steps 11..15" in proc.stdout
    assert "wal: resume parity ok: steps 11..15 reproduce the log bit for bit (5 losses, " \
           "1 parameter digest)" in proc.stdout
    assert_same_checkpoint(ckpt, ref / "ckpt")
    got, want = read_wal(ckpt / "wal.h5"), read_wal(ref / "ckpt" / "wal.h5")
    assert list(got["step"]) == list(range(1, 21)) and np.array_equal(got["loss"], want["loss"])


def test_tampered_log_fails_resume_parity_with_a_one_line_error(straight, tmp_path):
    ckpt = without_last_checkpoint(straight(0), tmp_path / "ckpt")
    with h5py.File(ckpt / "wal.h5", "r+") as f:
        row = f["records"][12]
        assert row["step"] == 13
        row["loss"] = np.nextafter(row["loss"], np.inf)  # one ulp
        f["records"][12] = row
    proc = train(tmp_path, ckpt, "--deterministic", "--ckpt-every", "10", "--resume")
    assert proc.returncode == 3 and not proc.outer_timeout, str(proc)
    errors = [line for line in proc.stderr.splitlines() if "error: " in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, str(proc)
    assert f"resume parity failed on 1 rank(s): rank 0: {ckpt / 'wal.h5'} step 13: recomputed " \
           f"loss" in errors[0]
    assert len(read_wal(ckpt / "wal.h5")) == 20  # the evidence is kept


def test_a_file_that_is_not_a_log_stops_the_resume_with_a_one_line_error(straight, tmp_path):
    ckpt = without_last_checkpoint(straight(0), tmp_path / "ckpt")
    (ckpt / "wal.h5").write_bytes(b"not hdf5")
    proc = train(tmp_path, ckpt, "--resume")
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, str(proc)
    assert f"rank 0: {ckpt / 'wal.h5'}: not an rtxmpi write-ahead log" in proc.stderr
    assert "move it away to resume without the log" in proc.stderr


def test_resume_without_deterministic_reports_the_last_step_and_rewrites_the_log(straight, tmp_path):
    ckpt = without_last_checkpoint(straight(0), tmp_path / "ckpt")
    proc = train(tmp_path, ckpt, "--ckpt-every", "10", "--resume")
    assert proc.returncode == 0, str(proc)
    assert "wal: last logged step 20; re-running steps 11..20 from the checkpoint (no parity " \
           "check without --deterministic)" in proc.stdout
    got, want = read_wal(ckpt / "wal.h5"), read_wal(straight(0) / "ckpt" / "wal.h5")
    assert list(got["step"]) == list(range(1, 21)) and (got["wall_time"][10:] > want["wall_time"][-1]).all()
