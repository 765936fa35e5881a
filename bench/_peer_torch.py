"""The main job's GPT (rtxmpi.nn.GPT as examples/train.py trains it) written in PyTorch, for
bench/peers.py; needs torch (`pip install 'rtxmpi[peers]'`).

The same model and arithmetic: byte vocabulary, learned positions, pre-LN blocks (LayerNorm eps
rtxmpi.kernels.LN_EPS), a fused qkv projection ([q | k | v], heads contiguous in each), causal
softmax attention scaled by 1/sqrt(hs) (F.scaled_dot_product_attention), GELU with the tanh
approximation, an MLP of 4C, a final LayerNorm, the head tied to the token embedding, the mean
cross-entropy over every position. Weights are nn.Linear's (out, in); rtxmpi stores (in, out).
`load_flat` copies rtxmpi's flat parameter vector in and `flat_grad` returns the gradients in
rtxmpi's flat layout, so one step of both can be compared (tests/unit/test_peers_twin.py).
`make_optimizer` and `optimizer_step` are train.py's AdamW (betas 0.9, 0.95, eps 1e-8, decay on
the parameters rtxmpi decays: matrices and embeddings), global-norm clip and lr.

Shape legend: B batch, T sequence length (T <= seq_len), C = n_embd, H = n_head, hs = C // H,
V = vocab_size.
"""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rtxmpi.errors import ConfigError
from rtxmpi.kernels import LN_EPS
from rtxmpi.nn.gpt import param_layout


class Attention(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.n_head = H
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)

    def forward(self, x):  # x: (B, T, C) -> (B, T, C)
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, hs)
                   for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.fc = nn.Linear(C, 4 * C)
        self.proj = nn.Linear(4 * C, C)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LN: x = x + attn(ln1(x)); y = x + mlp(ln2(x))."""

    def __init__(self, C, H):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(C, eps=LN_EPS), Attention(C, H)
        self.ln2, self.mlp = nn.LayerNorm(C, eps=LN_EPS), MLP(C)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TorchGPT(nn.Module):
    """The GPT of `cfg` (rtxmpi.nn.GPTConfig). forward(idx, targets): (B, T) int64 ids -> the
    mean cross-entropy in nats, a 0-d tensor. Parameters as torch initializes them: call
    `load_flat` for rtxmpi's."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        C, V = cfg.n_embd, cfg.vocab_size
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(cfg.seq_len, C)
        self.h = nn.ModuleList(Block(C, cfg.n_head) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(C, eps=LN_EPS)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(C, V, bias=False)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe.weight[:T]
        for block in self.h:
            x = block(x)
        head = self.wte.weight if self.lm_head is None else self.lm_head.weight  # (V, C)
        logits = F.linear(self.ln_f(x), head)  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _torch_name(name):
    """rtxmpi's parameter name -> (torch parameter name, stored transposed): 'h0.attn.w_qkv' ->
    ('h.0.attn.qkv.weight', True), 'h0.ln1.g' -> ('h.0.ln1.weight', False), 'wte' -> ('wte.weight',
    False)."""
    parts = name.split(".")
    if parts[0].startswith("h") and parts[0][1:].isdigit():
        parts[0:1] = ["h", parts[0][1:]]
    last = parts[-1]
    if len(parts) == 1:  # wte, wpe, lm_head: (V or seq_len, C) in both
        return f"{last}.weight", False
    if last in ("g", "b"):  # LayerNorm gain and bias
        return ".".join(parts[:-1] + ["weight" if last == "g" else "bias"]), False
    kind, layer = last.split("_", 1)  # w_qkv, b_qkv, w_proj, ...
    return ".".join(parts[:-1] + [layer, "weight" if kind == "w" else "bias"]), kind == "w"


def matched_params(model):
    """[(rtxmpi ParamSpec, torch Parameter, transposed)] in rtxmpi's parameter order. Raises
    ConfigError when the two models do not have the same parameters."""
    named = dict(model.named_parameters())
    pairs = []
    for spec in param_layout(model.cfg):
        torch_name, transposed = _torch_name(spec.name)
        p = named.pop(torch_name, None)
        shape = tuple(p.shape[::-1] if transposed else p.shape) if p is not None else None
        if shape != tuple(spec.shape):
            raise ConfigError(f"{spec.name} {spec.shape}: the torch model's {torch_name} is {shape}")
        pairs.append((spec, p, transposed))
    if named:
        raise ConfigError(f"torch parameters without an rtxmpi counterpart: {sorted(named)}")
    return pairs


def load_flat(model, flat):
    """Copy rtxmpi's flat parameter vector (1-D array, any float dtype) into `model`."""
    flat = np.asarray(flat)
    with torch.no_grad():
        for spec, p, transposed in matched_params(model):
            value = torch.from_numpy(np.ascontiguousarray(flat[spec.offset:spec.offset + spec.size]))
            value = value.reshape(spec.shape)
            p.copy_(value.T if transposed else value)


def flat_grad(model):
    """The gradients of `model` in rtxmpi's flat layout: a 1-D float64 numpy array (zeros where
    a parameter has no gradient)."""
    pairs = matched_params(model)
    out = np.zeros(pairs[-1][0].offset + pairs[-1][0].size, np.float64)
    for spec, p, transposed in pairs:
        if p.grad is not None:
            g = p.grad.T if transposed else p.grad
            out[spec.offset:spec.offset + spec.size] = g.detach().double().reshape(-1).numpy()
    return out


def make_optimizer(model, lr, weight_decay, betas=(0.9, 0.95), eps=1e-8, fused=False):
    """torch.optim.AdamW with rtxmpi's decay split: group 0 decays (the parameters whose ParamSpec
    says decay), group 1 does not. fused: torch's fused CPU kernel (else its default)."""
    decay, no_decay = [], []
    for spec, p, _ in matched_params(model):
        (decay if spec.decay else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **({"fused": True} if fused else {}))


def optimizer_step(model, optimizer, lr, grad_clip):
    """Clip the global gradient norm to `grad_clip` (0: off) as torch.nn.utils.clip_grad_norm_
    does, set every group's lr, step. Returns the norm before clipping (None when off)."""
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)) if grad_clip else None
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return norm
