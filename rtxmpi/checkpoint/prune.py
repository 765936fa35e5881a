"""Keep a run's newest K committed checkpoints: `prune` removes its older ones.

    removed = prune("CKPT", keep_last=2, run_id=run_id, protect={resumed_step})

Only the run's own checkpoints go (metadata.json's "run_id", the ownership mark a save also
honours: docs/checkpoint.md): another run's step directory, one whose metadata does not verify,
an uncommitted one, the step `latest` names and the steps in `protect` stay. A removal de-commits
first (metadata.json removed and the directory fsynced, then the files), so a crash midway leaves
an uncommitted directory that loads ignore and the next save of that step replaces.
"""
import os
import shutil

from rtxmpi.checkpoint import format as fmt
from rtxmpi.checkpoint.load import list_checkpoints
from rtxmpi.checkpoint.metadata import read_metadata
from rtxmpi.errors import CheckpointError, ConfigError


def check_keep_last(keep_last, name="keep_last"):
    """keep_last: None (keep every checkpoint) or an integer >= 1; ConfigError otherwise."""
    if keep_last is None:
        return
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ConfigError(f"{name} must be an integer >= 1 (the committed checkpoints to keep), "
                          f"got {keep_last!r}")


def prune(ckpt_dir, keep_last, run_id, protect=()):
    """Remove run `run_id`'s committed checkpoints in ckpt_dir but its `keep_last` newest, never
    `latest`'s step nor a step in `protect` (those count towards the newest K when they are the
    run's). Single process: call it on one rank while holding the directory's lock
    (rtxmpi.checkpoint.lock). Returns the removed steps, oldest first. Raises ConfigError for a bad
    keep_last, CheckpointError naming the directory when listing it or a removal fails."""
    check_keep_last(keep_last)
    try:
        found = list_checkpoints(ckpt_dir)
    except OSError as exc:  # a CheckpointError, which the training loop agrees on over the ranks
        raise CheckpointError(f"{ckpt_dir}: cannot list its checkpoints to prune: {exc}") from None
    own = []
    for info in found:
        if not info.committed or info.problem is not None:
            continue
        try:
            if read_metadata(info.path)[0].get("run_id") == run_id:
                own.append(info)
        except CheckpointError:  # changed since it was listed: not this run's to judge
            continue
    keep = {info.step for info in own[-keep_last:]} | set(protect)
    keep |= {info.step for info in own if info.latest}
    removed = []
    for info in own:
        if info.step in keep:
            continue
        try:
            os.remove(os.path.join(info.path, fmt.METADATA))
            fmt.fsync_path(info.path)
            shutil.rmtree(info.path)
        except OSError as exc:
            raise CheckpointError(f"could not remove the old checkpoint {info.path} (keeping the "
                                  f"last {keep_last}): {exc}") from None
        removed.append(info.step)
    return removed
