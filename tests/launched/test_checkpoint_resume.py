"""examples/train.py with --ckpt-dir/--ckpt-every/--resume, and `rtxmpi ckpt`, as users launch them.

The reference is one uninterrupted 2-rank run of 12 steps checkpointing every 6 steps. An
interrupted run (a rank killed while saving step 12) resumed with --resume must end bitwise equal
to it; its step-6 checkpoint resumed at 1 and 4 ranks must continue to (nearly) the same loss.
"""
import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
from conftest import REPO, launch_env, mpiexec_argv, run_command
from train_errors import assert_one_line_error, refused

from rtxmpi.checkpoint import format as fmt
from rtxmpi.checkpoint import list_checkpoints, load_checkpoint
from rtxmpi.cli import main as cli_main

TRAIN = REPO / "examples" / "train.py"
ARGS = ["--model", "tiny", "--steps", "12", "--global-batch", "8", "--seq-len", "32",
        "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress"]


def train(n, tmp, ckpt_dir, *extra, metrics=None, **env):
    args = [*ARGS, "--ckpt-dir", ckpt_dir, *extra]
    if metrics:
        args += ["--metrics-jsonl", metrics]
    return run_command(mpiexec_argv(n) + [sys.executable, TRAIN, *args], outer_timeout_s=120,
                       env=launch_env(RTXMPI_CACHE_DIR=tmp / "cache", **env))


def records(path):
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


def tensors(ckpt_dir, step):
    ckpt = load_checkpoint(None, ckpt_dir, step)
    return {name: ckpt.read(name) for name in ckpt.tensors}, ckpt


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted 2-rank run: 12 steps, a checkpoint after steps 6 and 12."""
    tmp = tmp_path_factory.mktemp("reference")
    proc = train(2, tmp, tmp / "ckpt", "--ckpt-every", "6", metrics=tmp / "m.jsonl")
    assert proc.returncode == 0, str(proc)
    assert len(proc.lines("checkpoint: saved step")) == 2, str(proc)
    return tmp


def test_checkpoints_hold_params_optimizer_and_data_position(reference):
    assert [c.step for c in list_checkpoints(reference / "ckpt") if c.committed] == [6, 12]
    arrays, ckpt = tensors(reference / "ckpt", 6)
    assert set(arrays) == {"params", "adam.m", "adam.v", "adam.step"} and ckpt.world_size_saved == 2
    meta = ckpt.meta
    assert meta["optimizer_step"] == 6 and meta["sampler"] == {"samples_consumed": 48, "seed": 0}
    assert meta["model"] == "tiny" and meta["param_layout"][0][2] == 0


def test_rank_killed_mid_save_keeps_previous_and_resume_matches_uninterrupted(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = train(2, tmp_path, ckpt, "--ckpt-every", "6", RTXMPI_TEST_CRASH_IN_SAVE="1:12")
    assert proc.returncode != 0 and not proc.outer_timeout, str(proc)
    state = {c.step: c.committed for c in list_checkpoints(ckpt)}
    assert state == {6: True, 12: False}
    assert (ckpt / "latest").read_text().strip() == "step_00000006"

    metrics = tmp_path / "m.jsonl"
    proc = train(2, tmp_path, ckpt, "--ckpt-every", "6", "--resume", metrics=metrics)
    assert proc.returncode == 0, str(proc)
    assert f"checkpoint: ignoring uncommitted {ckpt / 'step_00000012'}" in proc.stdout
    assert "continuing at step 7" in proc.stdout
    got, want = records(metrics), records(reference / "m.jsonl")
    assert sorted(got) == list(range(7, 13))
    assert got[12]["loss"] == want[12]["loss"]  # bitwise: same world size, same reduction order
    resumed, _ = tensors(ckpt, 12)
    uninterrupted, _ = tensors(reference / "ckpt", 12)
    for name in uninterrupted:
        assert np.array_equal(resumed[name], uninterrupted[name]), name


def test_resume_drops_the_metrics_lines_of_the_steps_it_runs_again(reference, tmp_path):
    """The interrupted run logged steps 1-12 and committed step 6 only: the resume writes 7-12
    again, so the file holds each step once, the re-run's line for 7-12."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    proc = train(2, tmp_path, ckpt, "--ckpt-every", "6", metrics=metrics,
                 RTXMPI_TEST_CRASH_IN_SAVE="1:12")
    assert proc.returncode != 0 and not proc.outer_timeout, str(proc)
    assert [r["step"] for r in map(json.loads, metrics.read_text().splitlines())] == list(
        range(1, 13))
    metrics.write_text(metrics.read_text().replace('"world_size": 2', '"world_size": 2, "old": 1'))
    proc = train(2, tmp_path, ckpt, "--ckpt-every", "6", "--resume", metrics=metrics)
    assert proc.returncode == 0 and "continuing at step 7" in proc.stdout, str(proc)
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 13))
    assert [r["step"] for r in lines if "old" in r] == list(range(1, 7))
    want = records(reference / "m.jsonl")
    assert [r["loss"] for r in lines] == [want[s]["loss"] for s in range(1, 13)]


