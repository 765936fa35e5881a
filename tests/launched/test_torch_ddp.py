"""examples/torch_ddp.py (docs/interop.md): a PyTorch model trained through rtxmpi at 2 ranks
follows the one-process run, and its rtxmpi checkpoint resumes on the same curve. Skipped
without torch."""
import re
import sys

import pytest
from conftest import REPO, launch_env, mpiexec_argv, run_command

pytest.importorskip("torch")
EXAMPLE = REPO / "examples" / "torch_ddp.py"


def losses(proc):
    assert proc.returncode == 0, str(proc)
    return {int(s): float(v) for s, v in re.findall(r"^step (\d+) loss (\S+)$", proc.stdout, re.M)}


def test_two_ranks_follow_one_process_and_resume_from_the_sharded_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    one = losses(run_command([sys.executable, EXAMPLE, "--steps", "8"], outer_timeout_s=120,
                             env=launch_env()))
    first = run_command(mpiexec_argv(2) + [sys.executable, EXAMPLE, "--steps", "4", "--ckpt-dir", ckpt],
                        outer_timeout_s=120, env=launch_env())
    second = run_command(mpiexec_argv(2) + [sys.executable, EXAMPLE, "--steps", "8", "--ckpt-dir", ckpt,
                                            "--resume"], outer_timeout_s=120, env=launch_env())
    two = {**losses(first), **losses(second)}
    assert "resumed from step 4" in second.stdout, str(second)
    assert sorted(two) == sorted(one) == list(range(1, 9))
    for step in one:  # the same global batches; only the order of the gradient sums differs
        assert two[step] == pytest.approx(one[step], rel=1e-5), step
    assert one[8] < one[1] - 0.3
    assert (ckpt / "step_00000008" / "metadata.json").exists()
