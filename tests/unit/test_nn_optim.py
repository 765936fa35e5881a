"""AdamW against a per-element reference, decay mask, clipping, norms, state round trip, and the
learning-rate schedule."""
import math

import numpy as np
import pytest

from rtxmpi.errors import ConfigError
from rtxmpi.nn import AdamW, clip_grad_norm, cosine_lr, grad_norm_sq


class ReferenceAdamW:
    """Straight from the papers, one element at a time (Kingma & Ba 2015, Algorithm 1, with the
    decoupled weight decay of Loshchilov & Hutter 2019, Algorithm 2, as in torch.optim.AdamW)."""

    def __init__(self, p, lr, betas, eps, wd, mask):
        self.p, self.lr, self.b1, self.b2, self.eps, self.wd = list(p), lr, *betas, eps, wd
        self.mask = list(mask) if mask is not None else [1.0] * len(self.p)
        self.m, self.v, self.t = [0.0] * len(self.p), [0.0] * len(self.p), 0

    def step(self, grad, lr=None):
        lr = self.lr if lr is None else lr
        self.t += 1
        for i, g in enumerate(grad):
            self.m[i] = self.b1 * self.m[i] + (1 - self.b1) * g
            self.v[i] = self.b2 * self.v[i] + (1 - self.b2) * g * g
            m_hat = self.m[i] / (1 - self.b1 ** self.t)
            v_hat = self.v[i] / (1 - self.b2 ** self.t)
            self.p[i] -= lr * self.wd * self.mask[i] * self.p[i]
            self.p[i] -= lr * m_hat / (math.sqrt(v_hat) + self.eps)


@pytest.fixture
def rng():
    return np.random.default_rng(11)


@pytest.mark.parametrize("with_mask", [False, True])
def test_adamw_matches_per_element_reference(rng, with_mask):
    n = 37
    p = rng.standard_normal(n)
    mask = (rng.random(n) < 0.5).astype(np.float64) if with_mask else None
    ref = ReferenceAdamW(p, 1e-2, (0.9, 0.95), 1e-8, 0.1, mask)
    opt = AdamW(p, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, decay_mask=mask)
    for step in range(6):
        grad = rng.standard_normal(n) * (step + 1)
        lr = None if step < 3 else 3e-3  # schedule override
        ref.step(grad, lr)
        opt.step(grad, lr)
    np.testing.assert_allclose(p, ref.p, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(opt.m, ref.m, rtol=1e-12)
    np.testing.assert_allclose(opt.v, ref.v, rtol=1e-12)
    assert opt.step_count == 6


def test_adamw_updates_in_place_in_the_params_dtype(rng):
    p = rng.standard_normal(100).astype(np.float32)
    view = p
    opt = AdamW(p)
    opt.step(rng.standard_normal(100).astype(np.float32))
    assert view is p and p.dtype == np.float32
    assert opt.m.dtype == np.float32 and opt.v.dtype == np.float32


def test_decay_mask_zero_means_no_decay():
    p = np.ones(4)
    opt = AdamW(p, lr=0.1, weight_decay=0.5, decay_mask=np.array([1, 0, 1, 0], dtype=bool))
    opt.step(np.zeros(4))  # zero gradient: only weight decay moves the parameters
    np.testing.assert_allclose(p, [1 - 0.1 * 0.5, 1, 1 - 0.1 * 0.5, 1])


def test_adamw_works_on_a_shard_of_a_flat_buffer(rng):
    flat = rng.standard_normal(20)
    expected = flat.copy()
    grad = rng.standard_normal(20)
    AdamW(expected[5:15], lr=0.1).step(grad[5:15])
    AdamW(flat[5:15], lr=0.1).step(grad[5:15])
    np.testing.assert_array_equal(flat, expected)
    assert not np.array_equal(flat[5:15], grad[5:15])


def test_state_dict_round_trip_continues_identically(rng):
    p1 = rng.standard_normal(50)
    opt1 = AdamW(p1, lr=1e-2)
    grads = [rng.standard_normal(50) for _ in range(6)]
    for g in grads[:3]:
        opt1.step(g)
    state = {k: (v.copy() if hasattr(v, "copy") else v) for k, v in opt1.state_dict().items()}
    assert state["step"] == 3
    p2 = p1.copy()
    opt2 = AdamW(p2, lr=1e-2)
    opt2.load_state_dict(state)
    for g in grads[3:]:
        opt1.step(g)
        opt2.step(g)
    np.testing.assert_array_equal(p1, p2)


def test_load_state_dict_checks_keys_and_lengths():
    opt = AdamW(np.zeros(5))
    with pytest.raises(ConfigError, match="missing 'v'"):
        opt.load_state_dict({"step": 1, "m": np.zeros(5)})
    with pytest.raises(ConfigError, match="shape"):
        opt.load_state_dict({"step": 1, "m": np.zeros(4), "v": np.zeros(4)})


def test_adamw_rejects_bad_arguments():
    with pytest.raises(ConfigError, match="1-D"):
        AdamW(np.zeros((2, 3)))
    with pytest.raises(ConfigError, match="betas"):
        AdamW(np.zeros(3), betas=(0.9, 1.0))
    with pytest.raises(ConfigError, match="decay_mask has shape"):
        AdamW(np.zeros(3), decay_mask=np.ones(4))
    with pytest.raises(ConfigError, match="grad has shape"):
        AdamW(np.zeros(3)).step(np.zeros(4))


# ------------------------------------------------------------------------- norms, clipping
def test_grad_norm_sq_is_the_sum_of_squares(rng):
    g = rng.standard_normal(1000).astype(np.float32)
    assert grad_norm_sq(g) == pytest.approx(float(np.sum(g.astype(np.float64) ** 2)), rel=1e-12)


def test_clip_grad_norm_scales_down_to_max_norm(rng):
    g = rng.standard_normal(100) * 10
    before = np.linalg.norm(g)
    returned = clip_grad_norm(g, 1.0)
    assert returned == pytest.approx(before, rel=1e-12)
    assert np.linalg.norm(g) == pytest.approx(1.0, rel=1e-5)


def test_clip_grad_norm_leaves_small_gradients_alone(rng):
    g = rng.standard_normal(100) * 1e-3
    before = g.copy()
    clip_grad_norm(g, 1.0)
    np.testing.assert_array_equal(g, before)


def test_clip_grad_norm_uses_a_given_global_norm(rng):
    shard = np.ones(4)
    norm = clip_grad_norm(shard, 1.0, total_norm=8.0)  # e.g. all-reduced over ranks
    assert norm == 8.0
    np.testing.assert_allclose(shard, 1 / 8.0, rtol=1e-6)
    with pytest.raises(ConfigError, match="max_norm"):
        clip_grad_norm(shard, 0.0)


# ------------------------------------------------------------------------- schedule
def test_cosine_lr_warms_up_then_decays_to_min():
    lrs = [cosine_lr(s, 1.0, 10, 110, 0.1) for s in range(1, 121)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[59] == pytest.approx(0.55)  # step 60: half way through the decay
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[109] == pytest.approx(0.1) and lrs[119] == 0.1


def test_cosine_lr_without_warmup_starts_at_base():
    assert cosine_lr(0, 3e-4, 0, 100) == pytest.approx(3e-4)
    assert cosine_lr(100, 3e-4, 0, 100) == 0.0


def test_cosine_lr_rejects_warmup_longer_than_training():
    with pytest.raises(ConfigError, match="warmup_steps"):
        cosine_lr(1, 1e-3, 200, 100)
