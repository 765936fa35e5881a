"""rtxmpi.parallel.layout: one Layout object holds the layout rules; every problem at once; the
verdicts of the checks it replaced (planner, hybrid, pipeline, examples/train.py)."""
import importlib.util
from pathlib import Path

import pytest

from rtxmpi.errors import ConfigError
from rtxmpi.nn import GPT, GPTConfig, ViT, ViTConfig, gpt_units
from rtxmpi.parallel import pipeline_zero, schedule, zero
from rtxmpi.parallel.layout import (PIPELINE_ZERO_STAGES, SCHEDULES, ZERO_STAGES, Layout,
                                    ModelFacts, auto_micro_batches, model_facts, resolve_degrees)
from rtxmpi.parallel.planner import check_layout as planner_check
from rtxmpi.parallel.planner import make_plan

SMALL = GPTConfig.named("small", seq_len=128)  # n_head 4, n_layer 4, vocab 256
ODD = GPTConfig(vocab_size=255, seq_len=100, n_layer=3, n_head=6, n_embd=96)
MODELS = {"small": SMALL, "odd": ODD}


def rules(layout, world, model=SMALL, batch=32, **kw):
    return [why.split(":")[0] for why in layout.reasons(world, model, batch, **kw)]


# -- each rule -----------------------------------------------------------------------------------
@pytest.mark.parametrize("layout, world, model, batch, rule, text", [
    (Layout(2, 2), 8, SMALL, 32, "world size", "dp(2) * tp(2) * pp(1) * sp(1) = 4 != world_size(8)"),
    (Layout(None, 1, 3, 1, 3, schedule="gpipe"), 4, SMALL, 32, "world size",
     "world_size(4) is not divisible by tp(1) * pp(3) * sp(1) = 3, so no dp fits"),
    (Layout(1, 0), 1, SMALL, 32, "world size", "tp must be an integer >= 1, got 0"),
    (Layout(1, 1, 1, 8), 8, SMALL, 32, "heads", "n_head 4 is not divisible by tp * sp = 8"),
    (Layout(1, 2), 2, ODD, 32, "vocab", "vocab_size 255 is not divisible by tp 2"),
    (Layout(1, 1, 8, 1, 8, schedule="gpipe"), 8, SMALL, 32, "layers", "--pp 8 > n_layer 4"),
    (Layout(1, 1, 2, 1, 4, schedule="interleaved", virtual_stages=4), 2, SMALL, 32, "layers",
     "--pp 2 x --virtual-stages 4 > n_layer 4"),
    (Layout(1, 1, 1, 2), 2, GPTConfig(seq_len=31), 32, "sequence",
     "sequence length 31 is not divisible by sp(2)"),
    (Layout(1, 2, sequence_parallel=True), 2, GPTConfig(seq_len=31), 32, "sequence",
     "not divisible by tp * sp = 2 (Megatron sequence parallelism)"),
    (Layout(2, sequence_parallel=True), 2, SMALL, 32, "sequence", "it needs tp > 1"),
    (Layout(1, 1, 1, 2), 2, ViTConfig(), 32, "sequence",
     "sequence length 17 is not divisible by sp(2)"),  # 16 patches and the class token
    (Layout(1, 2, sequence_parallel=True), 2, ViTConfig(image_size=6), 32, "sequence",
     "PatchEmbedding needs every position"),
    (Layout(4), 4, SMALL, 2, "batch", "global batch 2 is smaller than the data-parallel size 4"),
    (Layout(3, 1, 2, 1, 2, schedule="gpipe"), 6, SMALL, 32, "batch", "a pipeline needs them equal"),
    (Layout(2, micro_batches=17), 2, SMALL, 32, "micro-batches", "fewer than 17 micro-batches"),
    (Layout(1, 1, 2, 1, 1, schedule="1f1b"), 2, SMALL, 32, "1f1b", "1F1B needs micro_batches >= "),
    (Layout(1, 1, 2, 1, 2, schedule="zb"), 2, SMALL, 32, "schedule", "unknown pipeline schedule 'zb'"),
    (Layout(1, 1, 2, 1, 1, schedule="interleaved", virtual_stages=2), 2, SMALL, 32, "interleaved",
     "must be a multiple of 2"),
    (Layout(1, 1, 2, 1, 2, schedule="1f1b", virtual_stages=2), 2, SMALL, 32, "1f1b",
     "virtual stages (2) need the interleaved schedule"),
    (Layout(2, virtual_stages=2), 2, SMALL, 32, "schedule", "it needs --pp > 1 and --schedule"),
    (Layout(2, zero_stage=4), 2, SMALL, 32, "zero", "ZeRO stage must be 0, 1, 2 or 3, got 4"),
    (Layout(1, 2, 2, 1, 2, 3, "1f1b"), 4, SMALL, 32, "zero",
     "--zero-stage 3 with --pp 2 shards stages of a plain model: tp(2) and sp(1) must be 1"),
    (Layout(1, 1, 2, 2, 2, 3, "1f1b"), 4, SMALL, 32, "zero", "tp(1) and sp(2) must be 1"),
    (Layout(2, offload="cpu"), 2, SMALL, 32, "offload", "--offload cpu needs --zero-stage 1, 2"),
    (Layout(2, zero_stage=1, offload="disk"), 2, SMALL, 32, "offload", "unknown offload 'disk'"),
    (Layout(1, 1, 2, 1, 2, 1, "1f1b", "cpu"), 2, SMALL, 32, "offload", "--offload cpu with --pp 2"),
    (Layout(2, recompute="all"), 2, SMALL, 32, "recompute", "unknown recompute policy 'all'"),
])
def test_each_rule_is_refused_with_its_name_and_a_message(layout, world, model, batch, rule, text):
    reasons = layout.reasons(world, model, batch)
    assert [why.split(":")[0] for why in reasons] == [rule], reasons
    assert text in reasons[0]
    with pytest.raises(ConfigError) as info:
        layout.check(world, model, batch)
    assert text in str(info.value) and not str(info.value).startswith(rule + ":")


