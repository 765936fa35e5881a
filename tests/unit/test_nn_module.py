"""The module protocol: gradcheck of every shipped module and of a module defined here, what
gradcheck catches, Model layout / init / tied parameters / unit order / grad_ready, errors, and
the runnable example of docs/model.md."""
import math
import pathlib
import re

import numpy as np
import pytest

from rtxmpi import nn
from rtxmpi.errors import ConfigError
from rtxmpi.nn import (MLP, ClassificationHead, Embedding, GradcheckError, LayerNorm, Linear,
                       LMHead, Model, Module, MultiHeadAttention, ParamDecl, PatchEmbedding,
                       PositionalEmbedding, Sequential, TransformerBlock, gradcheck)
from rtxmpi.nn.modules import GELU, AttentionCore, BiasGELU

B, T, C, H, V, K = 2, 5, 8, 2, 7, 3
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def rng():
    return np.random.default_rng(11)


def x_btc(rng):
    return rng.standard_normal((B, T, C))


def qkv_bhts(rng):
    return tuple(rng.standard_normal((B, H, T, C // H)) for _ in range(3))


# ------------------------------------------------------------------------- gradcheck
SHIPPED = {
    "Embedding": lambda rng: (Embedding(V, C), rng.integers(0, V, (B, T)), None),
    "PositionalEmbedding": lambda rng: (PositionalEmbedding(T + 1, C), x_btc(rng), None),
    "PatchEmbedding": lambda rng: (PatchEmbedding(2, 3, C), rng.standard_normal((B, 4, 6, 3)),
                                   None),
    "LayerNorm": lambda rng: (LayerNorm(C), x_btc(rng), None),
    "Linear": lambda rng: (Linear(C, 6), x_btc(rng), None),
    "Linear-row-no-bias": lambda rng: (Linear(C, 6, bias=False, split="row"), x_btc(rng), None),
    "MultiHeadAttention-causal": lambda rng: (MultiHeadAttention(C, H), x_btc(rng), None),
    "MultiHeadAttention-bidirectional": lambda rng: (MultiHeadAttention(C, H, causal=False),
                                                     x_btc(rng), None),
    "MLP": lambda rng: (MLP(C), x_btc(rng), None),
    "GELU": lambda rng: (GELU(), x_btc(rng), None),
    "BiasGELU-after-Linear": lambda rng: (Sequential(("fc", Linear(C, 6, bias=False)),
                                                     ("act", BiasGELU(6))), x_btc(rng), None),
    "AttentionCore-causal": lambda rng: (AttentionCore(), qkv_bhts(rng), None),
    "AttentionCore-bidirectional": lambda rng: (AttentionCore(causal=False), qkv_bhts(rng),
                                                None),
    "TransformerBlock-causal": lambda rng: (TransformerBlock(C, H), x_btc(rng), None),
    "TransformerBlock-bidirectional": lambda rng: (TransformerBlock(C, H, causal=False),
                                                   x_btc(rng), None),
    "LMHead": lambda rng: (LMHead(V, C), x_btc(rng), rng.integers(0, V, (B, T))),
    "LMHead-tied": lambda rng: (LMHead(V, C, tied_to="wte"), x_btc(rng),
                                rng.integers(0, V, (B, T))),
    "ClassificationHead": lambda rng: (ClassificationHead(C, K), x_btc(rng),
                                       rng.integers(0, K, B)),
    "Sequential": lambda rng: (Sequential(("ln", LayerNorm(C)), ("fc", Linear(C, C))), x_btc(rng),
                               None),
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_shipped_module_passes_gradcheck(rng, name):
    module, x, targets = SHIPPED[name](rng)
    errors = gradcheck(module, x, targets)
    inputs = ({f"x[{i}]" for i in range(len(x))} if isinstance(x, tuple)
              else {"x"} if x.dtype.kind == "f" else set())
    assert set(errors) == {d.name for d in module.param_specs()} | inputs
    assert max(errors.values()) < 1e-6


@pytest.mark.parametrize("causal", [True, False])
def test_a_block_composed_of_its_own_sublayers_is_bitwise_its_forward_and_backward(rng, causal):
    """forward_with / backward_with (what the tensor-parallel block runs with its parallel
    sublayers) are the block's operations in its order."""
    block = TransformerBlock(C, H, causal=causal)
    attn, mlp = block.parts[1][1], block.parts[3][1]
    params = [rng.standard_normal(d.shape) + (d.init == "ones") for d in block.param_specs()]
    x, dy = x_btc(rng), x_btc(rng)
    y, cache = block.forward(params, x.copy())
    y_with, cache_with = block.forward_with(params, x.copy(), attn, mlp)
    np.testing.assert_array_equal(y_with, y)
    grads = [np.zeros(p.shape) for p in params]
    grads_with = [np.zeros(p.shape) for p in params]
    dx = block.backward(params, grads, cache, dy)
    dx_with = block.backward_with(params, grads_with, cache_with, dy, attn, mlp)
    np.testing.assert_array_equal(dx_with, dx)
    for g_with, g in zip(grads_with, grads):
        np.testing.assert_array_equal(g_with, g)


@pytest.mark.parametrize("name", ["LMHead", "ClassificationHead"])
def test_heads_pass_gradcheck_without_targets_too(rng, name):
    module, x, _ = SHIPPED[name](rng)
    assert max(gradcheck(module, x).values()) < 1e-6


class ScaledTanh(Module):
    """y = tanh(x * s) + c, per channel; a user's own module."""

    def __init__(self, n):
        self.n = n

    def param_specs(self):
        return [ParamDecl("s", (self.n,), decay=False, init="ones"),
                ParamDecl("c", (self.n,), decay=False)]

    def forward(self, params, x):
        s, c = params
        t = np.tanh(x * s)
        return t + c, (x, t)

    def backward(self, params, grads, cache, dy):
        s, _ = params
        x, t = cache
        du = dy * (1 - t * t)
        grads[0] += (du * x).reshape(-1, self.n).sum(axis=0)
        grads[1] += dy.reshape(-1, self.n).sum(axis=0)
        return du * s


def test_a_user_module_passes_gradcheck_alone_and_inside_a_sequential(rng):
    assert max(gradcheck(ScaledTanh(C), x_btc(rng)).values()) < 1e-6
    chain = Sequential(("act", ScaledTanh(C)), ("block", TransformerBlock(C, H)))
    errors = gradcheck(chain, x_btc(rng), samples=8)
    assert "act.s" in errors and "block.mlp.w_fc" in errors and max(errors.values()) < 1e-6


class WrongSign(ScaledTanh):
    def backward(self, params, grads, cache, dy):
        dx = super().backward(params, grads, cache, dy)
        grads[1] *= -1  # the bias gradient with the wrong sign
        return dx


class Overwrites(ScaledTanh):
    def backward(self, params, grads, cache, dy):
        x, t = cache
        du = dy * (1 - t * t)
        grads[0][...] = (du * x).reshape(-1, self.n).sum(axis=0)  # = instead of +=
        grads[1] += dy.reshape(-1, self.n).sum(axis=0)
        return du * params[0]


class CachesItsParameter(ScaledTanh):
    def forward(self, params, x):
        y, (x, t) = super().forward(params, x)
        return y, (x, t, params[0])

    def backward(self, params, grads, cache, dy):
        x, t, s = cache
        return super().backward([s, params[1]], grads, (x, t), dy)


class NoInputGradient(ScaledTanh):
    def backward(self, params, grads, cache, dy):
        super().backward(params, grads, cache, dy)


@pytest.mark.parametrize("module,culprit", [(WrongSign(C), "c"), (Overwrites(C), "s"),
                                            (CachesItsParameter(C), "x")])
def test_gradcheck_names_the_array_whose_gradient_is_wrong(rng, module, culprit):
    with pytest.raises(GradcheckError, match=f"gradient of {re.escape(culprit)} ") as info:
        gradcheck(module, x_btc(rng))
    assert info.value.errors[culprit] > 1e-6


def test_gradcheck_says_when_backward_sets_a_gradient_instead_of_adding(rng):
    with pytest.raises(GradcheckError, match=r"sets the gradient of s instead of adding into it"):
        gradcheck(Overwrites(C), x_btc(rng))
    with pytest.raises(GradcheckError) as info:  # a wrong gradient is not taken for an overwrite
        gradcheck(WrongSign(C), x_btc(rng))
    assert "instead of adding" not in str(info.value)


def test_gradcheck_wants_an_input_gradient_for_a_float_input(rng):
    with pytest.raises(GradcheckError, match="no gradient for the floating input x"):
        gradcheck(NoInputGradient(C), x_btc(rng))


def test_gradcheck_refuses_what_it_cannot_check(rng):
    with pytest.raises(ConfigError, match="Module"):
        gradcheck(lambda p, x: (x, None), x_btc(rng))
    with pytest.raises(ConfigError, match="loss_forward"):
        gradcheck(LayerNorm(C), x_btc(rng), targets=np.zeros((B, T), int))


def test_gradcheck_checks_each_input_of_a_tuple(rng):
    class Gate(Module):
        def forward(self, params, x):
            a, b = x
            return a * b, x

        def backward(self, params, grads, cache, dy):
            a, b = cache
            return dy * b, dy * a

    errors = gradcheck(Gate(), (x_btc(rng), x_btc(rng)))
    assert set(errors) == {"x[0]", "x[1]"} and max(errors.values()) < 1e-6


# ------------------------------------------------------------------------- declarations
@pytest.mark.parametrize("kwargs,match", [({"split": "diagonal"}, "split"),
                                          ({"init": "xavier"}, "init"),
                                          ({"init": -1.0}, "init"),
                                          ({"shape": (2, -1)}, "shape")])
def test_bad_declarations_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ParamDecl(**{"name": "w", "shape": (2, 3), "decay": True, **kwargs})


def test_shipped_modules_declare_the_megatron_splits():
    splits = {d.name: d.split for d in TransformerBlock(C, H).param_specs()}
    assert splits["attn.w_qkv"] == splits["attn.b_qkv"] == splits["mlp.w_fc"] == "column"
    assert splits["attn.w_proj"] == splits["mlp.w_proj"] == "row"
    assert splits["ln1.g"] == splits["attn.b_proj"] == splits["mlp.b_proj"] == "replicated"
    assert Embedding(V, C).param_specs()[0].split == LMHead(V, C).param_specs()[0].split == "vocab"
    assert [d.split for d in Linear(C, C, split="row").param_specs()] == ["row", "replicated"]


# ------------------------------------------------------------------------- Model
def vit(n_layer=2, patch=2, image=(4, 6, 3)):
    """A small vision transformer: patches, positions, bidirectional blocks, a classifier."""
    n_patches = (image[0] // patch) * (image[1] // patch)
    return [Sequential(("patch", PatchEmbedding(patch, image[2], C)),
                       PositionalEmbedding(n_patches, C, name="pos"))] + [
        (f"h{l}", TransformerBlock(C, H, causal=False)) for l in range(n_layer)] + [
        Sequential(("ln_f", LayerNorm(C)), ("head", ClassificationHead(C, K)))]


def test_model_lays_out_units_back_to_back_in_declaration_order():
    model = Model(vit(), seed=0, dtype=np.float64)
    names = [p.name for p in model.params]
    assert names[:3] == ["patch.w", "patch.b", "pos"] and names[-2:] == ["head.w", "head.b"]
    assert names[3:15] == [f"h0.{n}" for n in nn.layers.BLOCK_PARAM_NAMES]
    assert model.units == [(0, 3), (3, 15), (15, 27), (27, 31)]
    assert model.num_params == sum(p.size for p in model.params) == model.flat_data.size
    assert all(p.offset == q.offset + q.size for q, p in zip(model.params, model.params[1:]))


def test_model_init_follows_the_declarations():
    model = Model(vit(), seed=3, dtype=np.float64)
    assert (model.param("h1.ln2.g").data == 1).all() and not model.param("h1.attn.b_qkv").data.any()
    rng = np.random.default_rng(3)  # drawn in order, nothing drawn for zeros and ones
    np.testing.assert_array_equal(model.param("patch.w").data,
                                  rng.standard_normal((12, C)) * 0.02)
    np.testing.assert_array_equal(model.param("pos").data, rng.standard_normal((6, C)) * 0.02)
    f32 = Model(vit(), seed=3, dtype=np.float32)
    np.testing.assert_array_equal(f32.flat_data, model.flat_data.astype(np.float32))


def test_vision_model_gradients_match_finite_differences(rng):
    model = Model(vit(n_layer=1), seed=0, dtype=np.float64)
    model.load_flat(model.flat_data + rng.normal(0, 0.3, model.num_params))
    images, labels = rng.standard_normal((B, 4, 6, 3)), rng.integers(0, K, B)
    loss, cache = model.forward(images, labels)
    assert isinstance(loss, float) and loss > 0
    ready = []
    model.backward(cache, grad_ready=ready.append)
    assert ready == sorted(ready, reverse=True) == list(range(len(model.params)))[::-1]
    picks = rng.choice(model.num_params, 40, replace=False)
    numeric = []
    for j in picks:
        old = model.flat_data[j]
        model.flat_data[j] = old + 1e-6
        plus = model.forward(images, labels)[0]
        model.flat_data[j] = old - 1e-6
        minus = model.forward(images, labels)[0]
        model.flat_data[j] = old
        numeric.append((plus - minus) / 2e-6)
    err = np.linalg.norm(model.flat_grad[picks] - numeric) / np.linalg.norm(numeric)
    assert err < 1e-6
    assert model.predict(images).shape == (B, K)


def tied_lm(tied=True):
    head = LMHead(V, C, tied_to="emb.table" if tied else None)
    return [Sequential(("emb", Embedding(V, C, name="table")), PositionalEmbedding(T, C)),
            ("h0", TransformerBlock(C, H)), Sequential(("ln_f", LayerNorm(C)), head)]


def test_a_tied_parameter_is_the_owners_and_gets_both_gradients(rng):
    tied, untied = Model(tied_lm(), seed=0, dtype=np.float64), Model(tied_lm(False), seed=0,
                                                                      dtype=np.float64)
    assert [p.name for p in tied.params] == [p.name for p in untied.params][:-1]
    untied.param("lm_head").data[...] = untied.param("emb.table").data  # the same function
    idx, targets = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    for model in (tied, untied):
        _, cache = model.forward(idx, targets)
        model.backward(cache)
    np.testing.assert_allclose(tied.param("emb.table").grad,
                               untied.param("emb.table").grad + untied.param("lm_head").grad,
                               rtol=1e-12, atol=1e-15)


class Recorder:
    """The default provider's arrays, recording the calls."""

    def __init__(self, model):
        self.flat, self.calls, self.transient = nn.module.FlatParams(model), [], False

    def fetch(self, u, then=None):
        self.calls.append(("fetch", u, then))
        return self.flat.fetch(u)

    def release(self, u):
        self.calls.append(("release", u))

    def grads(self, u):
        return self.flat.grads(u)

    def grads_ready(self, u):
        self.calls.append(("grads_ready", u))


def test_units_fetch_tied_owners_and_skip_backwards_that_need_no_parameters(rng):
    model = Model(tied_lm(), seed=0, dtype=np.float64)
    model.use_provider(Recorder(model))
    _, cache = model.forward(rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T)))
    model.backward(cache)
    assert model.provider.calls == [
        ("fetch", 0, 1), ("release", 0), ("fetch", 1, 2), ("release", 1),
        ("fetch", 2, 0), ("fetch", 0, None), ("release", 0), ("release", 2),
        ("fetch", 2, 0), ("fetch", 0, 1), ("release", 0), ("release", 2), ("grads_ready", 2),
        ("fetch", 1, None), ("release", 1), ("grads_ready", 1), ("grads_ready", 0)]


@pytest.mark.parametrize("units,match", [
    (lambda: [Sequential(Embedding(V, C)), LMHead(V, C, tied_to="nowhere")], "not a parameter"),
    (lambda: [Sequential(Embedding(V, C)), LMHead(V, 2 * C, tied_to="wte")], "shapes must match"),
    (lambda: [LMHead(V, C, tied_to="wte"), Sequential(Embedding(V, C), LMHead(V, C))],
     "earlier unit"),
    (lambda: [Embedding(V, C), LayerNorm(C)], "head"),
    (lambda: [Sequential(LMHead(V, C), LayerNorm(C))], "last of a Sequential"),
    (lambda: [("a", LayerNorm(C)), ("a", LayerNorm(C)), LMHead(V, C)], "duplicate"),
    (lambda: [LayerNorm(C), "not a module"], "Module"),
])
def test_bad_models_are_refused(units, match):
    with pytest.raises(ConfigError, match=match):
        Model(units())


@pytest.mark.parametrize("make", [lambda: Linear(0, 3), lambda: MultiHeadAttention(10, 3),
                                  lambda: Linear(4, 4, split="vocab"), lambda: LayerNorm(2.5)])
def test_bad_module_sizes_are_refused(make):
    with pytest.raises(ConfigError):
        make()


@pytest.mark.parametrize("module,x", [
    (PatchEmbedding(2, 3, C), np.zeros((B, 5, 6, 3))), (PatchEmbedding(2, 3, C), np.zeros((B, 4, 6, 1))),
    (PatchEmbedding(2, 3, C), np.zeros((4, 6, 3))), (PositionalEmbedding(T, C), np.zeros((B, T + 1, C)))])
def test_inputs_a_module_cannot_take_are_refused(module, x):
    params = [np.zeros(d.shape) for d in module.param_specs()]
    with pytest.raises(ConfigError, match=type(module).__name__):
        module.forward(params, x)


# ------------------------------------------------------------------------- docs
def test_the_example_of_docs_model_md_runs():
    text = (ROOT / "docs" / "model.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert any("gradcheck(" in b for b in blocks)
    namespace = {}
    for block in blocks:
        exec(compile(block, "docs/model.md", "exec"), namespace)  # noqa: S102
    assert math.isfinite(namespace["loss"])


def test_deferred_weight_gradients_are_bitwise_those_computed_at_once(rng):
    """A Sequential of a TransformerBlock and a tied LMHead, backward with defer=list: dx now,
    the weight gradients once the deferred callables ran, bitwise the same as without."""
    C, V = 8, 11
    seq = nn.Sequential(("h", TransformerBlock(C, 2)), LMHead(V, C))
    assert seq.defers_weight_grads and not nn.Sequential(LayerNorm(C)).defers_weight_grads
    params = [rng.standard_normal(d.shape) * 0.3 for d in seq.param_specs()]
    x, dy = rng.standard_normal((2, 3, C)), rng.standard_normal((2, 3, V))
    results = []
    for defer in (None, []):
        grads = [np.zeros_like(p) for p in params]
        _, cache = seq.forward(params, x)
        dx = nn.module.run_backward(seq, params, grads, cache, dy, defer=defer)
        if defer is not None:
            assert len(defer) == 3 and not grads[-1].any()  # the head and the MLP's two linears
            for weight_grads in defer:
                weight_grads()
        results.append((dx, grads))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_array_equal(a, b)


def test_unit_params_name_the_owner_of_a_tied_declaration():
    model = nn.GPT(nn.GPTConfig(vocab_size=16, seq_len=4, n_layer=2, n_head=2, n_embd=8))
    assert model.unit_params(0) == [0, 1]
    assert model.unit_params(3) == [len(model.params) - 2, len(model.params) - 1, 0]  # ln_f, wte
    model.recompute = "blocks"
    assert model.recompute_units == [1, 2]
