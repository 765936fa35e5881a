"""`--micro-batches auto` (the default of examples/train.py): 1 without a pipeline, with --pp P the
smallest multiple of P that divides the per-rank batch, else the smallest divisor the schedule
accepts (rtxmpi.parallel.pipeline.auto_micro_batches); also chosen per layout by the elastic
re-plan."""
import importlib.util
from types import SimpleNamespace

import pytest

from rtxmpi.elastic.replan import replan
from rtxmpi.errors import ConfigError
from rtxmpi.nn import GPTConfig
from rtxmpi.parallel.layout import Layout, ModelFacts
from rtxmpi.parallel.pipeline import auto_micro_batches
from rtxmpi.parallel.schedule import build_schedule


@pytest.mark.parametrize("pp, batch, schedule, virtual, want", [
    (1, 16, "1f1b", 1, 1),          # no pipeline: no accumulation
    (2, 16, "1f1b", 1, 2),          # the smallest multiple of pp that divides the batch
    (4, 6, "1f1b", 1, 6),           # no multiple of 4 divides 6: the smallest divisor >= 4
    (2, 3, "1f1b", 1, 3),
    (2, 1, "gpipe", 1, 1),          # GPipe runs any count
    (2, 8, "interleaved", 2, 2),
])
def test_auto_micro_batches_picks_the_smallest_count_the_schedule_and_batch_allow(
        pp, batch, schedule, virtual, want):
    got = auto_micro_batches(pp=pp, per_rank_batch=batch, schedule=schedule, n_layer=4,
                             virtual_stages=virtual)
    assert got == want and batch % got == 0
    Layout(1, 1, pp, 1, got, 0, schedule, virtual_stages=virtual).check(pp, ModelFacts(n_units=4))
    smaller = [m for m in range(1, got) if batch % m == 0]
    for m in smaller:  # every smaller divisor is refused by the schedule, or is not a multiple of pp
        try:
            build_schedule(schedule, m, pp, virtual)
        except ConfigError:
            continue
        assert m % pp and got % pp == 0, (m, got)


def test_auto_micro_batches_errors_name_the_batch_or_keep_the_layout_error():
    with pytest.raises(ConfigError, match="no number of micro-batches that divides the per-rank "
                                          "batch 1 suits --pp 2 --schedule 1f1b"):
        auto_micro_batches(pp=2, per_rank_batch=1, schedule="1f1b", n_layer=4)
    with pytest.raises(ConfigError, match="--offload cpu with --pp 2 is not supported"):
        auto_micro_batches(pp=2, per_rank_batch=8, schedule="1f1b", n_layer=4, zero_stage=3,
                           offload="cpu")
    assert auto_micro_batches(pp=2, per_rank_batch=8, schedule="1f1b", n_layer=4, zero_stage=3) == 2
    with pytest.raises(ConfigError, match="--pp 8 > n_layer 4"):
        auto_micro_batches(pp=8, per_rank_batch=8, schedule="1f1b", n_layer=4)


def test_elastic_replan_chooses_auto_micro_batches_per_layout():
    cfg = GPTConfig.named("tiny", seq_len=32)
    layout, _, why = replan(4, cfg, 8, pp=2, micro_batches=None)
    assert (layout.dp, layout.pp, layout.micro_batches, why) == (2, 2, 2, "")
    layout, _, why = replan(3, cfg, 8, pp=2, micro_batches=None)  # pp dropped: no accumulation
    assert (layout.dp, layout.pp, layout.micro_batches) == (3, 1, 1) and "does not divide" in why
    layout, _, _ = replan(2, cfg, 8, pp=2, micro_batches=4)  # an explicit count is kept
    assert (layout.pp, layout.micro_batches) == (2, 4)


def load_train_example():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "train.py"
    spec = importlib.util.spec_from_file_location("train_for_micro_batches", path)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    return train


def test_train_flag_defaults_to_auto_keeps_explicit_counts_and_the_banner_says_which():
    train = load_train_example()
    assert train.parse_args([]).micro_batches is None and train.parse_args([]).micro_batches_auto
    assert train.parse_args(["--micro-batches", "auto"]).micro_batches is None
    explicit = train.parse_args(["--micro-batches", "3"])
    assert explicit.micro_batches == 3 and not explicit.micro_batches_auto
    with pytest.raises(SystemExit) as exc:
        train.parse_args(["--micro-batches", "many"])
    assert exc.value.code == 2
    args = train.parse_args(["--pp", "2", "--global-batch", "8", "--model", "tiny"])
    assert train.check_args(args, 4) == 2 and args.micro_batches == 2  # dp 2: per-rank 4 -> 2
    assert train._micro_note(args) == ", 2 micro-batches (auto), schedule 1f1b"
    interleaved = train.parse_args(["--pp", "2", "--micro-batches", "4", "--schedule",
                                    "interleaved", "--virtual-stages", "2"])
    assert train._micro_note(interleaved) == ", 4 micro-batches, schedule interleaved (V=2)"
    assert train._micro_note(SimpleNamespace(pp=1, micro_batches=1, micro_batches_auto=True,
                                             plan=None)) == ""
    assert train._micro_note(explicit) == ", 3 micro-batches"
