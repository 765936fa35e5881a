"""rtxmpi.train.build_parallel in one process: what it returns for the loop (Parts), the layout
checked before anything is built (every problem at once), recompute applied, the gathered model."""
import numpy as np
import pytest

import rtxmpi
from rtxmpi.errors import ConfigError
from rtxmpi.nn import AdamW, Model, Sequential, ViT, ViTConfig, decay_mask
from rtxmpi.nn.modules import ClassificationHead, LayerNorm, Linear
from rtxmpi.parallel.layout import Layout, model_facts
from rtxmpi.train import build_parallel

VIT = ViTConfig(n_layer=2, n_head=4, n_embd=16, n_classes=5)


@pytest.fixture(scope="module")
def world():
    return rtxmpi.init()


def adamw(params, mask):
    return AdamW(params, lr=1e-2, decay_mask=mask)


def mlp(seed=0):
    """A model without attention: Linear, two LayerNorm + Linear units, a classifier."""
    return Model([Sequential(("inp", Linear(6, 8, split="replicated")))]
                 + [(f"u{i}", Sequential(("ln", LayerNorm(8)), ("fc", Linear(8, 8, split="replicated"))))
                    for i in range(2)]
                 + [Sequential(("head", ClassificationHead(8, 3)))], seed=seed)


def batch(rng, n=8):
    return rng.standard_normal((n, 2, 6)).astype(np.float32), rng.integers(0, 3, n)


class Factory:
    def __init__(self, make):
        self.make, self.calls = make, 0

    def __call__(self):
        self.calls += 1
        return self.make()


def test_every_problem_of_the_layout_at_once_before_an_engine_is_built(world):
    make = Factory(lambda: ViT(VIT))
    layout = Layout(dp=None, pp=3, sp=2, schedule="1f1b", recompute="sometimes")
    with pytest.raises(ConfigError) as err:
        build_parallel(make, world, layout, optimizer=adamw, global_batch=8)
    text = str(err.value)
    assert "has 5 problems" in text, text
    for problem in ("world_size(1) is not divisible by tp(1) * pp(3) * sp(2)",
                    "--pp 3 > n_layer 2", "sequence length 17 is not divisible by sp(2)",
                    "1F1B needs micro_batches", "unknown recompute policy 'sometimes'"):
        assert problem in text, text
    assert make.calls == 1  # the one-process model the rules read; no engine


def test_the_global_batch_is_checked_against_the_layout(world):
    with pytest.raises(ConfigError, match="global batch must be an integer >= 1, got 0"):
        build_parallel(mlp, world, Layout(dp=1), optimizer=adamw, global_batch=0)


def test_a_model_without_attention_has_no_heads_rule_under_tp():
    assert model_facts(mlp()).n_head is None
    assert Layout(dp=1, tp=2).reasons(2, mlp()) == []
    assert Layout(dp=1, tp=2).reasons(2, ViT(VIT)) == []  # 4 heads over 2
    assert [r.split(":")[0] for r in Layout(dp=1, tp=3).reasons(3, ViT(VIT))] == ["heads"]


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_parts_recompute_and_training_match_the_model_alone(world, zero_stage):
    built = build_parallel(mlp, world, Layout(dp=None, zero_stage=zero_stage, recompute="blocks"),
                           optimizer=adamw, global_batch=8)
    assert (built.layout.dp, built.mesh, built.pipelined) == (1, None, False)
    assert built.model.recompute_units == [1, 2]
    parts = built.parts("sampler", 8, unit="samples")
    assert (parts.model, parts.engine, parts.sampler, parts.unit) == (built.model, built.engine,
                                                                      "sampler", "samples")
    assert (parts.data_rank, parts.data_size, parts.zero_stage) == (0, 1, zero_stage)
    assert parts.replica == (None if zero_stage else "tensors") and parts.close is None

    alone = mlp()
    opt = adamw(alone.flat_data, decay_mask(alone.params))
    rng = np.random.default_rng(0)
    for _ in range(2):
        x, y = batch(rng)
        loss, cache = built.engine.forward(x, y)
        built.engine.backward(cache)
        built.engine.step()
        want, cache = alone.forward(x, y)
        alone.backward(cache)
        opt.step(alone.flat_grad)
        alone.zero_grad()
        assert loss == want
    np.testing.assert_allclose(built.engine.full_params(), alone.flat_data, rtol=1e-6, atol=1e-9)
    gathered = built.gathered_model()
    assert gathered is not built.model and gathered is built.gathered_model()
    np.testing.assert_array_equal(gathered.flat_data, built.engine.full_params())


def test_nvme_offload_closes_through_parts(world, tmp_path):
    built = build_parallel(mlp, world, Layout(dp=1, zero_stage=2, offload="nvme"),
                           optimizer=adamw, offload_dir=str(tmp_path))
    parts = built.parts("sampler", 8)
    assert parts.close == built.engine.close
    parts.close()
