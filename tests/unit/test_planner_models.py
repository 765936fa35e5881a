"""The planner's model side (rtxmpi.parallel.planner.model_costs) on models other than the GPT:
the ViT at 1, 2, 4 and 8 ranks, a Model of one's own of the shipped modules, the estimate against
the memory the model measurably holds (rtxmpi.observe.memory), and `rtxmpi plan --model-kind vit`."""
from dataclasses import replace

import numpy as np
import pytest

from rtxmpi.errors import ConfigError
from rtxmpi.nn import GPT, GPTConfig, ViT, ViTConfig, gpt_units, vit_units
from rtxmpi.nn.module import Model, Sequential
from rtxmpi.nn.modules import (MLP, ClassificationHead, Embedding, LayerNorm, LMHead,
                               PositionalEmbedding, TransformerBlock)
from rtxmpi.nn.optim import AdamW
from rtxmpi.observe.memory import cache_bytes, optimizer_state_bytes
from rtxmpi.parallel.planner import (Layout, _Costs, _stage_params, activation_bytes, calibration_config,
                                     estimate, make_plan, memory_breakdown, model_costs)
from tests.unit.test_planner import _cli, synthetic

VIT = ViTConfig()  # "small": 4 blocks, 4 heads, n_embd 64, 17 positions


def own_model(tied=False):
    """A classifier (or, tied, a language model) of one's own from the shipped modules."""
    first = [Embedding(48, 32, "tok"), PositionalEmbedding(12, 32, "pos")]
    blocks = [(f"b{i}", TransformerBlock(32, 2, causal=tied)) for i in range(3)]
    head = ([("ln", LayerNorm(32)), ("lm", LMHead(48, 32, tied_to="tok"))] if tied else
            [("ln", LayerNorm(32)), ("cls", ClassificationHead(32, 5))])
    return Model([Sequential(*first)] + blocks + [Sequential(*head)], seed=0)


def test_the_gpt_costs_are_the_same_from_its_config_its_model_and_its_units():
    cfg = GPTConfig.named("small", seq_len=64)
    from_cfg = model_costs(cfg)
    from_model = model_costs(GPT(cfg))
    from_units = model_costs(gpt_units(cfg), seq_len=64)
    assert from_cfg.num_params == GPT(cfg).num_params
    assert (from_cfg.head_tied, from_cfg.head_per_position, from_cfg.first_vocab) == (
        cfg.vocab_size * cfg.n_embd, True, True)
    for other in (from_model, from_units):
        assert {k: v for k, v in vars(other).items() if k not in ("facts", "name")} == {
            k: v for k, v in vars(from_cfg).items() if k not in ("facts", "name")}
    L = Layout(2, 2, 1, 1, 2, 1)
    assert estimate(cfg, L, 32, synthetic()).total_ms == estimate(from_units, L, 32,
                                                                  synthetic()).total_ms
    assert calibration_config(cfg) is cfg


def test_vit_costs_count_its_units_and_its_parameters():
    c = model_costs(VIT)
    assert c.n_layer == VIT.n_layer == len(vit_units(VIT)) - 2
    assert c.num_params == ViT(VIT).num_params == model_costs(ViT(VIT)).num_params
    assert (c.seq_len, c.head_width, c.head_per_position, c.head_tied) == (17, 10, False, 0)
    assert c.first_flops == 2 * (2 * 2 * 1 * 64) * 16  # the patch matmul over 16 patches
    for pp in (1, 2, 4):
        params, blocks = _stage_params(c, pp)
        assert sum(params) == c.num_params and sum(blocks) == VIT.n_layer and min(blocks) >= 1
    stand_in = calibration_config(VIT)
    assert (stand_in.n_layer, stand_in.n_head, stand_in.n_embd, stand_in.seq_len) == (4, 4, 64, 17)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_vit_plans_at_every_world_size_with_consistent_estimates(world_size):
    plan = make_plan(VIT, 32, world_size, synthetic())
    assert plan.ranked and plan.best.total_ms > 0
    assert all(e.layout.sp == 1 for e in plan.ranked)  # 17 positions do not split over sp
    if world_size > 1:
        assert any(L.sp > 1 and "sequence" in why for L, why in plan.rejected)
    if world_size == 1:
        return
    peaks = [memory_breakdown(VIT, Layout(world_size, 1, 1, 1, 1, z), 32)[0]["total"]
             for z in (0, 1, 2, 3)]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]
    # a pipeline splits the model state: each stage holds less than the whole model
    whole = memory_breakdown(VIT, Layout(1, 1, 1, 1, 2), 32)[0]
    stages = memory_breakdown(VIT, Layout(1, 1, 2, 1, 2, 0, "1f1b"), 32)
    assert max(s["total"] for s in stages) < whole["total"]
    assert sum(s["params"] for s in stages) == whole["params"] == 4 * ViT(VIT).num_params


