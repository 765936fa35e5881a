"""The GPT's and the ViT's loss and every parameter gradient against PyTorch autograd, float64.

The same model written with torch.nn.functional from the same parameters; rtxmpi runs its default
CPU path (rtxmpi.fused when built) and its numpy reference (RTXMPI_FUSED=0). Skips without torch.
"""
import numpy as np
import pytest

from rtxmpi import fused
from rtxmpi.nn import GPT, GPTConfig, ViT, ViTConfig

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _block(x, p, prefix, n_head, causal):
    B, T, C = x.shape
    P = {k: p[f"{prefix}.{k}"] for k in ("ln1.g", "ln1.b", "attn.w_qkv", "attn.b_qkv",
                                         "attn.w_proj", "attn.b_proj", "ln2.g", "ln2.b",
                                         "mlp.w_fc", "mlp.b_fc", "mlp.w_proj", "mlp.b_proj")}
    h = F.layer_norm(x, (C,), P["ln1.g"], P["ln1.b"], eps=1e-5)
    q, k, v = (h @ P["attn.w_qkv"] + P["attn.b_qkv"]).split(C, dim=-1)
    q, k, v = (t.reshape(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    x = x + y.transpose(1, 2).reshape(B, T, C) @ P["attn.w_proj"] + P["attn.b_proj"]
    h = F.layer_norm(x, (C,), P["ln2.g"], P["ln2.b"], eps=1e-5)
    h = F.gelu(h @ P["mlp.w_fc"] + P["mlp.b_fc"], approximate="tanh")
    return x + h @ P["mlp.w_proj"] + P["mlp.b_proj"]


def _torch_params(model):
    return {p.name: torch.tensor(p.data, requires_grad=True) for p in model.params}


def _check(model, p, loss_torch, loss):
    loss_torch.backward()
    assert loss == pytest.approx(loss_torch.item(), rel=1e-12)
    for param in model.params:
        np.testing.assert_allclose(param.grad, p[param.name].grad.numpy(), rtol=1e-9, atol=1e-12,
                                   err_msg=param.name)


@pytest.fixture(params=["fused", "reference"])
def path(request):
    if request.param == "fused" and not fused.available():
        pytest.skip("rtxmpi._fused was not built")
    previous = fused.set_enabled(request.param == "fused")
    yield request.param
    fused.set_enabled(previous)


def _perturbed(model, rng):
    model.load_flat(model.flat_data + rng.normal(0, 0.2, model.num_params))  # off the near-linear init


@pytest.mark.parametrize("tie", (True, False))
def test_gpt_gradients_match_torch_autograd(path, tie):
    rng = np.random.default_rng(0)
    cfg = GPTConfig(vocab_size=37, seq_len=9, n_layer=2, n_head=3, n_embd=12, tie_embeddings=tie)
    model = GPT(cfg, seed=0, dtype=np.float64)
    _perturbed(model, rng)
    idx = rng.integers(0, cfg.vocab_size, (3, 9))
    targets = rng.integers(0, cfg.vocab_size, (3, 9))
    loss, cache = model.forward(idx, targets)
    model.backward(cache)

    p = _torch_params(model)
    x = p["wte"][torch.tensor(idx)] + p["wpe"][:9]
    for l in range(cfg.n_layer):
        x = _block(x, p, f"h{l}", cfg.n_head, causal=True)
    x = F.layer_norm(x, (cfg.n_embd,), p["ln_f.g"], p["ln_f.b"], eps=1e-5)
    logits = x @ p["wte" if tie else "lm_head"].T
    _check(model, p, F.cross_entropy(logits.reshape(-1, cfg.vocab_size),
                                     torch.tensor(targets.reshape(-1))), loss)


def test_vit_gradients_match_torch_autograd(path):
    rng = np.random.default_rng(1)
    cfg = ViTConfig(image_size=4, patch_size=2, channels=2, n_layer=2, n_head=2, n_embd=8,
                    n_classes=5)
    model = ViT(cfg, seed=0, dtype=np.float64)
    _perturbed(model, rng)
    images = rng.normal(size=(3, 4, 4, 2))
    labels = rng.integers(0, 5, 3)
    loss, cache = model.forward(images, labels)
    model.backward(cache)

    p = _torch_params(model)
    B, S, P = 3, cfg.image_size, cfg.patch_size
    patches = torch.tensor(images).reshape(B, S // P, P, S // P, P, cfg.channels)
    patches = patches.permute(0, 1, 3, 2, 4, 5).reshape(B, (S // P) ** 2, P * P * cfg.channels)
    x = patches @ p["patch.w"] + p["patch.b"]
    x = torch.cat([p["cls"].expand(B, 1, cfg.n_embd), x], dim=1) + p["pos"]
    for l in range(cfg.n_layer):
        x = _block(x, p, f"h{l}", cfg.n_head, causal=False)
    x = F.layer_norm(x, (cfg.n_embd,), p["ln_f.g"], p["ln_f.b"], eps=1e-5)
    logits = x[:, 0] @ p["head.w"] + p["head.b"]
    _check(model, p, F.cross_entropy(logits, torch.tensor(labels)), loss)
