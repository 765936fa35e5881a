"""The main job, examples/train.py, launched as users launch it: under its own mpiexec."""
import json
import os
import re
import sys

import pytest
from conftest import REPO, launch_env, mpiexec_argv, run_command
from train_errors import assert_one_line_error, refused

from rtxmpi.data import decode, load_corpus

EXAMPLES = REPO / "examples"


def mpiexec(n, script, args, timeout_s, tmp_path):
    """Run `mpiexec -n n python examples/<script> args` under a hard outer timeout."""
    env = launch_env(RTXMPI_CACHE_DIR=tmp_path / "cache")
    return run_command(mpiexec_argv(n) + [sys.executable, EXAMPLES / script, *args],
                       outer_timeout_s=timeout_s, env=env)


@pytest.mark.slow
def test_train_30_steps_at_2_ranks_lowers_the_loss(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    proc = mpiexec(2, "train.py", ["--model", "tiny", "--steps", "30", "--global-batch", "16",
                          "--seq-len", "64", "--eval-every", "15", "--metrics-jsonl", str(metrics),
                          "--no-progress", "--sample-tokens", "40"], 240, tmp_path)
    assert proc.returncode == 0, str(proc)
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


BAD_FLAGS = [  # each refused on every one of 4 ranks, in one launch (tests/launched/train_errors.py)
    (["--global-batch", "3"], "--global-batch 3 is smaller than the data-parallel size 4"),
    (["--data", "/nonexistent/corpus"], "--data /nonexistent/corpus: no such file or directory"),
    (["--model", "huge"], "invalid choice: 'huge'"),
    (["--metrics-jsonl", "/nonexistent/dir/m.jsonl"], "--metrics-jsonl /nonexistent/dir/m.jsonl: not a"),
    (["--warmup-steps", "10"], "--warmup-steps 10 must be in [0, --steps 5]"),
    (["--timeout-s", "0"], "--timeout-s must be > 0 seconds"),
    (["--offload", "cpu"], "--offload cpu needs --zero-stage 1, 2 or 3"),
    (["--stop-after-step", "5"], "error: --stop-after-step needs --ckpt-dir DIR"),
    (["--ckpt-every", "3"], "error: --ckpt-every needs --ckpt-dir DIR"),
    (["--keep-last", "0"], "--keep-last must be an integer >= 1 (the committed checkpoints to keep), got 0"),
    (["--keep-last", "2"], "error: --keep-last needs --ckpt-dir DIR"),
    (["--plan", "auto", "--micro-batches", "2"], "--plan auto chooses the layout; drop --micro-batches"),
    (["--seq-len", "100000"], "GiB per rank (estimate), over this node's"),  # not a MemoryError later
    (["--lr", "inf"], "--lr must be finite and > 0, got inf"),
    (["--grad-clip", "inf"], "--grad-clip and --weight-decay must be finite and >= 0"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--pp", "2", "--virtual-stages", "0"], "--virtual-stages must be >= 1, got 0"),
    (["--ckpt-dir", str(REPO / "README.md")], f"--ckpt-dir {REPO / 'README.md'}: "
                                              f"{REPO / 'README.md'} is not a directory"),
    (["--ckpt-dir", "/proc/x/ckpt"], "--ckpt-dir /proc/x/ckpt: the directory cannot be created "
                                     "(in /proc): No such file or directory"),
    (["--recompute", "all"], "invalid choice: 'all'"),
]


@pytest.fixture(scope="module")
def bad_flag_runs(tmp_path_factory):
    return refused(4, [["--steps", "5", "--no-progress", *args] for args, _ in BAD_FLAGS],
                   tmp_path_factory.mktemp("bad_flags"))


@pytest.mark.parametrize("case", range(len(BAD_FLAGS)), ids=[m for _, m in BAD_FLAGS])
def test_bad_flags_exit_2_on_every_rank_with_one_line_error(bad_flag_runs, case):
    assert_one_line_error(bad_flag_runs[case], BAD_FLAGS[case][1])


def test_a_bad_flag_ends_the_launched_job_fast_with_exit_2_and_one_line(tmp_path):
    """The process exit the in-job cases above leave out: mpiexec itself ends with 2."""
    proc = mpiexec(4, "train.py", ["--steps", "5", "--no-progress", "--global-batch", "3"], 120,
                   tmp_path)
    assert proc.returncode == 2 and not proc.outer_timeout, str(proc)
    assert "--global-batch 3 is smaller than the data-parallel size 4" in proc.stderr
    assert proc.stderr.count("error: ") == 1, proc.stderr  # one line, from rank 0
    assert "Traceback" not in proc.stderr and "usage:" not in proc.stderr
    assert proc.elapsed_s < 60


def test_a_diverged_run_exits_4_and_its_skipped_steps_say_so(tmp_path):
    """--lr 1e30: step 1 applies an absurd update, every later gradient is not finite and its
    step skipped; the run ends with loss NaN: exit 4 and one error line. Resumed from its last
    checkpoint, every step of the new attempt is skipped: exit 4 again."""
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    common = ["--model", "tiny", "--global-batch", "8", "--seq-len", "32", "--eval-every", "0",
              "--eval-batches", "1", "--sample-tokens", "0", "--no-progress", "--lr", "1e30",
              "--metrics-jsonl", str(metrics), "--ckpt-dir", str(ckpt)]
    proc = mpiexec(2, "train.py", [*common, "--steps", "3", "--stop-after-step", "2"], 120,
                   tmp_path)
    assert proc.returncode == 4 and not proc.outer_timeout, str(proc)
    assert proc.stderr.count("error: ") == 1 and "Traceback" not in proc.stderr, str(proc)
    assert ("error: training diverged: the loss is nan after step 2 (1 of 2 steps skipped); try "
            "a lower --lr (now 1e+30)") in proc.stderr, str(proc)
    records = [json.loads(line, parse_constant=pytest.fail) for line in  # strict JSON: no NaN
               metrics.read_text().splitlines()]
    assert [(r["step"], r["skipped"]) for r in records] == [(1, False), (2, True)]
    assert records[0]["grad_norm"] > 0 and records[1]["grad_norm"] is None
    assert records[1]["loss"] is None  # not finite
    proc = mpiexec(2, "train.py", [*common, "--steps", "3", "--resume"], 120, tmp_path)
    assert proc.returncode == 4 and not proc.outer_timeout, str(proc)
    assert ("error: training diverged: every step of this run (1 step) was skipped: the gradients "
            "were not finite") in proc.stderr, str(proc)
    assert [json.loads(line)["skipped"] for line in metrics.read_text().splitlines()] == [
        False, True, True]


def test_readme_loops_run_and_differ_in_at_most_10_lines(tmp_path):
    single = (EXAMPLES / "loop_single.py").read_text().splitlines()
    dp = (EXAMPLES / "loop_dp.py").read_text().splitlines()
    assert len([line for line in dp if line not in single]) <= 10
    proc = run_command([sys.executable, EXAMPLES / "loop_single.py"], outer_timeout_s=120,
                       env=launch_env(RTXMPI_CACHE_DIR=tmp_path / "cache"))
    assert proc.returncode == 0, str(proc)
    assert "step 20 loss" in proc.stdout
    proc = mpiexec(2, "loop_dp.py", [], 120, tmp_path)
    assert proc.returncode == 0, str(proc)
    assert proc.stdout.count("step 20 loss") == 1  # rank 0 prints


def test_the_sample_starts_from_a_prompt_of_the_validation_text(tmp_path):
    proc = mpiexec(2, "train.py", ["--model", "tiny", "--steps", "2", "--global-batch", "8",
                                   "--seq-len", "64", "--eval-every", "0", "--eval-batches", "1",
                                   "--no-progress", "--sample-tokens", "16"], 120, tmp_path)
    assert proc.returncode == 0, str(proc)
    said = proc.lines("sample: the prompt is ")
    assert len(said) == 1 and said[0].endswith(", then 16 generated bytes"), str(proc)
    n, offset = map(int, re.search(r"is (\d+) bytes of the validation text at byte (\d+)", said[0]).groups())
    val = load_corpus(cache_dir=tmp_path / "cache", progress=False).val
    assert n == 32 and (offset == 0 or val[offset - 1] == ord("\n")) and val[offset] != ord("\n")
    text = proc.stdout.split("---- sample ----\n")[1].split("\n----------------")[0]
    assert text.startswith(decode(val[offset:offset + n]).rstrip("\ufffd")), (text, offset)


def test_loop_dp_gives_each_rank_its_share_of_the_cores_for_blas(tmp_path):
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one core: every rank gets one BLAS thread either way")
    report = tmp_path / "report.py"  # loop_dp.py as launched, then its BLAS pool's size
    report.write_text(f"import runpy\nrunpy.run_path({str(EXAMPLES / 'loop_dp.py')!r})\n"
                      "from threadpoolctl import threadpool_info\n"
                      "print('blas threads', [p['num_threads'] for p in threadpool_info()])\n")
    env = {k: v for k, v in launch_env(RTXMPI_CACHE_DIR=tmp_path / "cache").items()
           if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    proc = run_command(mpiexec_argv(2) + [sys.executable, report], outer_timeout_s=120, env=env)
    assert proc.returncode == 0, str(proc)
    assert proc.lines("blas threads") == [f"blas threads [{cores // 2}]"] * 2, str(proc)


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_nvme_offload_trains_like_no_offload_and_cleans_up(tmp_path, zero_stage):
    common = ["--model", "tiny", "--steps", "4", "--global-batch", "8", "--seq-len", "32",
              "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress",
              "--zero-stage", str(zero_stage)]
    plain, offloaded = tmp_path / "plain.jsonl", tmp_path / "nvme.jsonl"
    assert mpiexec(2, "train.py", [*common, "--metrics-jsonl", str(plain)], 120, tmp_path).returncode == 0
    proc = mpiexec(2, "train.py", [*common, "--metrics-jsonl", str(offloaded), "--offload", "nvme",
                                   "--offload-dir", str(tmp_path / "nvme")], 120, tmp_path)
    assert proc.returncode == 0, str(proc)
    losses = [[json.loads(line)["loss"] for line in f.read_text().splitlines()] for f in (plain, offloaded)]
    assert losses[0] == losses[1]  # the chunked update is elementwise: bitwise the same
    assert not list((tmp_path / "nvme").rglob("*.bin"))  # files removed at the end


@pytest.mark.parametrize("layout", [["--zero-stage", "0"], ["--zero-stage", "3"],
                                    ["--tp", "2", "--sequence-parallel"], ["--sp", "2"],
                                    ["--pp", "2"]])
def test_recompute_blocks_trains_bitwise_like_none_and_reruns_the_blocks(tmp_path, layout):
    common = ["--model", "tiny", "--steps", "4", "--global-batch", "8", "--seq-len", "32",
              "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress",
              *layout]
    losses, spans = {}, {}
    for policy in ("none", "blocks"):
        metrics, timeline = tmp_path / f"{policy}.jsonl", tmp_path / f"{policy}.trace.json"
        proc = mpiexec(2, "train.py", [*common, "--recompute", policy, "--metrics-jsonl",
                                       str(metrics), "--timeline", str(timeline)], 120, tmp_path)
        assert proc.returncode == 0, str(proc)
        losses[policy] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
        spans[policy] = [e["name"] for e in json.loads(timeline.read_text())["traceEvents"]
                         if e.get("name", "").endswith("recompute")]
    assert len(losses["none"]) == 4 and losses["blocks"] == losses["none"]
    assert not spans["none"]
    # the tiny model's 2 blocks are units 1 and 2: rerun once per step on each of the 2 ranks
    # (--pp 2: each rank's block, once per micro-batch, 2 micro-batches a step)
    assert sorted(set(spans["blocks"])) == ["unit 1 recompute", "unit 2 recompute"]
    assert spans["blocks"].count("unit 1 recompute") == 4 * 2
