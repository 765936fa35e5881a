"""The planner end to end: `rtxmpi plan --calibrate` under mpiexec, and `train.py --plan auto`."""
import fnmatch
import json
import sys

import pytest

from conftest import REPO, launch_env, mpiexec_argv, run_command

from rtxmpi.parallel.calibrate import HardwareProfile, default_profile


def _profile_favouring_the_pipeline(path):
    """A profile whose collectives cost 50 ms each while send/recv is cheap: with 2 ranks the
    planner must pick pp=2 (no gradient all_reduce, no per-layer tp/sp traffic)."""
    data = json.loads(json.dumps(vars(default_profile())))
    slow = {"2": [0.05, 1e9]}
    data["source"] = "test profile (slow collectives)"
    data["ranks_per_node"] = 2
    data["links"] = {scope: {op: slow for op in ("all_reduce", "all_gather", "reduce_scatter",
                                                 "all_to_all")} for scope in ("intra", "inter")}
    for scope in ("intra", "inter"):
        data["links"][scope]["send_recv"] = {"2": [1e-5, 1e9]}
    HardwareProfile.from_dict(data).save(str(path))


def _profile_favouring_zero_2(path):
    """all_reduce, all_to_all and send/recv cost 50 ms each, reduce_scatter and all_gather are
    cheap: the planner must pick dp=2 with ZeRO stage 2 (reduce_scatter + all_gather instead of
    the gradient all_reduce; stage 3 gathers more)."""
    data = json.loads(json.dumps(vars(default_profile())))
    data["source"] = "test profile (cheap reduce_scatter)"
    data["ranks_per_node"] = 2
    data["links"] = {scope: {op: {"2": [1e-5, 1e9] if op in ("reduce_scatter", "all_gather")
                                  else [0.05, 1e9]}
                             for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                        "send_recv")} for scope in ("intra", "inter")}
    HardwareProfile.from_dict(data).save(str(path))


@pytest.mark.parametrize("make_profile, layout, source", [
    (_profile_favouring_the_pipeline, "--dp 1 --tp 1 --pp 2 --sp 1", "slow collectives"),
    # micro-batches not pinned: within the planner's tie band the one with less memory goes first
    (_profile_favouring_zero_2, "--dp 2 --tp 1 --pp 1 --sp 1 --micro-batches * --zero-stage 2",
     "cheap reduce_scatter")], ids=["pipeline", "zero-2"])
def test_plan_auto_runs_the_layout_the_planner_chose(tmp_path, make_profile, layout, source):
    profile = tmp_path / "profile.json"
    make_profile(profile)
    metrics = tmp_path / "m.jsonl"
    proc = run_command(mpiexec_argv(2) + [
        sys.executable, REPO / "examples" / "train.py", "--plan", "auto", "--plan-profile",
        profile, "--model", "tiny", "--steps", "3", "--global-batch", "8", "--seq-len", "32",
        "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress",
        "--metrics-jsonl", metrics], outer_timeout_s=180,
        env=launch_env(RTXMPI_CACHE_DIR=tmp_path / "cache"))
    assert proc.returncode == 0, str(proc)
    running = proc.lines("plan: running")
    assert len(running) == 1 and fnmatch.fnmatch(running[0], f"*{layout}*"), str(proc)
    assert f"test profile ({source})" in proc.stdout
    stage = layout.split("--zero-stage ")[1] if "--zero-stage" in layout else "0"
    assert f"ZeRO stage {stage}" in proc.stdout, str(proc)  # the banner of the run itself
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]


def test_calibrate_under_mpiexec_saves_a_profile_the_cli_reuses(tmp_path):
    saved = tmp_path / "measured.json"
    proc = run_command(mpiexec_argv(2) + [
        sys.executable, "-m", "rtxmpi.cli", "plan", "--calibrate", "--save-profile", saved,
        "--model", "tiny", "--seq-len", "64", "--global-batch", "8", "--top", "3"],
        outer_timeout_s=180, env=launch_env())
    assert proc.returncode == 0, str(proc)
    assert "Chosen: " in proc.stdout and "calibrated on" in proc.stdout
    progress = [line for line in proc.stderr.splitlines() if line.startswith("calibrate: ")]
    assert progress[0].startswith("calibrate: measuring this machine at 2 ranks in 3 phases") and \
        "about 25 s at 4 ranks" in progress[0], str(proc)  # rank 0 alone, the expected duration first
    assert [line.split(" measured")[0] for line in progress[1:]] == [
        "calibrate: [1/3] compute", "calibrate: [2/3] links at 2 ranks", "calibrate: [3/3] sync"]
    profile = HardwareProfile.load(str(saved))
    assert profile.source.startswith("calibrated") and profile.ranks_per_node == 2
    assert profile.dense_flops > 1e8 and profile.ref_ms > 0
    assert 0 < profile.copy_ns < 1e3 and 0 <= profile.sync_s["2"] <= 0.02
    assert profile.clock == "cpu" and profile.ref_block["n_layer"] == 1  # CPU-time work model
    assert 0 < profile.ref_block["ms_ratio"] < 1 and 0 < profile.ref_small["ms_ratio"] < 1
    assert set(profile.links["intra"]) >= {"all_reduce", "all_gather", "send_recv"}
    again = run_command([sys.executable, "-m", "rtxmpi.cli", "plan", "--profile", saved,
                         "--world-size", "2", "--model", "tiny", "--seq-len", "64",
                         "--global-batch", "8"], outer_timeout_s=60, env=launch_env())
    assert again.returncode == 0 and profile.source in again.stdout, str(again)
