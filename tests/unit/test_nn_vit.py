"""The ViT (rtxmpi.nn.vit): its new modules and the whole model against finite differences in
float64, the paper's structure (class token, learned positions, bidirectional blocks, head on the
class token), its config and its input checks."""
import numpy as np
import pytest

from rtxmpi.errors import ConfigError
from rtxmpi.nn import (ClassificationHead, ClassToken, ClassTokenHead, Sequential, ViT, ViTConfig,
                       gradcheck, vit_units)

B, T, C, K = 3, 5, 8, 4


@pytest.fixture
def rng():
    return np.random.default_rng(5)


def tiny(**overrides):
    return ViTConfig.named("tiny", **{"n_embd": 8, "n_head": 2, "n_layer": 2, "n_classes": K,
                                      **overrides})


def images_labels(rng, cfg, batch=B):
    images = rng.standard_normal((batch, cfg.image_size, cfg.image_size, cfg.channels))
    return images, rng.integers(0, cfg.n_classes, batch)


# ------------------------------------------------------------------------- gradients
def test_class_token_passes_gradcheck(rng):
    errors = gradcheck(ClassToken(C), rng.standard_normal((B, T, C)))
    assert set(errors) == {"cls", "x"} and max(errors.values()) < 1e-6


@pytest.mark.parametrize("with_targets", [True, False], ids=["loss", "logits"])
def test_class_token_head_passes_gradcheck(rng, with_targets):
    targets = rng.integers(0, K, B) if with_targets else None
    errors = gradcheck(ClassTokenHead(C, K), rng.standard_normal((B, T, C)), targets)
    assert set(errors) == {"w", "b", "x"} and max(errors.values()) < 1e-6


@pytest.mark.parametrize("channels", [1, 3])
def test_the_whole_vit_passes_gradcheck(rng, channels):
    cfg = tiny(image_size=4, channels=channels)
    images, labels = images_labels(rng, cfg)
    errors = gradcheck(Sequential(*vit_units(cfg)), images, labels)
    assert len(errors) == len(ViT(cfg).params) + 1  # every parameter and the images
    assert max(errors.values()) < 1e-6


def test_model_gradient_is_the_sum_of_its_units_gradchecked_gradient(rng):
    """ViT.forward/backward on the flat buffers give the loss and gradients of the modules run
    one after another (what gradcheck checked), in float64."""
    cfg = tiny()
    model = ViT(cfg, seed=3, dtype=np.float64)
    images, labels = images_labels(rng, cfg)
    loss, cache = model.forward(images, labels)
    model.backward(cache)
    net = Sequential(*vit_units(cfg))
    params = [p.data for p in model.params]
    y, net_cache = net.forward(params, images)
    ref_loss, loss_cache = net.loss_forward(y, labels)
    grads = [np.zeros_like(p) for p in params]
    net.backward(params, grads, net_cache, net.loss_backward(1.0, loss_cache))
    assert loss == pytest.approx(float(ref_loss), rel=1e-14)
    np.testing.assert_allclose(model.flat_grad, np.concatenate([g.ravel() for g in grads]),
                               rtol=1e-13, atol=1e-16)


# ------------------------------------------------------------------------- structure
def test_head_reads_only_the_class_token_unlike_the_mean_pooling_head(rng):
    x = rng.standard_normal((B, T, C))
    head = ClassTokenHead(C, K)
    params = [rng.standard_normal(d.shape) for d in head.param_specs()]
    y, _ = head.forward(params, x)
    np.testing.assert_allclose(y, x[:, 0] @ params[0] + params[1])
    x2 = x.copy()
    x2[:, 1:] += 1.0
    np.testing.assert_array_equal(head.forward(params, x2)[0], y)
    assert not np.allclose(ClassificationHead(C, K).forward(params, x2)[0],
                           ClassificationHead(C, K).forward(params, x)[0])


def test_class_token_comes_first_and_the_input_follows(rng):
    x = rng.standard_normal((B, T, C))
    token = rng.standard_normal(C)
    y, _ = ClassToken(C).forward([token], x)
    assert y.shape == (B, T + 1, C)
    np.testing.assert_array_equal(y[:, 0], np.broadcast_to(token, (B, C)))
    np.testing.assert_array_equal(y[:, 1:], x)


