"""`plan_for_job` (the job's `--plan auto`) for the ViT and a Model of one's own: every rank gets
the same layout, one the layout rules accept for that model. Holds at any world size."""
import os

import numpy as np

from rtxmpi.nn import (ClassificationHead, Embedding, LayerNorm, Model, PositionalEmbedding,
                       Sequential, TransformerBlock, ViTConfig)
from rtxmpi.parallel.calibrate import default_profile
from rtxmpi.parallel.planner import plan_for_job


def _profile(world, ckpt_dir):
    path = os.path.join(ckpt_dir, "profile.json")
    if world.rank == 0:
        default_profile().save(path)
    world.barrier()
    return path


def _same_on_every_rank(world, layout):
    mine = np.array(layout.degrees + (layout.micro_batches, layout.zero_stage), np.int64)
    first = mine.copy()
    world.broadcast(first, src=0)
    assert np.array_equal(mine, first)


def test_plan_for_job_plans_the_vit_and_every_rank_runs_its_choice(world, ckpt_dir):
    cfg = ViTConfig()
    layout, plan = plan_for_job(world, cfg, 16, profile_path=_profile(world, ckpt_dir))
    _same_on_every_rank(world, layout)
    assert layout.check(world.world_size, cfg, 16) == layout and layout.sp == 1
    if world.rank == 0:
        assert plan.best.layout == layout and plan.inputs["model"] is cfg


def test_plan_for_job_plans_a_model_of_ones_own(world, ckpt_dir):
    blocks = [(f"b{i}", TransformerBlock(32, 2, causal=False)) for i in range(3)]
    model = Model([Sequential(Embedding(48, 32, "tok"), PositionalEmbedding(12, 32, "pos"))] + blocks
                  + [Sequential(("ln", LayerNorm(32)), ("cls", ClassificationHead(32, 5)))], seed=0)
    layout, _ = plan_for_job(world, model, 8, profile_path=_profile(world, ckpt_dir))
    _same_on_every_rank(world, layout)
    assert not layout.reasons(world.world_size, model, 8)
