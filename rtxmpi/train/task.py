"""Task: what the training loop (rtxmpi.train.fit) needs from a model, and Parts, what it builds.

The loop owns everything that is the same for every model (rtxmpi.train.config.TrainConfig); a
Task owns the model: its layout, engine, data, evaluation and what a checkpoint says about it.

    class MyTask(Task):
        name = "train-mine"
        def build(self, world, config):
            model = MyModel(...)
            engine = build_engine(model, world, zero_stage=0, optimizer=adamw)
            sampler = MySampler(..., dp_rank=world.rank, dp_size=world.world_size)
            return Parts(model, engine, sampler, tokens_per_step=config.global_batch)
        def evaluate(self, world, parts, config):
            ...  # collective; returns the mean held-out loss
"""
from dataclasses import dataclass


@dataclass
class Parts:
    """What Task.build returns for one attempt of a run.

    model: the (local) Model: dtype, num_params (full_num_params / full_specs when it is a shard
    of a bigger one), params. engine: forward(x, y) -> (loss, cache), backward(cache, scale),
    no_sync(), grad_norm(), zero_grad(), step(lr, max_grad_norm, total_norm), shards(),
    load_shards(read), full_params(), optimizer.step_count (rtxmpi.train.engines.build_engine
    makes one for data parallelism and ZeRO); with pipelined=True, train_step(x, y) -> mean loss
    runs every micro-batch's forward and backward instead. sampler: an
    rtxmpi.data.SamplerPosition (next_batch() -> (x, y), state_dict, samples_consumed).
    data_rank, data_size: this rank's place among the ranks that read different data (None:
    the world's). tokens_per_step: what one step processes over every rank, for tokens_per_s
    (tokens, or samples for a model without tokens); unit: what it counts, for the closing
    line ("tokens", "images"). zero_stage: the engine's (stored in the
    checkpoint; 0 with a replicated engine lets an elastic shrink hand the replica over).
    replica: after a failure, what the survivors hand over: "tensors" (engine.pieces(): full
    replicated tensors), "pieces" (rtxmpi.parallel.replica.replica_pieces(engine)) or None (a
    shrink reloads the last committed checkpoint). bucket_mb: the gradient bucket size for the
    report. loss_unit: printed after the final loss (e.g. " nats/byte"). close: called on every
    rank at the end (e.g. removes offload files), or None.
    """

    model: object
    engine: object
    sampler: object
    tokens_per_step: int
    unit: str = "tokens"
    data_rank: int = None
    data_size: int = None
    zero_stage: int = 0
    pipelined: bool = False
    replica: str = None
    bucket_mb: float = None
    loss_unit: str = ""
    close: object = None


class Task:
    """The per-model part of a run. Subclass it and override build and evaluate; the rest have
    defaults. Every method but describe is called on every rank, in the same order; describe only
on rank 0, so it must not call a collective.

    name: the job's label (metrics, report).
    """

    name = "train"

    def configure(self, world, config):
        """At the start of each attempt (the first, and again on the survivors after an elastic
        shrink): choose the layout for `world` and validate the model's settings; return the
        config to run with (e.g. dataclasses.replace(config, micro_batches=...)). Raise
        ConfigError on every rank for a setting the user can fix. Default: config as it is."""
        return config

    def build(self, world, config):
        """Build model, engine and sampler for `world` (collective); returns Parts."""
        raise NotImplementedError

    def evaluate(self, world, parts, config):
        """The held-out loss (float, the same on every rank). Collective."""
        raise NotImplementedError

    def describe(self, world, parts, config):
        """The banner line rank 0 prints before the first step (str). Rank 0 only: local, no
        collective."""
        specs = getattr(parts.model, "full_specs", None)  # a shard or a stage: the whole model's
        return (f"rtxmpi: world_size {world.world_size}, {self.name}, "
                f"{specs[-1].stop if specs else parts.model.num_params} parameters, "
                f"global batch {config.global_batch}")

    def checkpoint_meta(self):
        """JSON-able dict that describes the model in every checkpoint's meta."""
        return {}

    def check_checkpoint(self, meta, path):
        """Refuse a checkpoint whose meta (as checkpoint_meta wrote it) describes another model:
        raise CheckpointError naming both; KeyError, TypeError or ValueError for a meta that
        cannot be read (reported as such by the loop)."""

    def finish(self, world, parts, config, record):
        """After a run that reached config.steps (every rank; collective allowed): e.g. print a
        generated sample or the held-out accuracy on rank 0."""