def test_a_vit_splits_over_sp_when_its_positions_divide():
    assert Layout(1, 1, 1, 2).reasons(2, ViTConfig(image_size=6), 32) == []  # 9 patches + 1


def test_every_problem_is_reported_at_once():
    bad = Layout(2, 2, 2, 1, 1, 3, "1f1b", "cpu", "all")
    assert rules(bad, 4, ODD, 3) == ["world size", "vocab", "batch", "1f1b", "zero", "offload",
                                     "recompute"]
    with pytest.raises(ConfigError) as info:
        bad.check(4, ODD, 3)
    message = str(info.value)
    assert message.startswith("the layout dp2 tp2 pp2 sp1 m1 z3 1f1b offload-cpu recompute-all "
                              "has 7 problems: (1) dp(2) * tp(2) * pp(2) * sp(1) = 8")
    for part in ("(2) vocab_size 255", "(3) global batch 3 over dp 2", "(4) 1F1B needs",
                 "(5) --zero-stage 3 with --pp 2", "(6) --offload cpu with --pp 2",
                 "(7) unknown recompute policy 'all'"):
        assert part in message, message


def test_a_world_no_dp_fits_still_reports_the_other_problems():
    assert rules(Layout(None, 2, 2, recompute="all", schedule="gpipe", micro_batches=2), 6) == [
        "world size", "recompute"]


def test_check_returns_the_layout_with_dp_filled_in():
    assert Layout(None, 2, 2, 1, 2, schedule="1f1b").check(8, SMALL, 32).dp == 2
    assert Layout(None, 2).resolved(4) == Layout(2, 2) and Layout(None, 3).resolved(4).dp is None
    assert resolve_degrees(8, tp=2, pp=2) == (2, 2, 2, 1)
    with pytest.raises(ConfigError, match="DeviceMesh: dp must be an integer >= 1, got 0; tp must"):
        resolve_degrees(4, dp=0, tp=True)


def test_zero3_runs_under_every_pipeline_schedule_with_recompute():
    for schedule, V in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2)):
        layout = Layout(2, 1, 2, 1, 4, 3, schedule, recompute="blocks", virtual_stages=V)
        assert layout.reasons(4, SMALL, 32) == [], schedule
    assert 3 in PIPELINE_ZERO_STAGES


def test_recompute_runs_under_pipelines_and_unit_indices_are_left_to_the_model():
    assert Layout(1, 1, 2, 1, 2, 0, "1f1b", recompute="blocks").reasons(2, SMALL, 32) == []
    assert Layout(2, recompute=[1, 2]).reasons(2, SMALL, 32) == []


def test_without_a_pipeline_the_schedule_flag_is_ignored():
    assert Layout(2, schedule="1f1b").reasons(2, SMALL, 32) == []  # train.py's default
    assert Layout(1, 1, 2, 1, 2, schedule="none").schedule == "1f1b"  # a pipeline's default
    assert Layout(pp=2, micro_batches=2).reasons(2) == [] and Layout().dp is None
    assert Layout(1, 1, 2, 1, 2, schedule="zigzag").reasons(2)[0].startswith("schedule: unknown")


