"""examples/train.py with --pp, launched as users launch it: the same loss curve as one process,
checkpoints that resume in another layout, and refused combinations."""
import json
import sys

from conftest import REPO, launch_env, mpiexec_argv, run_command
from train_errors import assert_one_line_error, refused

TRAIN = REPO / "examples" / "train.py"
COMMON = ["--model", "small", "--global-batch", "8", "--seq-len", "32", "--steps", "6",
          "--eval-every", "3", "--eval-batches", "2", "--sample-tokens", "0", "--no-progress",
          "--micro-batches", "4"]


def train(n, args, tmp_path, name):
    metrics = tmp_path / f"{name}.jsonl"
    env = launch_env(RTXMPI_CACHE_DIR=tmp_path / "cache")
    proc = run_command(mpiexec_argv(n) + [sys.executable, TRAIN, *COMMON, *args,
                                          "--metrics-jsonl", metrics],
                       outer_timeout_s=180, env=env)
    assert proc.returncode == 0, str(proc)
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def test_pp2_tp2_zero2_then_resumed_at_pp2_sp2_zero1_follow_the_one_process_loss_curve(tmp_path):
    straight = train(1, [], tmp_path, "one")
    ckpt = tmp_path / "ckpt"
    first = train(4, ["--pp", "2", "--tp", "2", "--zero-stage", "2", "--schedule", "gpipe",
                      "--ckpt-dir", ckpt, "--stop-after-step", "3"], tmp_path, "pp")
    resumed = train(4, ["--pp", "2", "--sp", "2", "--zero-stage", "1", "--ckpt-dir", ckpt,
                        "--resume"], tmp_path, "pp")  # Ulysses stages; appends steps 4..6
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert first == resumed[:3]
    for ref, got in zip(straight, resumed):
        assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (ref, got)
        if "val_loss" in ref:
            assert abs(got["val_loss"] - ref["val_loss"]) <= 1e-5 * ref["val_loss"], (ref, got)


def test_pp2_dp2_zero3_recompute_follows_zero0_and_resumes_at_dp4_zero3(tmp_path):
    """--pp 2 --dp 2 --zero-stage 3 --recompute blocks: each stage's parameters sharded over its
    dp pair, gathered per unit and micro-batch. Its losses are --zero-stage 0's to rtol 1e-5, not
    bitwise: float32 gradient sums run in another order (each micro-batch's unit gradient is
    reduce_scattered into the shard, where stage 0 accumulates the micro-batches and all_reduces
    once; measured differences ~1e-8 relative). Its checkpoint resumes without a pipeline at
    --dp 4 --zero-stage 3 (the one-process flat layout)."""
    base = ["--pp", "2", "--dp", "2", "--recompute", "blocks"]
    plain = train(4, base + ["--zero-stage", "0"], tmp_path, "zero0")
    ckpt = tmp_path / "ckpt"
    first = train(4, base + ["--zero-stage", "3", "--ckpt-dir", ckpt, "--stop-after-step", "3"],
                  tmp_path, "zero3")
    resumed = train(4, ["--dp", "4", "--zero-stage", "3", "--micro-batches", "2", "--ckpt-dir",
                        ckpt, "--resume"], tmp_path, "zero3")  # appends steps 4..6
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert first == resumed[:3]
    for ref, got in zip(plain, resumed):
        assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (ref, got)
        if "val_loss" in ref:
            assert abs(got["val_loss"] - ref["val_loss"]) <= 1e-5 * ref["val_loss"], (ref, got)


def test_pipeline_with_offload_or_too_few_micro_batches_exits_with_one_line_error(tmp_path):
    """And `--pp 2` alone runs: --micro-batches auto (the default) picks 2 for 1F1B."""
    cases = [(["--zero-stage", "3", "--offload", "cpu", "--micro-batches", "2"],
              "--offload cpu with --pp 2 is not supported"),
             (["--micro-batches", "1"], "1F1B needs micro_batches >= pipeline stages"),
             (["--virtual-stages", "2", "--micro-batches", "2"],
              "virtual stages (2) need the interleaved schedule"),
             (["--global-batch", "1"], "--micro-batches auto: no number of micro-batches that "
                                       "divides the per-rank batch 1 suits --pp 2 --schedule 1f1b")]
    alone = ["--model", "tiny", "--seq-len", "32", "--global-batch", "8", "--eval-batches", "1",
             "--sample-tokens", "0"]
    runs = refused(2, [["--pp", "2", "--steps", "2", "--no-progress", *args]
                       for args in [alone] + [args for args, _ in cases]],
                   tmp_path)  # one launch, every case on both ranks (tests/launched/train_errors.py)
    assert runs[0].codes == [0, 0], str(runs[0])
    for run, (_, message) in zip(runs[1:], cases):
        assert_one_line_error(run, message)
