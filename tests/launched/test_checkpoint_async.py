"""Asynchronous checkpoint save, as users launch it: examples/train.py --async-save, and a process
that dies after the background write but before finish().

The reference is a 2-rank run of 12 steps with synchronous checkpoints every 6 steps; the same run
with --async-save, and a resume from its step-6 checkpoint, must end bitwise equal to it.
"""
import shutil
import subprocess
import sys
import textwrap

import numpy as np
from conftest import REPO, launch_env
from test_checkpoint_resume import records, tensors, train

from rtxmpi.checkpoint import latest_step, list_checkpoints


def test_async_save_run_and_its_resume_match_the_sync_run(tmp_path):
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    proc = train(2, tmp_path, sync_dir, "--ckpt-every", "6", metrics=tmp_path / "sync.jsonl")
    assert proc.returncode == 0, str(proc)
    proc = train(2, tmp_path, async_dir, "--ckpt-every", "6", "--async-save",
                 metrics=tmp_path / "async.jsonl")
    assert proc.returncode == 0, str(proc)
    assert len(proc.lines("checkpoint: saved step")) == 2, str(proc)
    assert [c.step for c in list_checkpoints(async_dir) if c.committed] == [6, 12]
    for step in (6, 12):
        got, _ = tensors(async_dir, step)
        want, _ = tensors(sync_dir, step)
        for name in want:
            assert np.array_equal(got[name], want[name]), (step, name)

    (async_dir / "latest").write_text("step_00000006\n")  # resume from the async step-6 checkpoint
    shutil.rmtree(async_dir / "step_00000012")
    metrics = tmp_path / "resumed.jsonl"
    proc = train(2, tmp_path, async_dir, "--ckpt-every", "6", "--async-save", "--resume",
                 metrics=metrics)
    assert proc.returncode == 0, str(proc)
    assert "continuing at step 7" in proc.stdout
    got, want = records(metrics), records(tmp_path / "sync.jsonl")
    assert sorted(got) == list(range(7, 13))
    assert all(got[s]["loss"] == want[s]["loss"] for s in got)  # bitwise
    resumed, _ = tensors(async_dir, 12)
    reference, _ = tensors(sync_dir, 12)
    for name in reference:
        assert np.array_equal(resumed[name], reference[name]), name


CRASH_BEFORE_FINISH = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from rtxmpi.checkpoint import Shard, save_checkpoint
    ckpt_dir = sys.argv[1]
    w = np.arange(1000, dtype=np.float32)
    save_checkpoint(None, ckpt_dir, 1, {"w": Shard(w, 0, w.size)})
    handle = save_checkpoint(None, ckpt_dir, 2, {"w": Shard(w + 1, 0, w.size)}, async_save=True)
    deadline = time.monotonic() + 60
    while not handle.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    print("written", handle.done(), flush=True)
    os._exit(17)  # dies before finish(): the write is durable, the commit never happens
""")


def test_crash_between_async_write_and_finish_keeps_previous_latest(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-c", CRASH_BEFORE_FINISH, str(ckpt)], cwd=REPO,
                          env=launch_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 17 and "written True" in proc.stdout, proc.stderr
    assert (ckpt / "step_00000002" / "rank_00000.h5").exists()  # the background write finished
    assert not (ckpt / "step_00000002" / "metadata.json").exists()
    assert (ckpt / "latest").read_text().strip() == "step_00000001"
    assert latest_step(ckpt) == 1
    got, _ = tensors(ckpt, 1)
    assert np.array_equal(got["w"], np.arange(1000, dtype=np.float32))
