"""bench/commits.py: two commits' step times, alternated, from git exports of this repository."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "commits.py")

needs_git = pytest.mark.skipif(
    shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")),
    reason="needs git and this repository's history")


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


@needs_git
def test_two_runs_of_head_give_a_table_and_a_ratio(tmp_path):
    out = tmp_path / "commits.json"
    done = _run("--old", "HEAD", "--runs", "1", "--steps", "3", "--warmup", "1", "--json", str(out),
                "--", "--model", "tiny", "--global-batch", "4", "--seq-len", "16", "--eval-every", "0",
                "--eval-batches", "1", "--sample-tokens", "0")
    assert done.returncode == 0, done.stderr
    assert "| old" in done.stdout and "| new" in done.stdout and "new/old step time:" in done.stdout
    record = json.loads(out.read_text())
    assert record["commits"]["old"] == record["commits"]["new"]
    assert "copying new" in done.stderr and done.stderr.count("exporting") == 1  # one build of HEAD
    assert len(record["runs_ms"]["old"]) == len(record["runs_ms"]["new"]) == 1
    assert all(v > 0 for v in record["runs_ms"]["old"] + record["runs_ms"]["new"])


@needs_git
def test_a_flag_the_script_lacks_fails_with_its_error_line():
    done = _run("--old", "HEAD", "--runs", "1", "--steps", "2", "--warmup", "0", "--",
                "--model", "tiny", "--no-such-flag")
    assert done.returncode != 0
    assert "error:" in done.stderr and "--no-such-flag" in done.stderr


def test_bad_revision_and_counts_are_refused():
    assert "is not a commit" in _run("--old", "no-such-revision-x").stderr
    assert "--warmup must be in" in _run("--old", "HEAD", "--steps", "3", "--warmup", "3").stderr
    assert "--runs must be >= 1" in _run("--old", "HEAD", "--runs", "0").stderr


@needs_git
def test_export_builds_every_extension_the_commit_lists(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_commits", SCRIPT)
    commits = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        spec.loader.exec_module(commits)
    finally:
        sys.path.remove(os.path.dirname(SCRIPT))
    commits.export("HEAD", str(tmp_path / "head"))
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    assert (tmp_path / "head" / "rtxmpi" / "comm" / f"_mailbox{suffix}").exists()
    assert (tmp_path / "head" / "rtxmpi" / f"_fused{suffix}").exists()
