"""`rtxmpi bench peers`: the main job against PyTorch DDP runs end to end and prints its tables;
without torch it prints one `skipped:` line and run_all keeps the recorded section."""
import json
import re
import shutil
import sys

import pytest
from conftest import REPO, launch_env, run_command

PEERS = REPO / "bench" / "peers.py"
TINY = ["--quick", "--models", "tiny", "--ranks", "1", "--steps", "3", "--warmup", "1",
        "--global-batch", "4", "--seq-len", "32", "--eval-batches", "1"]
SECTION = "## The main job against PyTorch"


def without_torch(tmp_path):
    """launch_env whose `import torch` fails, as on a machine without it."""
    fake = tmp_path / "no_torch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'torch'\")\n")
    return launch_env(PYTHONPATH=f"{fake.parent}:{REPO}")


def test_quick_run_at_one_rank_prints_both_tables_of_the_same_job(tmp_path):
    pytest.importorskip("torch", reason="torch is not installed (pip install 'rtxmpi[peers]')")
    out = tmp_path / "peers.json"
    proc = run_command([sys.executable, "-m", "rtxmpi.cli", "bench", "peers", *TINY, "--json", out],
                       outer_timeout_s=120, env=launch_env(), cwd=REPO)
    assert proc.returncode == 0, str(proc)
    assert "| model | ranks | rtxmpi step (ms) | torch step (ms) |" in proc.stdout, str(proc)
    assert "| model | ranks | GFLOP/step | numpy sgemm GFLOP/s |" in proc.stdout, str(proc)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| tiny ")]
    assert len(rows) == 2, proc.stdout  # one a table
    (row,) = json.loads(out.read_text())["rows"]
    assert row["ranks"] == 1 and set(row["runs"]) == {"rtxmpi", "torch"}
    ours, peer = row["runs"]["rtxmpi"][0], row["runs"]["torch"][0]
    assert len(ours["step_time_ms"]) == len(peer["step_time_ms"]) == 3
    # the same weights and tokens: the same first loss, float32 apart; the same loss curve
    assert abs(ours["loss"][0] - peer["loss"][0]) < 1e-4
    assert abs(ours["val_loss"] - peer["val_loss"]) < 1e-2
    summary = row["summary"]
    assert all(summary[side]["step_s"] > 0 and summary[side]["gflops_per_rank"] > 0
               for side in ("rtxmpi", "torch"))
    assert row["sgemm_gflops"]["numpy"] > 0 and row["sgemm_gflops"]["torch"] > 0


def test_without_torch_one_skipped_line_and_exit_0(tmp_path):
    proc = run_command([sys.executable, PEERS, *TINY], outer_timeout_s=60, env=without_torch(tmp_path),
                       cwd=REPO)
    assert proc.returncode == 0, str(proc)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("skipped: PyTorch is not installed"), str(proc)
    assert "rtxmpi[peers]" in lines[0]


def test_run_all_keeps_the_recorded_section_when_peers_skips(tmp_path):
    results = tmp_path / "RESULTS.md"
    shutil.copy(REPO / "bench" / "RESULTS.md", results)
    before = results.read_text()
    proc = run_command([sys.executable, REPO / "bench" / "run_all.py", "--only", "peers", "--results",
                        results, "--out-dir", tmp_path / "runs"], outer_timeout_s=60,
                       env=without_torch(tmp_path), cwd=REPO)
    assert proc.returncode == 0, str(proc)
    after = results.read_text()

    def block(text):
        return re.search(r"<!-- run_all:peers begin -->.*?<!-- run_all:peers end -->", text, re.S).group(0)

    assert block(after) == block(before) and SECTION in after
    assert "skipped by themselves peers" in after