def test_a_model_of_ones_own_is_planned_from_its_units():
    model = own_model()
    c = model_costs(model)
    assert (c.n_layer, c.seq_len, c.head_width, c.num_params) == (3, 12, 5, model.num_params)
    plan = make_plan(model, 8, 2, synthetic())
    assert plan.ranked and {e.layout.degrees for e in plan.ranked} >= {(2, 1, 1, 1), (1, 1, 2, 1)}
    tied = model_costs(own_model(tied=True))
    assert tied.head_tied == 48 * 32 and tied.head_vocab
    # the tied table is copied into the last stage only when the model is split
    assert sum(_stage_params(tied, 1)[0]) == tied.num_params
    assert sum(_stage_params(tied, 3)[0]) == tied.num_params + 48 * 32


def test_a_model_the_cost_model_cannot_read_is_refused_by_name():
    units = [PositionalEmbedding(8, 16), TransformerBlock(16, 2), MLP(16),
             ClassificationHead(16, 3)]
    with pytest.raises(ConfigError, match="unit 2 of the model is a MLP"):
        model_costs(units)
    with pytest.raises(ConfigError, match="pass seq_len"):
        model_costs([LayerNorm(16), TransformerBlock(16, 2), ClassificationHead(16, 3)])
    with pytest.raises(ConfigError, match="first unit, at least one block and a head"):
        model_costs([PositionalEmbedding(8, 16), ClassificationHead(16, 3)])
    with pytest.raises(ConfigError, match="cannot plan a str"):
        make_plan("vit", 32, 2, synthetic())


def test_vit_memory_estimate_is_what_the_model_holds():
    """Parameters, gradients and AdamW are the bytes the model and optimizer hold; the
    activations of one micro-batch are its forward cache (observe.memory.cache_bytes) within 5%
    (the head's LayerNorm cache is not counted), each block's within 1%."""
    B = 8
    model = ViT(VIT)
    images = np.random.default_rng(0).random((B, 8, 8, 1)).astype(np.float32)
    _, cache = model.forward(images, np.arange(B) % 10)
    est = memory_breakdown(VIT, Layout(1, 1, 1, 1, 1), B)[0]
    assert est["params"] == model.flat_data.nbytes and est["grads"] == model.flat_grad.nbytes
    mask = np.ones(model.num_params, np.float32)  # what the engines hand AdamW
    assert est["optimizer"] == optimizer_state_bytes(AdamW(model.flat_data, decay_mask=mask))
    per_block = activation_bytes(VIT, Layout(1), B)[0]
    for unit in cache.units[1:-1]:
        assert cache_bytes(unit) == pytest.approx(per_block, rel=0.01)
    held = cache_bytes(cache, [model.flat_data, model.flat_grad])
    assert est["activations"] == pytest.approx(held, rel=0.05)


def test_cli_plans_the_vit_and_refuses_the_other_kinds_flags(capsys):
    r = _cli(capsys, "--model-kind", "vit", "--vit-size", "tiny", "--world-size", "2")
    assert r.returncode == 0, r.stderr
    assert "ViT tiny" in r.stdout and "x 17 positions" in r.stdout and "Chosen: " in r.stdout
    r = _cli(capsys, "--model-kind", "vit", "--seq-len", "16", "--world-size", "2")
    assert r.returncode == 2 and "--seq-len is the GPT's" in r.stderr
    r = _cli(capsys, "--patch", "4", "--world-size", "2")
    assert r.returncode == 2 and "--patch is the ViT's" in r.stderr
    r = _cli(capsys, "--model-kind", "vit", "--patch", "3", "--world-size", "2")
    assert r.returncode == 2 and "error: " in r.stderr


def test_vit_under_sp_runs_its_patch_embedding_whole_on_every_sp_rank():
    """65 positions and 5 heads split over sp = 5: planned, and the patch matmul per rank is the
    same as without sp (the unit needs every position: it runs whole on each sp rank)."""
    cfg = ViTConfig(patch_size=1, n_head=5, n_embd=40)
    plan = make_plan(cfg, 40, 5, synthetic())
    assert any(e.layout.sp == 5 for e in plan.ranked)
    c, p = model_costs(cfg), synthetic()
    matmul = [_Costs(c, L, 8, p, 1).emb_f - _Costs(replace(c, first_flops=0.0), L, 8, p, 1).emb_f
              for L in (Layout(1), Layout(1, 1, 1, 5))]
    assert matmul[0] > 0 and matmul[0] == pytest.approx(matmul[1])
