"""The ViT under DataParallel and ZeRO stages 1, 2, 3 against one process on the same global batch
of images, at any world size; its ZeRO checkpoint reloaded at another world size and stage."""
from contextlib import nullcontext

import numpy as np
import pytest
from conftest import GLOBAL_BATCH, local_slice

from rtxmpi.checkpoint import Shard, load_checkpoint, save_checkpoint
from rtxmpi.data_vision import ImageBatchSampler
from rtxmpi.nn import AdamW, ViT, ViTConfig, clip_grad_norm, decay_mask
from rtxmpi.parallel.data import DataParallel
from rtxmpi.parallel.zero import ZeroDataParallel, gather_shards

LR, MAX_GRAD_NORM = 1e-2, 0.05
CFG = ViTConfig.named("tiny", n_classes=5)


def make_model(seed=0, dtype=np.float64):
    return ViT(CFG, seed=seed, dtype=dtype)


def image_batch(step):
    """The full global batch of `step`: (GLOBAL_BATCH, 8, 8, 1) images and (GLOBAL_BATCH,) labels,
    as one process would read it."""
    rng = np.random.default_rng(321)
    images = rng.random((40, CFG.image_size, CFG.image_size, CFG.channels)).astype(np.float32)
    labels = rng.integers(0, CFG.n_classes, 40)
    return ImageBatchSampler(images, labels, GLOBAL_BATCH, seed=3,
                             start_sample=step * GLOBAL_BATCH).next_batch()


def small_buckets(model):
    return model.flat_grad.nbytes // 5


def adamw(params, mask):
    return AdamW(params, lr=LR, decay_mask=mask)


def reference_run(steps, max_grad_norm=None):
    """The one-process float64 model after `steps` AdamW steps (optionally clipped)."""
    model = make_model()
    opt = adamw(model.flat_data, decay_mask(model.params, dtype=model.dtype))
    for step in range(steps):
        _, cache = model.forward(*image_batch(step))
        model.backward(cache)
        if max_grad_norm is not None:
            clip_grad_norm(model.flat_grad, max_grad_norm)
        opt.step(model.flat_grad)
        model.zero_grad()
    return model


def train(group, zdp, steps, first_step=0, max_grad_norm=None):
    """`steps` ZeRO steps, each of two half micro-batches (the first under no_sync)."""
    half = GLOBAL_BATCH // 2
    for step in range(first_step, first_step + steps):
        images, labels = image_batch(step)
        for i, part in enumerate((slice(0, half), slice(half, None))):
            _, cache = zdp.forward(local_slice(group, images[part]), local_slice(group, labels[part]))
            with zdp.no_sync() if i == 0 else nullcontext():
                zdp.backward(cache, scale=0.5)
        zdp.step(max_grad_norm=max_grad_norm)


def full_grad(world, zdp, numel):
    """The whole reduced gradient from every rank's shard. Collective."""
    return gather_shards(world, zdp.grad_shard(), numel)


# -- DataParallel ------------------------------------------------------------------------------
@pytest.mark.parametrize("bucket_kind", ["one", "several"])
def test_dp_vit_gradients_and_loss_match_single_process(world, bucket_kind):
    images, labels = image_batch(0)
    reference = make_model(dtype=np.float32)
    ref_loss, cache = reference.forward(images, labels)
    reference.backward(cache)

    model = make_model(dtype=np.float32)
    ddp = DataParallel(model, world, bucket_bytes=2**30 if bucket_kind == "one"
                       else small_buckets(model))
    loss, cache = ddp.forward(local_slice(world, images), local_slice(world, labels))
    ddp.backward(cache)
    np.testing.assert_allclose(model.flat_grad, reference.flat_grad, rtol=1e-5, atol=1e-7)
    assert world.all_gather(np.array([loss])).mean() == pytest.approx(ref_loss, rel=1e-6)


