"""Models with explicit forward/backward passes on flat parameter buffers.

`layers` holds the forward/backward pairs; `module` the protocol (Module, Sequential, Model) and
`modules` the shipped modules over those pairs; `GPT` and `ViT` are Models of them; `gradcheck`
checks a module against finite differences; `AdamW` and friends update flat buffers. Imports only
`rtxmpi.backend`, `rtxmpi.kernels`, `rtxmpi.errors` and `rtxmpi.observe.trace`; runs on numpy and
cupy alike.
"""
from rtxmpi.nn import layers
from rtxmpi.nn.gpt import GPT, MODEL_SIZES, GPTConfig, gpt_units, param_layout
from rtxmpi.nn.gradient_check import GradcheckError, gradcheck
from rtxmpi.nn.module import SPLITS, Model, Module, ParamDecl, Sequential
from rtxmpi.nn.modules import (MLP, ClassificationHead, ClassToken, ClassTokenHead, Embedding,
                               LayerNorm, Linear, LMHead, MultiHeadAttention, PatchEmbedding,
                               PositionalEmbedding, TransformerBlock)
from rtxmpi.nn.optim import AdamW, clip_grad_norm, cosine_lr, grad_norm_sq
from rtxmpi.nn.params import Param, ParamSpec, decay_mask
from rtxmpi.nn.vit import VIT_SIZES, ViT, ViTConfig, vit_units

__all__ = ["GPT", "GPTConfig", "MODEL_SIZES", "gpt_units", "param_layout", "AdamW",
           "clip_grad_norm", "grad_norm_sq", "cosine_lr", "decay_mask", "Param", "ParamSpec",
           "layers", "Module", "Sequential", "Model", "ParamDecl", "SPLITS", "gradcheck",
           "GradcheckError", "Embedding", "PositionalEmbedding", "PatchEmbedding", "LayerNorm",
           "Linear", "MultiHeadAttention", "MLP", "TransformerBlock", "LMHead",
           "ClassificationHead", "ClassToken", "ClassTokenHead", "ViT", "ViTConfig", "VIT_SIZES",
           "vit_units"]