# -- the model facts -----------------------------------------------------------------------------
def test_model_facts_of_configs_models_and_units_are_general():
    gpt = model_facts(SMALL)
    assert (gpt.n_units, gpt.n_head, gpt.vocab_size, gpt.seq_len) == (4, 4, 256, 128)
    small = GPTConfig.named("tiny", seq_len=16)
    from_model, from_units = model_facts(GPT(small)), model_facts(gpt_units(small))
    assert from_model == model_facts(small)  # a model holding its cfg
    assert (from_units.n_units, from_units.n_head, from_units.vocab_size) == (
        small.n_layer, small.n_head, small.vocab_size)
    assert 4 * small.n_embd in from_units.widths and from_units.whole_sequence is None
    vit = model_facts(ViT(ViTConfig()))
    assert vit.whole_sequence == "PatchEmbedding" and vit.vocab_size is None
    assert model_facts(ViTConfig()).n_units == ViTConfig().n_layer

    class Own:  # a user's model describes itself
        def layout_facts(self):
            return ModelFacts(n_units=3, n_head=6, widths=(10,))

    assert rules(Layout(1, 4), 4, Own(), None) == ["heads", "width"]
    assert rules(Layout(1, 1, 4, 1, 4, schedule="gpipe"), 4, Own(), None) == ["layers"]
    with pytest.raises(ConfigError, match="cannot read the layout facts of a str"):
        model_facts("gpt")


def test_vit_units_refuse_megatron_sequence_parallelism_but_take_tp_and_sp():
    from rtxmpi.nn import vit_units
    units = vit_units(ViTConfig())
    assert rules(Layout(1, 2), 2, units, None) == []
    assert rules(Layout(1, 1, 1, 2), 2, units, None) == []  # T checked when the patches are made
    assert rules(Layout(1, 2, sequence_parallel=True), 2, units, None) == ["sequence"]


# -- the check the engines ask -------------------------------------------------------------------
def test_the_check_reports_every_problem():
    with pytest.raises(ConfigError, match=r"2 problems: \(1\) dp\(2\) \* tp\(1\).*\(2\) Megatron"):
        Layout(2, 1, 1, 2, sequence_parallel=True).check(2, seq_len=8)
    assert Layout(None, 2, zero_stage=3).check(4, seq_len=16).dp == 2
    with pytest.raises(ConfigError, match=r"2 problems: .*--pp 8 > n_layer 4.*"
                                          r"--offload nvme with --pp 8"):
        Layout(1, 1, 8, 1, 8, 3, "1f1b", "nvme").check(8, ModelFacts(n_units=4))
    Layout(1, 1, 2, 1, 2, 3, "1f1b").check(2, ModelFacts(n_units=4))


def test_auto_micro_batches_asks_the_layout():
    L = Layout(2, 1, 2, 1, schedule="1f1b")
    assert auto_micro_batches(L, 4, SMALL, 6) == 2 and auto_micro_batches(Layout(4), 4, SMALL, 6) == 1
    assert auto_micro_batches(Layout(1, 1, 4, 1, schedule="1f1b"), 4, SMALL, 6) == 6  # >= pp
    with pytest.raises(ConfigError, match="--zero-stage 3 with --pp 2"):  # whatever the count
        auto_micro_batches(Layout(1, 2, 2, 1, zero_stage=3, schedule="1f1b"), 4, SMALL, 6)
    with pytest.raises(ConfigError, match="divides the per-rank batch 1 suits --pp 2"):
        auto_micro_batches(L, 4, SMALL, 1)


def test_the_planner_rejects_by_the_layouts_rules():
    plan = make_plan(ODD, 12, 4, _profile(), max_micro_batches=4)
    keys = {why.split(":")[0] for _, why in plan.rejected}
    assert {"heads", "vocab", "layers", "1f1b", "zero"} <= keys, keys
    assert all(L.reasons(4, ODD, 12) == [] for L in (e.layout for e in plan.ranked))


def _profile():
    from rtxmpi.parallel.calibrate import default_profile
    return default_profile()


def test_every_module_takes_the_constants_from_the_layout():
    assert zero.STAGES == ZERO_STAGES[1:] and pipeline_zero.STAGES == PIPELINE_ZERO_STAGES[1:]
    assert set(SCHEDULES) == set(schedule.SCHEDULES)