def test_parameter_order_names_and_units():
    cfg = tiny(n_layer=2)
    model = ViT(cfg)
    names = [p.name for p in model.params]
    assert names[:4] == ["patch.w", "patch.b", "cls", "pos"]
    assert names[-4:] == ["ln_f.g", "ln_f.b", "head.w", "head.b"]
    assert model.param("patch.w").shape == (cfg.patch_size ** 2 * cfg.channels, cfg.n_embd)
    assert model.param("pos").shape == (cfg.n_patches + 1, cfg.n_embd)
    assert model.param("head.w").shape == (cfg.n_embd, cfg.n_classes)
    assert model.units == [(0, 4), (4, 16), (16, 28), (28, 32)]
    assert all(not m.causal for _, m in vit_units(cfg)[1:-1])  # encoder blocks


def test_attention_is_bidirectional_the_class_token_sees_later_patches(rng):
    """Changing only the last patch changes the logits (read from position 0): no causal mask."""
    cfg = tiny()
    model = ViT(cfg, dtype=np.float64)
    images, _ = images_labels(rng, cfg)
    changed = images.copy()
    changed[:, -cfg.patch_size:, -cfg.patch_size:] += 1.0
    assert not np.allclose(model.logits(images), model.logits(changed))


def test_initialization_depends_only_on_config_and_seed():
    cfg = tiny()
    a, b, c = ViT(cfg, seed=1), ViT(cfg, seed=1), ViT(cfg, seed=2)
    np.testing.assert_array_equal(a.flat_data, b.flat_data)
    assert not np.array_equal(a.flat_data, c.flat_data)
    np.testing.assert_array_equal(a.param("ln_f.g").data, 1.0)


# ------------------------------------------------------------------------- config and inputs
def test_named_sizes_and_defaults_fit_the_digits():
    cfg = ViTConfig.named("small")
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd) == (4, 4, 64)
    assert (cfg.image_size, cfg.channels, cfg.n_classes, cfg.n_patches, cfg.seq_len) == \
        (8, 1, 10, 16, 17)


@pytest.mark.parametrize("kwargs, match", [
    ({"image_size": 0}, "image_size must be a positive integer"),
    ({"n_classes": True}, "n_classes must be a positive integer"),
    ({"n_layer": 1.5}, "n_layer must be a positive integer"),
    ({"image_size": 8, "patch_size": 3}, "divisible by patch_size"),
    ({"n_embd": 10, "n_head": 4}, "divisible by n_head"),
])
def test_bad_config_raises_config_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ViTConfig(**kwargs)


def test_unknown_named_size_or_field_raises_config_error():
    with pytest.raises(ConfigError, match="unknown ViT size 'huge'"):
        ViTConfig.named("huge")
    with pytest.raises(ConfigError, match="unknown ViTConfig field"):
        ViTConfig.named("tiny", seq_len=4)
    with pytest.raises(ConfigError, match="cfg must be a ViTConfig"):
        ViT({"n_layer": 2})


BAD_BATCHES = [
    ("wrong size", np.zeros((2, 4, 4, 1)), np.zeros(2, np.int64), r"\(B, 8, 8, 1\)"),
    ("no channel dim", np.zeros((2, 8, 8)), np.zeros(2, np.int64), r"\(B, 8, 8, 1\)"),
    ("empty batch", np.zeros((0, 8, 8, 1)), np.zeros(0, np.int64), "B >= 1"),
    ("strings", np.full((2, 8, 8, 1), "a"), np.zeros(2, np.int64), "real numbers"),
    ("NaN pixel", np.full((2, 8, 8, 1), np.nan), np.zeros(2, np.int64), "NaN"),
    ("label count", np.zeros((2, 8, 8, 1)), np.zeros(3, np.int64), r"\(2,\) integer array"),
    ("float labels", np.zeros((2, 8, 8, 1)), np.zeros(2), r"\(2,\) integer array"),
    ("label range", np.zeros((2, 8, 8, 1)), np.array([0, 10]), r"in \[0, 10\].*n_classes is 10"),
    ("negative label", np.zeros((2, 8, 8, 1)), np.array([-1, 0]), "must be in"),
]


@pytest.mark.parametrize("what, images, labels, match", BAD_BATCHES, ids=[c[0] for c in BAD_BATCHES])
def test_bad_batch_raises_config_error_before_computing(what, images, labels, match):
    model = ViT(ViTConfig.named("tiny"))
    with pytest.raises(ConfigError, match=match):
        model.forward(images, labels)
    with pytest.raises(ConfigError, match=match):
        model.check_tokens(images, labels)  # the engines' check agrees with forward's


def test_integer_images_are_cast_to_the_model_dtype(rng):
    model = ViT(ViTConfig.named("tiny"), dtype=np.float64)
    pixels = rng.integers(0, 17, (2, 8, 8, 1))
    np.testing.assert_array_equal(model.logits(pixels), model.logits(pixels.astype(np.float64)))
