"""CI gate: ZeRO's accounted per-rank model-state bytes against data parallelism's.

Bytes the engines hold (rtxmpi.observe.memory.report), never timings, so the check is exact and
deterministic at any world size. The bound is bench/memory.py's target: ZeRO-3 per-rank
params + grads + optimizer <= (DP's / world_size + the largest unit's parameters) x 1.05, the
unit being what ZeRO-3 gathers at once (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC 2020, stage P_os+g+p).
"""
import numpy as np
import pytest

from rtxmpi.nn import GPT, AdamW, GPTConfig, decay_mask
from rtxmpi.observe.memory import report
from rtxmpi.parallel.data import DataParallel
from rtxmpi.parallel.zero import STAGES, ZeroDataParallel


def one_step(engine, step):
    x = np.arange(16, dtype=np.int64).reshape(2, 8) % 256
    _, cache = engine.forward(x, x)
    engine.backward(cache)
    step()


def dp_model_state_bytes(world, cfg):
    model = GPT(cfg, seed=0)
    engine = DataParallel(model, world)
    optimizer = AdamW(model.flat_data, lr=1e-3, decay_mask=decay_mask(model.params))
    one_step(engine, lambda: engine.step(optimizer))
    return report(engine, model=model, optimizer=optimizer).model_state_bytes


def max_over_ranks(world, value):
    buf = np.array([value], np.int64)
    world.all_reduce(buf, op="max")
    return int(buf[0])


@pytest.mark.skipif(3 not in STAGES, reason="ZeRO stage 3 is not available")
def test_zero3_model_state_is_a_world_share_plus_one_unit(world):
    cfg = GPTConfig.named("tiny", seq_len=8)
    dp = dp_model_state_bytes(world, cfg)
    model = GPT(cfg, seed=0)
    unit_bytes = max(sum(p.size for p in model.params[a:b]) for a, b in model.units) * model.dtype.itemsize
    engine = ZeroDataParallel(model, world, stage=3)
    one_step(engine, engine.step)
    zero3 = max_over_ranks(world, report(engine).model_state_bytes)
    bound = (dp / world.world_size + unit_bytes) * 1.05
    assert zero3 <= bound, (f"ZeRO-3 holds {zero3} B of model state on its largest rank; the bound at "
                            f"{world.world_size} ranks is (DP {dp} B / {world.world_size} + unit "
                            f"{unit_bytes} B) x 1.05 = {bound:.0f} B")


@pytest.mark.parametrize("stage", [s for s in (1, 2) if s in STAGES])
def test_zero1_and_2_optimizer_state_is_a_world_share(world, stage):
    model = GPT(GPTConfig.named("tiny", seq_len=8), seed=0)
    engine = ZeroDataParallel(model, world, stage=stage)
    one_step(engine, engine.step)
    mine = max_over_ranks(world, report(engine).optimizer_bytes)
    share = -(-model.num_params // world.world_size) * 4 * 4  # m, v, decay mask, scratch: float32
    assert mine <= share, f"stage {stage}: optimizer holds {mine} B on its largest rank, share {share} B"


@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(3 not in STAGES, reason="ZeRO stage 3 is not available")
def test_zero3_with_tensor_parallelism_is_a_world_share_plus_one_unit(world):
    """ZeRO-3 over dp of each tp slice (rtxmpi.parallel.zero_hybrid, tp = 2): the same bound as
    plain ZeRO-3, the share being 1/world of the one-process model (tp splits it, dp shards
    each slice); the replicated LayerNorms, wpe and biases are the only excess."""
    from rtxmpi.mesh import DeviceMesh
    from rtxmpi.parallel.hybrid import ParallelGPT
    from rtxmpi.parallel.zero_hybrid import ZeroHybridParallel

    if world.world_size % 2:
        pytest.skip("needs an even world size (tp = 2)")
    cfg = GPTConfig.named("tiny", seq_len=8)
    dp = dp_model_state_bytes(world, cfg)
    model = ParallelGPT(cfg, DeviceMesh(dp=world.world_size // 2, tp=2, group=world), seed=0)
    unit_bytes = max(sum(p.size for p in model.params[a:b]) for a, b in model.units) * model.dtype.itemsize
    engine = ZeroHybridParallel(model, stage=3)
    x = np.arange(16, dtype=np.int64).reshape(2, 8) % 256
    _, cache = engine.forward(x, x)
    engine.backward(cache)
    engine.step()
    zero3 = max_over_ranks(world, report(engine).model_state_bytes)
    bound = (dp / world.world_size + unit_bytes) * 1.05
    assert zero3 <= bound, (f"ZeRO-3 x tp 2 holds {zero3} B of model state on its largest rank; the "
                            f"bound at {world.world_size} ranks is (DP {dp} B / {world.world_size} "
                            f"+ unit {unit_bytes} B) x 1.05 = {bound:.0f} B")