# -- the same verdicts as the checks it replaced -------------------------------------------------
# (model, world, dp, tp, pp, sp, global batch, micro-batches, schedule, ZeRO stage, offload) ->
# the first rule the planner's check_layout gave before the layout object (None: valid; its
# "runtime: --zero-stage 3 / --offload with --pp" are now the "zero" / "offload" rules; ZeRO-3
# with --pp is refused only with tp or sp > 1 now, so a row that also offloads is "offload")
PLANNER_VERDICTS = [
    ("small", 4, 2, 1, 2, 1, 32, 4, "gpipe", 0, "none", None),
    ("odd", 2, 1, 1, 1, 2, 32, 2, "none", 0, "none", None),
    ("small", 8, 4, 2, 1, 1, 12, 2, "none", 0, "none", None),
    ("small", 4, 1, 1, 2, 2, 32, 2, "gpipe", 0, "none", None),
    ("small", 8, 1, 2, 2, 2, 12, 2, "1f1b", 0, "none", None),
    ("odd", 2, 1, 1, 2, 1, 12, 1, "gpipe", 0, "none", None),
    ("small", 4, 2, 1, 1, 2, 12, 3, "none", 3, "cpu", None),
    ("small", 4, 1, 2, 1, 2, 8, 1, "none", 2, "none", None),
    ("odd", 2, 1, 1, 2, 1, 32, 1, "gpipe", 0, "cpu", "offload"),
    ("small", 2, 2, 1, 1, 1, 2, 1, "none", 0, "cpu", "offload"),
    ("odd", 2, 1, 1, 2, 1, 12, 2, "1f1b", 1, "none", "zero"),
    ("small", 1, 1, 1, 1, 1, 8, 2, "none", 1, "cpu", "zero"),
    ("small", 8, 2, 1, 2, 2, 2, 2, "1f1b", 1, "none", "micro-batches"),
    ("odd", 8, 4, 1, 1, 2, 12, 4, "none", 3, "none", "micro-batches"),
    ("small", 8, 1, 2, 4, 1, 8, 3, "gpipe", 3, "cpu", "micro-batches"),
    ("small", 3, 3, 1, 4, 1, 2, 2, "1f1b", 3, "cpu", "world size"),
    ("odd", 4, 4, 2, 2, 2, 2, 1, "1f1b", 1, "none", "world size"),
    ("odd", 8, 2, 1, 2, 2, 2, 1, "1f1b", 1, "none", "1f1b"),
    ("small", 8, 1, 1, 4, 2, 2, 1, "1f1b", 1, "cpu", "1f1b"),
    ("small", 8, 4, 1, 2, 1, 2, 1, "gpipe", 0, "none", "batch"),
    ("small", 6, 3, 1, 2, 1, 32, 1, "gpipe", 1, "none", "batch"),
    ("small", 8, 2, 1, 4, 1, 12, 3, "gpipe", 1, "cpu", "offload"),
    ("small", 4, 1, 1, 2, 2, 8, 1, "gpipe", 1, "cpu", "offload"),
    ("odd", 6, 3, 1, 2, 1, 12, 4, "gpipe", 3, "cpu", "offload"),
    ("small", 4, 1, 1, 2, 2, 32, 2, "1f1b", 3, "none", "zero"),
    ("odd", 4, 1, 2, 1, 2, 32, 4, "none", 0, "none", "heads"),
    ("odd", 8, 1, 4, 2, 1, 12, 2, "gpipe", 0, "none", "heads"),
    ("odd", 2, 1, 2, 1, 1, 12, 1, "none", 0, "cpu", "vocab"),
    ("odd", 8, 4, 2, 1, 1, 12, 1, "none", 0, "none", "vocab"),
    ("odd", 4, 1, 1, 4, 1, 2, 2, "1f1b", 3, "none", "layers"),
    ("odd", 8, 2, 1, 4, 1, 12, 1, "1f1b", 0, "cpu", "layers"),
]


@pytest.mark.parametrize("row", PLANNER_VERDICTS, ids=lambda r: "-".join(map(str, r[:11])))
def test_planner_verdicts_are_those_of_the_checks_it_replaced(row):
    model, world, dp, tp, pp, sp, batch, m, sched, z, offload, rule = row
    why = planner_check(MODELS[model], Layout(dp, tp, pp, sp, m, z, sched, offload), batch, world)
    assert (why is None) == (rule is None), why
    assert rule is None or why.split(":")[0] == rule, why


