"""rtxmpi.checkpoint.prune: the run's older committed checkpoints go, nothing else does."""
import importlib
import shutil

import numpy as np
import pytest

from rtxmpi.checkpoint import Shard, list_checkpoints, prune, save_checkpoint
from rtxmpi.errors import CheckpointError, ConfigError


def save(ckpt_dir, step, run_id):
    save_checkpoint(None, ckpt_dir, step, {"params": Shard(np.arange(4.0), 0, 4)}, run_id=run_id)


prune_module = importlib.import_module("rtxmpi.checkpoint.prune")  # the package exports the function


def steps(ckpt_dir):
    return [(c.step, c.committed) for c in list_checkpoints(ckpt_dir)]


def test_keeps_the_newest_the_protected_and_other_runs_checkpoints(tmp_path):
    save(tmp_path, 1, "other")
    for step in range(2, 7):
        save(tmp_path, step, "mine")
    assert prune(tmp_path, 2, "mine", protect=(3,)) == [2, 4]
    assert steps(tmp_path) == [(1, True), (3, True), (5, True), (6, True)]
    assert prune(tmp_path, 2, "mine", protect=(3,)) == []


def test_latest_stays_even_when_older_than_the_newest_k(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step, "mine")
    save_checkpoint(None, tmp_path, 1, {"params": Shard(np.arange(4.0), 0, 4)}, run_id="mine",
                    overwrite=True)  # latest now names step 1
    assert prune(tmp_path, 1, "mine") == [2]
    assert steps(tmp_path) == [(1, True), (3, True)]


@pytest.mark.parametrize("keep_last", [0, -1, 1.5, True])
def test_keep_last_below_one_or_not_an_integer_is_a_config_error(tmp_path, keep_last):
    with pytest.raises(ConfigError, match="must be an integer >= 1"):
        prune(tmp_path, keep_last, "mine")


def test_a_failed_removal_is_a_checkpoint_error_and_leaves_the_step_uncommitted(tmp_path, monkeypatch):
    for step in (1, 2):
        save(tmp_path, step, "mine")

    def fail(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(shutil, "rmtree", fail)
    with pytest.raises(CheckpointError, match=r"could not remove the old checkpoint .*step_00000001"):
        prune(tmp_path, 1, "mine")
    assert steps(tmp_path) == [(1, False), (2, True)]  # de-committed first: loads ignore it


def test_a_directory_that_cannot_be_listed_is_a_checkpoint_error(tmp_path, monkeypatch):
    def fail(path):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(prune_module, "list_checkpoints", fail)
    with pytest.raises(CheckpointError, match="cannot list its checkpoints to prune"):
        prune_module.prune(str(tmp_path), 2, "run")
