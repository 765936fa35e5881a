"""The training loop as a library: fit(task, config) gives every model checkpoints and resume,
the write-ahead log and deterministic replay, pre-emption and Ctrl-C, elastic shrink, metrics,
the observer and the progress bar (docs/training.md).

    from rtxmpi.train import Parts, Task, TrainConfig, fit
    record = fit(MyTask(), TrainConfig(steps=100, ckpt_dir="ck", resume=True))
"""
from rtxmpi.train.config import TrainConfig, check_ckpt_dir, flag_names
from rtxmpi.train.engines import ParallelEngine, Replicated, build_engine, build_parallel
from rtxmpi.train.exits import (EXIT_CHECKPOINT, EXIT_CONFIG, EXIT_DIVERGED, EXIT_INTERRUPTED,
                                EXIT_PREEMPTED, exit_status, is_rank0)
from rtxmpi.train.loop import Trainer, fit
from rtxmpi.train.task import Parts, Task

__all__ = ["TrainConfig", "Task", "Parts", "fit", "Trainer", "build_engine", "build_parallel",
           "ParallelEngine", "Replicated", "exit_status", "is_rank0", "flag_names", "check_ckpt_dir",
           "EXIT_CONFIG", "EXIT_CHECKPOINT", "EXIT_DIVERGED", "EXIT_PREEMPTED", "EXIT_INTERRUPTED"]
