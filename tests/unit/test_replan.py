"""rtxmpi.elastic.replan: the layout survivors of a shrink choose without talking (docs/elastic.md)."""
import pytest

from rtxmpi.elastic.replan import candidates, replan
from rtxmpi.elastic.shrink import _complete_step
from rtxmpi.errors import ConfigError
from rtxmpi.nn import GPTConfig

TINY = GPTConfig.named("tiny", seq_len=32)   # n_head 2, n_layer 2
SMALL = GPTConfig.named("small", seq_len=32)  # n_head 4, n_layer 4


def test_the_rule_keeps_tp_longest_and_drops_sp_then_pp():
    assert candidates(4, 2, 2) == [(4, 2, 2), (4, 2, 1), (4, 1, 2), (4, 1, 1), (2, 1, 1), (1, 1, 1)]
    assert candidates(1, 1, 1) == [(1, 1, 1)]


def test_user_degrees_are_kept_when_they_still_fit():
    layout, seq_par, why = replan(6, TINY, 12, tp=2, sequence_parallel=True)
    assert layout.degrees == (3, 2, 1, 1) and seq_par and why == ""


def test_tp2_dp2_shrunk_to_3_ranks_becomes_dp3():
    layout, seq_par, why = replan(3, TINY, 12, tp=2, sequence_parallel=True)
    assert layout.degrees == (3, 1, 1, 1) and not seq_par  # Megatron SP needs tp > 1
    assert why == "tp 2 x pp 1 x sp 1 = 2 does not divide 3 ranks"


def test_pipeline_is_dropped_before_tensor_parallelism():
    layout, _, why = replan(6, SMALL, 12, tp=2, pp=2, micro_batches=2)
    assert layout.degrees == (3, 2, 1, 1) and layout.micro_batches == 2
    assert why.startswith("tp 2 x pp 2 x sp 1 = 4 does not divide 6")


def test_micro_batches_are_capped_at_the_per_rank_batch():
    layout, _, _ = replan(3, SMALL, 6, pp=2, micro_batches=4)  # 2 samples per rank
    assert layout.degrees == (3, 1, 1, 1) and layout.micro_batches == 2


def test_without_a_pipeline_the_global_batch_may_split_unevenly():
    layout, _, _ = replan(3, TINY, 8, tp=2)  # 3, 3, 2 samples (docs/elastic.md)
    assert layout.degrees == (3, 1, 1, 1)
    layout, _, why = replan(6, SMALL, 8, pp=2, micro_batches=2)  # a pipeline needs it even
    assert layout.degrees == (6, 1, 1, 1) and layout.micro_batches == 1  # 1 or 2 samples a rank
    assert why == ("dp3 tp1 pp2 sp1 m2 z0 1f1b: global batch 8 over dp 3 gives per-rank batches "
                   "of 3, 3, 2: a pipeline needs them equal; use a global batch divisible by 3")


def test_nothing_fits_is_a_config_error_naming_every_candidate():
    with pytest.raises(ConfigError, match="no parallel layout fits 3 ranks .elastic re-plan.*n_head 2 is not "
                                          "divisible by tp . sp = 3.*global batch 2 is smaller "
                                          "than the data-parallel size 3"):
        replan(3, TINY, 2, tp=3)


def test_complete_step_is_the_newest_step_holding_every_shard_key():
    # rows: (applied step, key, keys) per survivor in new-rank order
    assert _complete_step([[6, 0, 2], [6, 0, 2], [6, 1, 2]], 2) == (6, {0: 0, 1: 2})
    assert _complete_step([[5, 0, 2], [6, 0, 2], [6, 1, 2]], 2) == (6, {0: 1, 1: 2})
    assert _complete_step([[6, 0, 2], [5, 1, 2]], 2) == (None, None)  # no step has both keys
    assert _complete_step([[-1, 0, 2], [-1, 1, 2]], 2) == (None, None)  # nothing applied yet


def test_interleaved_virtual_stages_are_checked_with_a_kept_pipeline():
    layout, _, why = replan(6, SMALL, 12, pp=2, micro_batches=2, schedule="interleaved",
                            virtual_stages=2)  # 2 stages x 2 chunks of SMALL's 4 blocks
    assert layout.degrees == (3, 1, 2, 1) and layout.schedule == "interleaved" and why == ""
    layout, _, why = replan(6, SMALL, 12, pp=2, micro_batches=2, schedule="interleaved",
                            virtual_stages=4)  # 8 chunks > 4 blocks: the pipeline is dropped
    assert layout.degrees == (6, 1, 1, 1) and "n_layer 4" in why