def test_dp_vit_parameters_match_single_process_after_10_clipped_adamw_steps(world):
    reference = reference_run(10, MAX_GRAD_NORM)
    model = make_model(seed=world.rank)  # replaced by rank 0's parameters on wrapping
    ddp = DataParallel(model, world, bucket_bytes=small_buckets(model))
    opt = adamw(model.flat_data, decay_mask(model.params, dtype=model.dtype))
    norms = []
    for step in range(10):
        images, labels = image_batch(step)
        _, cache = ddp.forward(local_slice(world, images), local_slice(world, labels))
        ddp.backward(cache)
        norms.append(clip_grad_norm(model.flat_grad, MAX_GRAD_NORM))
        ddp.step(opt)
    assert norms[0] > MAX_GRAD_NORM  # the clipping really happened
    np.testing.assert_allclose(model.flat_data, reference.flat_data, rtol=1e-6, atol=1e-9)


# -- ZeRO stages 1, 2, 3 -----------------------------------------------------------------------
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_vit_gradient_shard_and_loss_match_single_process(world, stage):
    images, labels = image_batch(0)
    reference = make_model()
    ref_loss, cache = reference.forward(images, labels)
    reference.backward(cache)
    model = make_model()
    zdp = ZeroDataParallel(model, world, stage=stage, bucket_bytes=small_buckets(model))
    loss, cache = zdp.forward(local_slice(world, images), local_slice(world, labels))
    zdp.backward(cache)
    np.testing.assert_allclose(full_grad(world, zdp, model.num_params), reference.flat_grad,
                               rtol=1e-9, atol=1e-12)
    assert world.all_gather(np.array([loss])).mean() == pytest.approx(ref_loss, rel=1e-12)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_vit_matches_single_process_after_10_clipped_steps_with_accumulation(world, stage):
    reference = reference_run(10, MAX_GRAD_NORM)
    model = make_model()
    zdp = ZeroDataParallel(model, world, stage=stage, bucket_bytes=small_buckets(model),
                           optimizer=adamw)
    train(world, zdp, 10, max_grad_norm=MAX_GRAD_NORM)
    np.testing.assert_allclose(zdp.full_params(), reference.flat_data, rtol=1e-6, atol=1e-9)


def test_zero3_vit_logits_match_the_unsharded_model(world):
    reference, model = make_model(), make_model()
    zdp = ZeroDataParallel(model, world, stage=3)
    images, _ = image_batch(0)
    np.testing.assert_allclose(model.logits(local_slice(world, images)),
                               reference.logits(local_slice(world, images)), rtol=1e-12,
                               atol=1e-14)
    assert zdp.provider.gathers > 0 or world.world_size == 1


# -- checkpoints -------------------------------------------------------------------------------
@pytest.mark.parametrize("stages", [(2, 3), (3, 1)], ids=["stage2-to-3", "stage3-to-1"])
def test_zero_vit_checkpoint_resumes_at_another_world_size(world, ckpt_dir, stages):
    """Saved by every rank at ZeRO `stages[0]`, loaded by the halves of the world (ranks of one
    parity: world_size // 2 or 1 ranks) at `stages[1]`; three more steps there equal three more
    steps of the run that was never interrupted."""
    saved_stage, loaded_stage = stages
    zdp = ZeroDataParallel(make_model(), world, stage=saved_stage, optimizer=adamw)
    train(world, zdp, 3)
    shards = {name: Shard(np.array(a), offset, size) for name, (a, offset, size)
              in zdp.shards().items()}
    save_checkpoint(world, ckpt_dir, 3, shards, meta={"model": "vit"})
    train(world, zdp, 3, first_step=3)
    expected = zdp.full_params()

    half = world.split(world.rank % 2)
    ckpt = load_checkpoint(half, ckpt_dir)
    assert ckpt.world_size_saved == world.world_size and ckpt.meta == {"model": "vit"}
    resumed = ZeroDataParallel(make_model(seed=5), half, stage=loaded_stage, optimizer=adamw)
    resumed.load_shards(ckpt.read)
    assert resumed.optimizer.step_count == 3
    train(half, resumed, 3, first_step=3)
    # the resumed half sums gradients over fewer ranks, in another order: float64 round-off,
    # which Adam turns into differences of up to ~1e-13 in parameters near 0 (they are ~0.03)
    np.testing.assert_allclose(resumed.full_params(), expected, rtol=1e-10, atol=1e-11)