@pytest.mark.parametrize("n, zero_stage", [(1, 0), (4, 0), (1, 2), (4, 1), (2, 2), (4, 3)])
def test_two_rank_checkpoint_resumes_at_other_world_sizes_and_zero_stages(reference, tmp_path, n,
                                                                           zero_stage):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(reference / "ckpt" / "step_00000006", ckpt / "step_00000006")
    metrics = tmp_path / "m.jsonl"
    proc = train(n, tmp_path, ckpt, "--resume", "--zero-stage", str(zero_stage), metrics=metrics)
    assert proc.returncode == 0, str(proc)
    assert "saved at world size 2" in proc.stdout and "continuing at step 7" in proc.stdout
    got, want = records(metrics), records(reference / "m.jsonl")
    assert sorted(got) == list(range(7, 13)) and got[12]["world_size"] == n
    # the same global batches; only the order of the gradient sums differs (float32 rounding)
    for step in range(7, 13):
        assert abs(got[step]["loss"] - want[step]["loss"]) < 1e-3, step
    _, last = tensors(ckpt, 12)
    assert last.world_size_saved == n and last.meta["zero_stage"] == zero_stage


def test_zero_stage_2_checkpoint_resumes_with_plain_data_parallel(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = train(4, tmp_path, ckpt, "--steps", "6", "--zero-stage", "2")
    assert proc.returncode == 0, str(proc)
    metrics = tmp_path / "m.jsonl"
    proc = train(2, tmp_path, ckpt, "--resume", "--zero-stage", "0", metrics=metrics)
    assert proc.returncode == 0, str(proc)
    assert "saved at world size 4, ZeRO stage 2" in proc.stdout
    assert sorted(records(metrics)) == list(range(7, 13))


def test_keep_last_keeps_the_newest_the_resumed_and_another_runs_checkpoints(tmp_path):
    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    proc = train(2, tmp_path, ckpt, "--ckpt-every", "1", "--keep-last", "2", "--stop-after-step", "4")
    assert proc.returncode == 0, str(proc)
    assert proc.lines("checkpoint: removed step 2 (--keep-last 2)"), str(proc)
    assert [c.step for c in list_checkpoints(ckpt)] == [3, 4]
    assert train(2, tmp_path, other, "--stop-after-step", "2").returncode == 0
    shutil.copytree(other / "step_00000002", ckpt / "step_00000002")  # another run's checkpoint
    proc = train(2, tmp_path, ckpt, "--ckpt-every", "1", "--keep-last", "2", "--resume")
    assert proc.returncode == 0 and "continuing at step 5" in proc.stdout, str(proc)
    left = list_checkpoints(ckpt)
    assert [c.step for c in left] == [2, 4, 11, 12] and all(c.committed for c in left)
    run_ids = [load_checkpoint(None, ckpt, step).metadata["run_id"] for step in (2, 12)]
    assert run_ids[0] != run_ids[1]


def test_ckpt_ls_verify_inspect_and_a_flipped_byte(reference, tmp_path, capsys):
    """`rtxmpi ckpt` through rtxmpi.cli.main in this process; the failing verify, the one whose
    exit status matters to scripts, as its own process."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference / "ckpt", ckpt)

    def cli(*argv):
        code = cli_main(["ckpt", *map(str, argv)])
        return code, capsys.readouterr().out

    code, out = cli("ls", ckpt)
    latest = [line for line in out.splitlines() if line.startswith("        12")]
    assert code == 0 and "<- latest" in latest[0], out
    code, out = cli("inspect", ckpt, "--step", "6")  # a summary: no piece ranges, short meta values
    assert code == 0 and len(out.splitlines()) < 30 and "rank_00001.h5 [" not in out, out
    assert "  optimizer_step: 6" in out and "  param_layout: list of " in out
    code, out = cli("inspect", ckpt, "--step", "6", "--all")
    assert code == 0 and "rank_00001.h5 [" in out and '"optimizer_step": 6' in out
    code, out = cli("verify", ckpt)
    assert code == 0 and out.startswith("ok: "), out

    path = ckpt / "step_00000012" / "rank_00001.h5"
    with h5py.File(path, "r") as f:
        offset = f["tensors/adam.m"].id.get_offset()
    with open(path, "r+b") as f:
        f.seek(offset + 10)
        byte = f.read(1)
        f.seek(offset + 10)
        f.write(bytes([byte[0] ^ 0x40]))
    proc = run_command([sys.executable, "-m", "rtxmpi.cli", "ckpt", "verify", ckpt], outer_timeout_s=60)
    assert proc.returncode == 1, str(proc)
    assert f"{path}: dataset /tensors/adam.m: checksum mismatch" in proc.stderr
    assert cli("verify", ckpt, "--step", "6")[0] == 0


def test_resume_into_a_missing_dir_warns_an_empty_one_starts_fresh_another_model_exits_3(tmp_path):
    """A first launch under `rtxmpi run` or Slurm passes --resume with a directory still to be
    made: it starts fresh, with a warning naming the path (and the checkpoints next to it, for a
    mistyped name). An empty existing directory starts fresh quietly; a checkpoint of another
    --model is a CheckpointError (exit 3) naming both models."""
    (tmp_path / "ckpt").mkdir()
    proc = train(1, tmp_path, tmp_path / "ckpt", "--resume", "--steps", "2")
    assert proc.returncode == 0, str(proc)
    assert "no committed checkpoint in" in proc.stdout and "starting fresh" in proc.stdout
    assert "warning" not in proc.stderr, str(proc)
    assert [c.step for c in list_checkpoints(tmp_path / "ckpt")] == [2]  # saved at the end
    common = [*ARGS, "--steps", "2", "--resume"]
    missing, other_model = refused(1, [[*common, "--ckpt-dir", tmp_path / "ckp"],
                                       [*common, "--ckpt-dir", tmp_path / "ckpt", "--model", "small"]],
                                   tmp_path)
    assert missing.codes == [0], str(missing)
    assert (f"warning: --resume: --ckpt-dir {tmp_path / 'ckp'} does not exist; "
            f"starting fresh at step 1") in missing.stderr[0], str(missing)
    assert f"checkpoints next to it: {tmp_path / 'ckpt'} (latest step 2)" in missing.stderr[0]
    assert [c.step for c in list_checkpoints(tmp_path / "ckp")] == [2]
    assert_one_line_error(other_model, "holds model tiny", code=3)
    assert "this run builds model small" in other_model.stderr[0], str(other_model)


def test_fresh_run_refuses_a_directory_with_checkpoints(reference, tmp_path):
    proc = train(1, tmp_path, reference / "ckpt", "--steps", "2")
    assert proc.returncode == 2, str(proc)
    assert "already holds checkpoints (latest step 12); pass --resume" in proc.stderr


def test_six_steps_then_resume_to_twelve_continues_at_step_seven(tmp_path):
    """A run ended at --steps 6 extended with --resume --steps 12. Not bitwise equal to the
    12-step reference: the cosine schedule is a function of --steps (docs/checkpoint.md)."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    proc = train(2, tmp_path, ckpt, "--steps", "6", metrics=metrics)
    assert proc.returncode == 0 and len(proc.lines("checkpoint: saved step 6")) == 1, str(proc)
    proc = train(2, tmp_path, ckpt, "--resume", metrics=metrics)
    assert proc.returncode == 0 and "continuing at step 7" in proc.stdout, str(proc)
    got = records(metrics)
    assert sorted(got) == list(range(1, 13))
    assert got[12]["loss"] < got[1]["loss"] and abs(got[7]["loss"] - got[6]["loss"]) < 0.5
    arrays, last = tensors(ckpt, 12)
    assert last.meta["optimizer_step"] == 12 and last.meta["samples_consumed"] == 12 * 8


@pytest.fixture(scope="module")
def reference4(tmp_path_factory):
    """One uninterrupted 4-rank run (global batch 24, divisible by 1, 2, 3, 4 and 8 ranks)."""
    tmp = tmp_path_factory.mktemp("reference4")
    proc = train(4, tmp, tmp / "ckpt", "--ckpt-every", "6", "--global-batch", "24",
                 metrics=tmp / "m.jsonl")
    assert proc.returncode == 0, str(proc)
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_four_rank_checkpoint_continues_the_loss_curve_at_1_2_3_and_8_ranks(reference4, tmp_path, n):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(reference4 / "ckpt" / "step_00000006", ckpt / "step_00000006")
    metrics = tmp_path / "m.jsonl"
    proc = train(n, tmp_path, ckpt, "--resume", "--global-batch", "24", metrics=metrics)
    assert proc.returncode == 0, str(proc)
    assert "saved at world size 4" in proc.stdout and "continuing at step 7" in proc.stdout
    got, want = records(metrics), records(reference4 / "m.jsonl")
    assert sorted(got) == list(range(7, 13))
    # not bitwise: the gradient sums run over a different number of partial sums (float32), so
    # they round differently; the loss curve agrees to float32 round-off
    for step in range(7, 13):
        assert abs(got[step]["loss"] - want[step]["loss"]) <= 1e-6 * abs(want[step]["loss"]), (
            step, got[step]["loss"], want[step]["loss"])


def copy_ckpt(reference, tmp_path, name, drop=()):
    """A copy of the reference checkpoint dir (with its log), without the step dirs in `drop`."""
    ckpt = tmp_path / name
    shutil.copytree(reference / "ckpt", ckpt)
    for step_dir in drop:
        shutil.rmtree(ckpt / step_dir)
    return ckpt


def edit_metadata(step_dir, edit, resign=True):
    path = step_dir / "metadata.json"
    metadata = json.loads(path.read_text())
    edit(metadata)
    if resign:  # an edit that the metadata checksum cannot see: the log must
        metadata[fmt.METADATA_CHECKSUM] = fmt.metadata_checksum(metadata)
    path.write_text(json.dumps(metadata))


def test_fifo_as_rank_file_exits_3_within_the_deadline_and_leaves_no_process(reference, tmp_path):
    ckpt = copy_ckpt(reference, tmp_path, "ckpt")
    fifo = ckpt / "step_00000012" / "rank_00001.h5"
    fifo.unlink()
    os.mkfifo(fifo)  # its size, 0, recorded too (re-signed): opening it blocked every rank
    edit_metadata(fifo.parent, lambda m: m["files"]["rank_00001.h5"].update(bytes=0))
    proc = train(2, tmp_path, ckpt, "--resume", "--resume-strict", "--timeout-s", "30")
    assert proc.returncode == 3 and not proc.outer_timeout and proc.elapsed_s < 60, str(proc)
    assert "error: verifying" in proc.stderr and "rank_00001.h5" in proc.stderr, str(proc)
    left = subprocess.run(["pgrep", "-f", str(ckpt)], capture_output=True, text=True).stdout
    assert not left.strip(), f"processes left behind: {left}"


def test_corrupt_newest_checkpoint_falls_back_to_the_older_one_with_a_warning(reference, tmp_path):
    ckpt = copy_ckpt(reference, tmp_path, "ckpt")
    path = ckpt / "step_00000012" / "rank_00001.h5"
    with h5py.File(path, "r") as f:
        offset = f["tensors/adam.m"].id.get_offset()
    with open(path, "r+b") as f:
        f.seek(offset + 10)
        byte = f.read(1)
        f.seek(offset + 10)
        f.write(bytes([byte[0] ^ 0x40]))
    metrics = tmp_path / "m.jsonl"
    proc = train(2, tmp_path, ckpt, "--resume", metrics=metrics)
    assert proc.returncode == 0, str(proc)
    warning = [line for line in proc.stderr.splitlines() if line.startswith("warning: checkpoint")]
    assert len(warning) == 1 and f"{ckpt / 'step_00000012'} does not verify" in warning[0], str(proc)
    assert f"{path}: dataset /tensors/adam.m: checksum mismatch" in warning[0], str(proc)
    assert "continuing at step 7" in proc.stdout, str(proc)
    got, want = records(metrics), records(reference / "m.jsonl")
    assert sorted(got) == list(range(7, 13)) and got[12]["loss"] == want[12]["loss"]


def test_edited_or_unusable_metadata_is_refused_with_exit_3(reference, tmp_path):
    """One launch, four checkpoint dirs: samples_consumed edited 48 -> 56 with the checksum
    recomputed (the log recorded 48), the same edit left unsigned with --resume-strict, a
    re-signed meta without model_config, and a re-signed loss of the step (the log's differs)."""
    signed = copy_ckpt(reference, tmp_path, "signed", drop=["step_00000012"])
    loss = copy_ckpt(reference, tmp_path, "loss", drop=["step_00000012"])
    unsigned = copy_ckpt(reference, tmp_path, "unsigned", drop=["step_00000012"])
    no_config = copy_ckpt(reference, tmp_path, "no_config", drop=["step_00000012"])

    def consumed_56(m):
        m["meta"]["samples_consumed"] = m["meta"]["sampler"]["samples_consumed"] = 56
    edit_metadata(signed / "step_00000006", consumed_56)
    edit_metadata(unsigned / "step_00000006", consumed_56, resign=False)
    edit_metadata(no_config / "step_00000006", lambda m: m["meta"].pop("model_config"))

    def other_loss(m):
        m["meta"]["loss_bits"] = f"{int(np.float64(2.5).view(np.uint64)):016x}"
    edit_metadata(loss / "step_00000006", other_loss)
    common = [*ARGS, "--resume"]
    cases = refused(2, [[*common, "--ckpt-dir", signed],
                        [*common, "--resume-strict", "--ckpt-dir", unsigned],
                        [*common, "--ckpt-dir", no_config],
                        [*common, "--ckpt-dir", loss]], tmp_path)
    assert_one_line_error(cases[0], "the checkpoint says 56 samples consumed, the log recorded 48",
                          code=3)
    assert_one_line_error(cases[1], "metadata_checksum", code=3)
    assert_one_line_error(cases[2], "its meta cannot be resumed from: KeyError: 'model_config'", code=3)
    assert_one_line_error(cases[3], "the checkpoint says loss 2.5, the log recorded", code=3)
