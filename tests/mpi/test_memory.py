"""rtxmpi.observe.memory across ranks: gather_reports and ZeRO's sharded optimizer bytes."""
import numpy as np
import pytest

from rtxmpi.nn import GPT, GPTConfig
from rtxmpi.observe.memory import gather_reports, report
from rtxmpi.parallel.zero import STAGES, ZeroDataParallel, shard_range


def test_gather_reports_returns_every_rank_in_order(world):
    model = GPT(GPTConfig.named("tiny", seq_len=8))
    reports = gather_reports(world, report(model=model, rank=world.rank))
    assert [r.rank for r in reports] == list(range(world.world_size))
    assert all(r.params_bytes == model.flat_data.nbytes for r in reports)
    assert all(r.peak_rss_bytes > 0 for r in reports)


def test_zero1_optimizer_bytes_are_this_ranks_shard(world):
    model = GPT(GPTConfig.named("tiny", seq_len=8))
    zdp = ZeroDataParallel(model, world, stage=1)
    start, stop = shard_range(model.num_params, world.world_size, world.rank)
    mine = report(zdp)
    assert mine.rank == world.rank
    assert mine.optimizer_bytes == 4 * 4 * (stop - start)  # m, v, decay mask, scratch (float32)
    total = sum(r.optimizer_bytes for r in gather_reports(world, mine))
    assert total == 4 * 4 * model.num_params


@pytest.mark.skipif(3 not in STAGES, reason="ZeRO stage 3 is not available")
def test_zero3_reports_sharded_params_and_transient_peak(world):
    model = GPT(GPTConfig.named("tiny", seq_len=8))
    numel = model.num_params
    zdp = ZeroDataParallel(model, world, stage=3)
    x = np.arange(16, dtype=np.int64).reshape(2, 8) % 256
    _, cache = zdp.forward(x, x)
    zdp.backward(cache)
    zdp.step()
    mine = report(zdp)
    start, stop = shard_range(numel, world.world_size, world.rank)
    assert 4 * (stop - start) <= mine.params_bytes <= 4 * -(-numel // world.world_size)
    assert mine.transient_peak_bytes > 0