# examples/train.py flags at a world size -> (dp, micro-batches) or the message check_args gave
# before the layout object (each still in the message, which may name more problems now)
TRAIN_VERDICTS = [
    (2, "--global-batch 8 --zero-stage 3 --offload cpu --seq-len 31 --micro-batches 4", (2, 4)),
    (4, "--global-batch 12 --tp 2 --pp 2 --schedule gpipe", (1, 2)),
    (8, "--global-batch 12 --pp 2 --sp 2", (2, 2)),
    (4, "--global-batch 8 --pp 2 --schedule interleaved --virtual-stages 2", (2, 2)),
    (6, "--global-batch 8", (6, 1)),
    (4, "--global-batch 12 --tp 2 --pp 2 --recompute blocks", (1, 2)),
    (2, "--global-batch 8 --sp 2 --offload cpu", "--offload cpu needs --zero-stage 1, 2 or 3"),
    (4, "--global-batch 12 --tp 2 --pp 2 --dp 2 --micro-batches 2",
     "dp(2) * tp(2) * pp(2) * sp(1) = 8 != world_size(4); set dp=1 or use 8 ranks"),
    (6, "--global-batch 8 --tp 2 --sp 2",
     "world_size(6) is not divisible by tp(2) * pp(1) * sp(2) = 4, so no dp fits"),
    (4, "--global-batch 8 --sp 2 --dp 2 --sequence-parallel",
     "Megatron sequence parallelism splits the sequence over tp: it needs tp > 1"),
    (2, "--global-batch 3 --sp 2 --virtual-stages 2 --micro-batches 1",
     "--virtual-stages 2 splits each pipeline rank's layers into chunks"),
    (2, "--global-batch 8 --sp 2 --seq-len 31", "sequence length 31 is not divisible by sp(2)"),
    (4, "--global-batch 3 --tp 2 --pp 2 --micro-batches 4 --schedule gpipe",
     "a --global-batch of 3 over 1 data-parallel ranks leaves 3 samples on the smallest rank"),
    (4, "--global-batch 12 --tp 2 --pp 2 --zero-stage 3",
     "--zero-stage 3 with --pp 2 shards stages of a plain model"),
    (6, "--global-batch 3 --micro-batches 4", "--global-batch 3 is smaller than the data-parallel size 6"),
    (4, "--global-batch 12 --pp 2 --sp 2 --zero-stage 1 --offload cpu", "--offload cpu with --pp 2"),
    (4, "--global-batch 3 --pp 2 --dp 2 --micro-batches 2 --schedule gpipe",
     "--global-batch 3 over dp 2 gives per-rank batches of 2, 1: a pipeline needs them equal"),
    (2, "--global-batch 3 --pp 2 --micro-batches 2 --schedule gpipe",
     "the per-rank batch 3 (--global-batch 3 over dp 1) is not divisible by 2 micro-batches"),
    (4, "--global-batch 8 --pp 4 --schedule interleaved --virtual-stages 2",
     "--pp 4 x --virtual-stages 2 > n_layer 4"),
    (4, "--global-batch 8 --pp 4 --micro-batches 1", "1F1B needs micro_batches >= pipeline stages"),
    (4, "--global-batch 3 --pp 2 --schedule interleaved --virtual-stages 2",
     "--micro-batches auto: no number of micro-batches that divides the per-rank batch 1"),
]


def _train_module():
    path = Path(__file__).resolve().parents[2] / "examples" / "train.py"
    spec = importlib.util.spec_from_file_location("train_for_layout_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train():
    return _train_module()


@pytest.mark.parametrize("world, flags, verdict", TRAIN_VERDICTS, ids=[f for _, f, _ in TRAIN_VERDICTS])
def test_train_flag_verdicts_are_those_of_the_checks_it_replaced(train, world, flags, verdict):
    args = train.parse_args(["--model", "small", "--steps", "5", *flags.split()])
    if isinstance(verdict, tuple):
        assert (train.check_args(args, world), args.micro_batches) == verdict
        return
    with pytest.raises(ConfigError) as info:
        train.check_args(args, world)
    assert verdict in str(info.value)


def test_the_layout_and_the_transformation_share_which_modules_need_every_position():
    from rtxmpi.nn.module import Sequential
    from rtxmpi.nn.modules import WHOLE_HEAD, WHOLE_INPUT, ClassTokenHead, Linear
    from rtxmpi.nn.modules import TransformerBlock as Block
    from rtxmpi.parallel import parallelize

    units = [Sequential(("inp", Linear(4, 8))), Block(8, 2, causal=False),
             Sequential(("head", ClassTokenHead(8, 3)))]
    assert model_facts(units).whole_sequence == "ClassTokenHead"  # a head alone is enough
    assert parallelize.WHOLE_INPUT is WHOLE_INPUT and parallelize.WHOLE_HEAD is WHOLE_HEAD
