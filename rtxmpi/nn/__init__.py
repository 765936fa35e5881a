"""Reference models with explicit forward/backward passes on flat parameter buffers.

`layers` holds the forward/backward pairs; `GPT` composes them; `AdamW` and friends update flat
buffers. Imports only `rtxmpi.backend` and `rtxmpi.errors`; runs on numpy and cupy alike.
"""
from rtxmpi.nn import layers
from rtxmpi.nn.gpt import GPT, MODEL_SIZES, GPTConfig, param_layout
from rtxmpi.nn.optim import AdamW, clip_grad_norm, cosine_lr, grad_norm_sq
from rtxmpi.nn.params import Param, ParamSpec, decay_mask

__all__ = ["GPT", "GPTConfig", "MODEL_SIZES", "param_layout", "AdamW", "clip_grad_norm",
           "grad_norm_sq", "cosine_lr", "decay_mask", "Param", "ParamSpec", "layers"]
