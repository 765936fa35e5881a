"""Durable sharded checkpoints: HDF5 shard files per rank, metadata.json as the commit marker.

    from rtxmpi.checkpoint import Shard, save_checkpoint, load_checkpoint
    save_checkpoint(group, "CKPT", step, {"params": Shard.even(flat, rank, size)}, meta={...})
    ckpt = load_checkpoint(group, "CKPT")          # latest committed; any world size
    step, skipped = latest_valid(group, "CKPT")    # newest that verifies, and the bad ones skipped
    ckpt.read("params", offset, length)            # only the files overlapping the range
    handle = save_checkpoint(..., async_save=True)  # snapshot, write on a background thread
    handle.finish()                                 # later, collective: agree and commit
    prune("CKPT", keep_last=2, run_id=run_id)       # one rank: the run's older checkpoints go

Format and protocol: `format.py`, `save.py`, docs/checkpoint.md.
"""
from rtxmpi.checkpoint.format import latest_step
from rtxmpi.checkpoint.load import (Checkpoint, CheckpointInfo, latest_valid, list_checkpoints,
                                    load_checkpoint, verify_checkpoint)
from rtxmpi.checkpoint.prune import prune
from rtxmpi.checkpoint.save import AsyncSave, finish_pending, save_checkpoint
from rtxmpi.checkpoint.shard import Shard

__all__ = ["Shard", "save_checkpoint", "AsyncSave", "finish_pending", "load_checkpoint", "latest_step",
           "latest_valid", "list_checkpoints", "verify_checkpoint", "Checkpoint", "CheckpointInfo", "prune"]
