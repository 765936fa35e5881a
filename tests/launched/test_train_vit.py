"""examples/train_vit.py (a ViT on scikit-learn's digits), launched under its own mpiexec."""
import json
import re
import shutil
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


VIT_ARGS = ["--model", "tiny", "--steps", "12", "--batch", "16", "--warmup-steps", "2",
            "--log-every", "100"]


def vit_records(path):
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.fixture(scope="module")
def vit_reference(tmp_path_factory):
    """One uninterrupted 2-rank ViT run: 12 steps, checkpoints after steps 6 and 12."""
    tmp = tmp_path_factory.mktemp("vit_reference")
    proc = train_vit(2, [*VIT_ARGS, "--ckpt-dir", str(tmp / "ckpt"), "--ckpt-every", "6",
                         "--metrics-jsonl", str(tmp / "m.jsonl")], timeout_s=120)
    assert proc.returncode == 0, str(proc)
    assert len(proc.lines("checkpoint: saved step")) == 2, str(proc)
    return tmp


def test_vit_stopped_after_step_6_resumes_bitwise_at_the_same_world_size(vit_reference, tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    args = [*VIT_ARGS, "--ckpt-dir", str(ckpt), "--metrics-jsonl", str(metrics)]
    proc = train_vit(2, [*args, "--stop-after-step", "6"], timeout_s=120)
    assert proc.returncode == 0, str(proc)
    assert "stopped after step 6 (--stop-after-step); checkpoint of step 6 committed" in proc.stdout
    proc = train_vit(2, [*args, "--resume"], timeout_s=120)
    assert proc.returncode == 0 and "continuing at step 7" in proc.stdout, str(proc)
    got, want = vit_records(metrics), vit_records(vit_reference / "m.jsonl")
    assert sorted(got) == list(range(1, 13))
    assert [got[s]["loss"] for s in got] == [want[s]["loss"] for s in got]  # same reduction order
    assert got[12]["val_loss"] == want[12]["val_loss"]
    assert "held-out accuracy" in proc.stdout


@pytest.mark.parametrize("n, zero_stage", [(1, 0), (4, 3)])
def test_vit_checkpoint_resumes_at_another_world_size_with_the_loss_continuing(
        vit_reference, tmp_path, n, zero_stage):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    ckpt.mkdir()
    shutil.copytree(vit_reference / "ckpt" / "step_00000006", ckpt / "step_00000006")
    proc = train_vit(n, [*VIT_ARGS, "--ckpt-dir", str(ckpt), "--resume", "--zero-stage",
                         str(zero_stage), "--metrics-jsonl", str(metrics)], timeout_s=120)
    assert proc.returncode == 0, str(proc)
    assert "saved at world size 2, ZeRO stage 0" in proc.stdout and "continuing at step 7" in proc.stdout
    got, want = vit_records(metrics), vit_records(vit_reference / "m.jsonl")
    assert sorted(got) == list(range(7, 13)) and got[12]["world_size"] == n
    # the same global batches from the same state; only the order of the gradient sums differs
    for step in range(7, 13):
        assert abs(got[step]["loss"] - want[step]["loss"]) < 1e-3, step


def test_vit_resume_refuses_a_checkpoint_of_another_model(vit_reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(vit_reference / "ckpt", ckpt)
    proc = train_vit(2, [*VIT_ARGS, "--patch", "4", "--ckpt-dir", str(ckpt), "--resume"],
                     timeout_s=120)
    assert proc.returncode == 3 and not proc.outer_timeout, str(proc)
    assert "resume with --model tiny --patch 2" in proc.stderr
    assert proc.stderr.count("error: ") == 1 and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("layout", [["--pp", "2", "--micro-batches", "2", "--recompute", "blocks",
                                     "--zero-stage", "1"], ["--tp", "2", "--recompute", "blocks"],
                                    ["--micro-batches", "2", "--zero-stage", "3"]],
                         ids=["pp2-zero1-recompute", "tp2-recompute", "accumulation-zero3"])
def test_vit_layouts_print_the_data_parallel_curve(layout):
    args = ["--model", "tiny", "--steps", "20", "--batch", "16", "--log-every", "5"]
    want, got = train_vit(2, args, timeout_s=120), train_vit(2, [*args, *layout], timeout_s=120)
    assert want.returncode == 0 and got.returncode == 0, (str(want), str(got))
    curve = [line.split()[3] for line in want.lines("step ")]  # losses as printed: 4 decimals
    assert len(curve) == 4 and [line.split()[3] for line in got.lines("step ")] == curve, str(got)
    assert want.lines("held-out accuracy")[0].split()[2] == got.lines("held-out accuracy")[0].split()[2]
    assert ("pp2" in got.stdout or "tp2" in got.stdout or "ZeRO stage 3" in got.stdout), str(got)


def test_vit_sequence_parallelism_over_17_positions_is_refused_with_one_error_line():
    proc = train_vit(2, ["--sp", "2"], timeout_s=120)
    assert proc.returncode == 2 and proc.stderr.count("error: ") == 1, str(proc)
    assert "sequence length 17 is not divisible by sp(2)" in proc.stderr
