"""A training script's exit status from fit's outcome: one `error:` line and a documented code.

    def main():
        sys.exit(exit_status(lambda: fit(task, config), config.requeue))  # inside elastic.exit_after

Codes: 0 done; 2 a setting (ConfigError, DirectoryLocked); 3 a checkpoint or write-ahead log
error (CheckpointError); 4 diverged (every step skipped, or a non-finite final loss); 75
pre-empted by SIGTERM/SIGUSR1 with a committed checkpoint; 130 interrupted by Ctrl-C with one.
"""
import sys

import rtxmpi
from rtxmpi import comm, elastic
from rtxmpi.errors import CheckpointError, ConfigError, DirectoryLocked

EXIT_CONFIG = 2
EXIT_CHECKPOINT = 3  # a checkpoint or write-ahead log error, e.g. resume parity failed
EXIT_DIVERGED = 4  # every step of the run skipped (non-finite gradients), or a non-finite loss
EXIT_PREEMPTED = elastic.EXIT_PREEMPTED  # 75: stopped by SIGTERM/SIGUSR1 with a committed checkpoint
EXIT_INTERRUPTED = elastic.EXIT_INTERRUPTED  # 130: stopped by Ctrl-C with a committed checkpoint


def is_rank0():
    """Whether this process is rank 0 of the current world (before rtxmpi.init: of the launch)."""
    if rtxmpi.is_initialized():  # after an elastic shrink, launch rank 0 may be gone
        return rtxmpi.world().rank == 0
    return comm.launch_rank() == 0


def error_line(message):
    """Print `error: message` on stderr (the caller decides which ranks say it)."""
    print(f"error: {message}", file=sys.stderr, flush=True)


def exit_status(run, requeue=False):
    """Call run() (every rank; returns fit's record or None) and return the process's exit status,
    having printed the one-line error for it: a ConfigError or CheckpointError on rank 0 (raised
    on every rank together), a DirectoryLocked on every rank (each node's log shows why its ranks
    left), a diverged run on rank 0; after a pre-emption with `requeue`, rank 0 requeues the
    Slurm job. Other exceptions propagate."""
    try:
        record = run()
    except DirectoryLocked as exc:
        error_line(f"rank {rtxmpi.world().rank}: {exc}")
        return EXIT_CONFIG
    except ConfigError as exc:
        if is_rank0():
            error_line(exc)
        return EXIT_CONFIG
    except CheckpointError as exc:
        if is_rank0():
            error_line(exc)
        return EXIT_CHECKPOINT
    if record and record.get("diverged"):  # every rank: the skips and the loss are agreed
        if is_rank0():
            error_line(f"training diverged: {record['diverged']}")
        return EXIT_DIVERGED
    if record and record.get("interrupted"):  # every rank: the stop was agreed
        return EXIT_INTERRUPTED
    if record and record.get("preempted"):
        if requeue and rtxmpi.world().rank == 0:
            print(elastic.requeue(), flush=True)
        return EXIT_PREEMPTED
    return 0
