"""bench/_peer_torch.py: the PyTorch twin of the main job's GPT computes what rtxmpi's does.

At float64 from the same weights and tokens, one step's loss, every gradient and the parameters
after a clipped AdamW step agree with rtxmpi's to ~1e-10: what makes bench/peers.py's comparison
one of the same job. Skipped without torch (an optional extra).
"""
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'rtxmpi[peers]')")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import _peer_torch as twin  # noqa: E402

from rtxmpi.nn import GPT, AdamW, GPTConfig, clip_grad_norm, cosine_lr, decay_mask  # noqa: E402

CFG = GPTConfig(seq_len=16, n_layer=2, n_head=4, n_embd=32)


def _batch(B=3, T=12, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, CFG.vocab_size, (B, T))
    return x, rng.integers(0, CFG.vocab_size, (B, T))


def _pair(cfg=CFG):
    ours = GPT(cfg, seed=3, dtype=np.float64)
    peer = twin.TorchGPT(cfg).double()
    twin.load_flat(peer, ours.flat_data)
    return ours, peer


@pytest.mark.parametrize("tied", [True, False])
def test_loss_and_every_gradient_match_rtxmpi_at_float64(tied):
    cfg = GPTConfig(**{**CFG.__dict__, "tie_embeddings": tied})
    ours, peer = _pair(cfg)
    x, y = _batch()  # T = 12 < seq_len: the positions are sliced alike
    loss, cache = ours.forward(x, y)
    ours.backward(cache)
    peer_loss = peer(torch.from_numpy(x), torch.from_numpy(y))
    peer_loss.backward()
    assert abs(peer_loss.item() - float(loss)) < 1e-12
    grad = twin.flat_grad(peer)
    scale = np.abs(ours.flat_grad).max()
    assert np.abs(grad - ours.flat_grad).max() < 1e-10 * scale
    for spec in ours.params:  # every parameter has a gradient, none is all zeros
        assert np.abs(grad[spec.offset:spec.offset + spec.size]).max() > 0, spec.name


def test_a_clipped_adamw_step_matches_rtxmpi_at_float64():
    ours, peer = _pair()
    optimizer = AdamW(ours.flat_data, lr=3e-3, weight_decay=0.1, decay_mask=decay_mask(ours.params))
    peer_optimizer = twin.make_optimizer(peer, lr=3e-3, weight_decay=0.1)
    for step in (1, 2):  # the second step uses Adam's moments and bias corrections after one
        x, y = _batch(seed=step)
        ours.zero_grad()
        _, cache = ours.forward(x, y)
        ours.backward(cache)
        peer_optimizer.zero_grad()
        peer(torch.from_numpy(x), torch.from_numpy(y)).backward()
        lr = cosine_lr(step, 3e-3, 1, 10, 3e-4)
        norm = clip_grad_norm(ours.flat_grad, 0.05)
        assert norm > 0.05  # the clip acts
        optimizer.step(ours.flat_grad, lr=lr)
        peer_norm = twin.optimizer_step(peer, peer_optimizer, lr, grad_clip=0.05)
        assert abs(peer_norm - norm) < 1e-10 * norm
    params = torch.cat([p.detach().T.reshape(-1) if transposed else p.detach().reshape(-1)
                             for _, p, transposed in twin.matched_params(peer)]).numpy()
    assert np.abs(params - ours.flat_data).max() < 1e-10


def test_decay_groups_follow_rtxmpis_mask():
    _, peer = _pair()
    decayed, plain = twin.make_optimizer(peer, lr=1e-3, weight_decay=0.1).param_groups
    names = {id(p): spec.name for spec, p, _ in twin.matched_params(peer)}
    assert {names[id(p)] for p in decayed["params"]} == {
        "wte", "wpe", *(f"h{l}.{w}" for l in range(2) for w in
                        ("attn.w_qkv", "attn.w_proj", "mlp.w_fc", "mlp.w_proj"))}
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert decayed["betas"] == (0.9, 0.95) and decayed["eps"] == 1e-8
