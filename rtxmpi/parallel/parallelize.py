"""Tensor and sequence parallelism as a transformation of a Model's units.

`parallelize(units, axes)` turns the units of an rtxmpi.nn Model (Modules or (name, Module) pairs)
into their parallel versions, driven by the splits the modules declare (rtxmpi.nn.module.ParamDecl):

    Embedding ("vocab")           -> VocabParallelEmbedding: rows split, lookups summed over tp
    PositionalEmbedding           -> PositionSlice: this rank's rows of the position table
    Linear ("column" / "row")     -> ColumnParallelLinear / RowParallelLinear (Megatron-LM)
    MultiHeadAttention            -> ParallelAttention: column qkv (whole heads per tp rank),
                                     Ulysses all-to-all over sp, row projection
    MLP                           -> ParallelMLP: column fc, row projection
    TransformerBlock              -> ParallelTransformerBlock: the two above between its LayerNorms
    LMHead ("vocab")              -> VocabParallelLMHead: logits split by vocabulary, and the
                                     vocabulary-parallel cross-entropy
    Sequential                    -> a Sequential of the parallel children, same names
    anything else                 -> itself, replicated: every tp rank computes it whole (or a
                                     ConfigError where it cannot run: `parallel_module`)

and, under sp (Ulysses), the units up to the last holding PatchEmbedding / ClassToken run whole on
every sp rank, then SplitSequenceAfter cuts their output to the rank's positions; the units from
the first holding ClassificationHead / ClassTokenHead on run whole after GatherSequenceBefore
(`whole_sequence_ends`).

Each parallel module holds only its shard of each parameter (local shapes in param_specs, same
names) and runs the shipped modules of rtxmpi.nn on those shards (a Linear of the shard's shape,
the MLP's BiasGELU, the attention's core, the block's LayerNorms through
TransformerBlock.forward_with) between the collectives of rtxmpi.parallel.tensor and
rtxmpi.parallel.sequence: no layer math of its own. `kinds` says how each of its parameters is
cut (tensor.shard). With
Megatron sequence parallelism the activations between units are split along the sequence over
tp, and every replicated parameter of a unit gets a partial gradient: `_SequenceSplitUnit` sums
those over tp after the unit's backward (one all-reduce per unit).

`TensorParallelModel` is a Model over the parallel units: one flat buffer of this rank's shards,
initialized from the full model's draw (the one-process Model's values, sharded), with
gather_full / local_from_full for checkpoints. `ParallelGPT` is it for the GPT's units, with the
GPT's token checks.

Shape legend: B this rank's samples, T positions per sample, Ts = T/sp this rank's positions,
Tl = Ts/tp with sequence_parallel (else Ts); C channels; Hl = H/tp heads; V vocabulary.
"""
import copy
import zlib

import numpy as np

from ..backend import to_host, xp_of
from ..control import raise_if_any_failed
from ..errors import ConfigError
from ..nn.gpt import GPTConfig, gpt_units
from ..nn.module import (FlatParams, Model, Module, ParamDecl, Sequential, declarations,
                         init_flat, own_layout, run_backward)
from ..nn.modules import (MLP, WHOLE_HEAD, WHOLE_INPUT, BiasGELU, Embedding, LayerNorm, Linear,
                          LMHead, MultiHeadAttention, PositionalEmbedding, TransformerBlock)
from ..nn.optim import grad_norm_sq
from . import tensor as tpl
from .sequence import check_heads, ulysses_attention_backward, ulysses_attention_forward

class Axes:
    """The parallel axes a parallel module computes over: tp_group, sp_group (ProcessGroups),
    tp, sp, tp_rank, sp_rank, sequence_parallel (Megatron sequence parallelism inside tp)."""

    def __init__(self, mesh, sequence_parallel=False):
        self.tp_group, self.sp_group = mesh.group("tp"), mesh.group("sp")
        self.tp, self.sp, self.tp_rank, self.sp_rank = mesh.tp, mesh.sp, mesh.tp_rank, mesh.sp_rank
        self.sequence_parallel = bool(sequence_parallel) and mesh.tp > 1

    @property
    def splits_sequence(self):
        """True when a unit sees only some positions of each sample (sp > 1 or Megatron sp)."""
        return self.sp > 1 or self.sequence_parallel

    def whole(self):
        """These axes for a unit that runs every position on every sp rank: sp = 1 (sp_group
        None), tp as it is."""
        axes = copy.copy(self)
        axes.sp, axes.sp_rank, axes.sp_group = 1, 0, None
        return axes


def _local_decls(decls, kinds, tp):
    return [ParamDecl(d.name, tpl.local_shape(k, d.shape, tp), d.decay, d.split, d.init, d.tied_to)
            for d, k in zip(decls, kinds)]


def _split_of(what, n, tp, hint=""):
    return tpl.split_size(n, tp, what, f" (tp={tp}){hint}")


class _Parallel(Module):
    """A parallel module: local declarations `decls` and their `kinds` (tensor.shard)."""

    def param_specs(self):
        return list(self.decls)


# ------------------------------------------------------------------------------- embeddings
class VocabParallelEmbedding(_Parallel):
    """Embedding with its (V, C) table's rows split over tp (tensor.vocab_embedding_forward).
    x: (B, Ts) ids, the same on every tp rank; y: (B, Tl, C). Collective on tp."""

    backward_needs_params = False

    def __init__(self, module, ax):
        V = module.decl.shape[0]
        self.ax, self.kinds = ax, ["vocab"]
        self.vocab_start = tpl.vocab_range(V, ax.tp_rank, ax.tp)[0]
        self.decls = _local_decls([module.decl], self.kinds, ax.tp)

    def forward(self, params, x):
        ax = self.ax
        return tpl.vocab_embedding_forward(x, params[0], self.vocab_start, ax.tp_group,
                                           ax.sequence_parallel)

    def backward(self, params, grads, cache, dy):
        if self.ax.sequence_parallel:  # every rank's rows need the whole sequence's gradient
            dy = tpl.gather_sequence(dy, self.ax.tp_group)
        tpl.vocab_embedding_backward(dy, cache, grads[0])
        return None


class PositionSlice(_Parallel):
    """PositionalEmbedding on this rank's positions: rows [p0, p0 + Tl) of the (replicated)
    table, p0 = sp_rank * Ts (+ tp_rank * Tl with sequence_parallel). x, y: (B, Tl, C). Local;
    under sequence_parallel its gradient is partial (summed over tp by the unit)."""

    backward_needs_params = False

    def __init__(self, module, ax):
        self.ax, self.kinds, self.decls = ax, [None], [module.decl]

    def forward(self, params, x):
        ax, Tl = self.ax, x.shape[1]
        p0 = (ax.sp_rank * ax.tp + ax.tp_rank) * Tl if ax.sequence_parallel else ax.sp_rank * Tl
        if p0 + Tl > params[0].shape[0]:
            raise ConfigError(f"PositionalEmbedding: positions up to {p0 + Tl} but max_len is "
                              f"{params[0].shape[0]}")
        return x + params[0][p0:p0 + Tl], p0

    def backward(self, params, grads, cache, dy):
        grads[0][cache:cache + dy.shape[1]] += dy.sum(axis=0)
        return dy


# ---------------------------------------------------------------------------------- linears
class ColumnParallelLinear(_Parallel):
    """Linear(split="column") with w[:, cols] and b[cols] local: the Linear module on the shard's
    shape (C_in, C_out/tp). x (B, T, Cin) replicated (or (B, Tl, Cin), gathered, with
    sequence_parallel) -> y (B, T, Cout/tp). Backward sums dx over tp (all-reduce; reduce-scatter
    with sequence_parallel). Collective on tp."""

    def __init__(self, module, ax):
        c_in, c_out = module.decls[0].shape
        self.ax, has_bias = ax, len(module.decls) == 2
        self.linear = Linear(c_in, _split_of("Linear output width", c_out, ax.tp), bias=has_bias)
        self.kinds = ["cols"] * len(module.decls)
        self.decls = _local_decls(module.decls, self.kinds, ax.tp)

    def forward(self, params, x):
        if self.ax.sequence_parallel:
            x = tpl.gather_sequence(x, self.ax.tp_group)
        return self.linear.forward(params, x)

    def backward(self, params, grads, cache, dy):
        dx = self.linear.backward(params, grads, cache, dy)
        return tpl.sum_partial(dx, self.ax.tp_group, self.ax.sequence_parallel)


class RowParallelLinear(_Parallel):
    """Linear(split="row") with w[rows, :] local and b whole: the bias-free Linear module on the
    shard's shape (C_in/tp, C_out), its output summed over tp (all-reduce; reduce-scatter to
    (B, Tl, Cout) with sequence_parallel), then the bias added once. x (B, T, Cin/tp) ->
    y (B, T, Cout). Collective on tp."""

    def __init__(self, module, ax):
        c_in, c_out = module.decls[0].shape
        self.ax, self.has_bias = ax, len(module.decls) == 2
        self.linear = Linear(_split_of("Linear input width", c_in, ax.tp), c_out, bias=False)
        self.kinds = ["rows", None][:len(module.decls)]
        self.decls = _local_decls(module.decls, self.kinds, ax.tp)

    def forward(self, params, x):
        y, cache = self.linear.forward(params[:1], x)
        y = tpl.sum_partial(y, self.ax.tp_group, self.ax.sequence_parallel)
        if self.has_bias:
            y += params[1]
        return y, cache

    def backward(self, params, grads, cache, dy):
        if self.has_bias:  # with sequence_parallel this rank's positions only: a partial sum
            grads[1] += dy.reshape(-1, dy.shape[-1]).sum(axis=0)
        if self.ax.sequence_parallel:
            dy = tpl.gather_sequence(dy, self.ax.tp_group)
        return self.linear.backward(params[:1], grads[:1], cache, dy)


# -------------------------------------------------------------------------- attention, MLP
class ParallelAttention(_Parallel):
    """MultiHeadAttention with Hl = H/tp whole heads per tp rank: a column-parallel qkv (each of
    q, k, v cut by heads: kind "qkv"), the module's own attention core (its `core`, Ulysses over
    sp: H/(tp*sp) heads of the full sequence per rank) and a row-parallel output projection.
    x, y: (B, Tl, C). Collective on tp and sp."""

    def __init__(self, module, ax):
        self.ax, self.core = ax, module.core
        self.n_head = _split_of("n_head", module.n_head, ax.tp,
                                ": each tensor-parallel rank needs whole attention heads; use "
                                "n_head divisible by tp")
        check_heads(self.n_head, ax.sp)
        C = module.decls[0].shape[0]
        self.qkv = ColumnParallelLinear(Linear(C, 3 * C), ax)
        self.proj = RowParallelLinear(Linear(C, C, split="row"), ax)
        self.kinds = ["qkv", "qkv", "rows", None]
        self.decls = _local_decls(module.decls, self.kinds, ax.tp)

    def forward(self, params, x):
        qkv, c_qkv = self.qkv.forward(params[0:2], x)
        a, c_att = ulysses_attention_forward(qkv, self.n_head, self.ax.sp_group, self.core)
        y, c_proj = self.proj.forward(params[2:4], a)
        return y, (c_qkv, c_att, c_proj)

    def backward(self, params, grads, cache, dy):
        c_qkv, c_att, c_proj = cache
        da = self.proj.backward(params[2:4], grads[2:4], c_proj, dy)
        dqkv = ulysses_attention_backward(da, c_att, self.ax.sp_group)
        return self.qkv.backward(params[0:2], grads[0:2], c_qkv, dqkv)


class ParallelMLP(_Parallel):
    """MLP with the hidden width 4C split over tp: its pieces on the local shard, a column-
    parallel bias-free fc, the fc bias with the GELU (BiasGELU), a row-parallel projection.
    x, y: (B, Tl, C). Collective on tp."""

    def __init__(self, module, ax):
        C, F = module.decls[0].shape
        _split_of("MLP width 4*n_embd", F, ax.tp)
        self.ax = ax
        self.fc = ColumnParallelLinear(Linear(C, F, bias=False), ax)
        self.act = BiasGELU(F // ax.tp)
        self.proj = RowParallelLinear(Linear(F, C, split="row"), ax)
        self.kinds = ["cols", "cols", "rows", None]
        self.decls = _local_decls(module.decls, self.kinds, ax.tp)

    def forward(self, params, x):
        f, c_fc = self.fc.forward(params[0:1], x)
        f, c_act = self.act.forward(params[1:2], f)
        y, c_proj = self.proj.forward(params[2:4], f)
        return y, (c_fc, c_act, c_proj)

    def backward(self, params, grads, cache, dy):
        c_fc, c_act, c_proj = cache
        df = self.proj.backward(params[2:4], grads[2:4], c_proj, dy)
        df = self.act.backward(params[1:2], grads[1:2], c_act, df)
        return self.fc.backward(params[0:1], grads[0:1], c_fc, df)


class ParallelTransformerBlock(_Parallel):
    """TransformerBlock with ParallelAttention and ParallelMLP between its own (replicated)
    LayerNorms (TransformerBlock.forward_with: the block's operations in its order).
    x, y: (B, Tl, C). Collective on tp and sp."""

    def __init__(self, module, ax):
        self.ax, self.block = ax, module
        self.attn = ParallelAttention(module.parts[1][1], ax)
        self.mlp = ParallelMLP(module.parts[3][1], ax)
        self.kinds = [None, None] + self.attn.kinds + [None, None] + self.mlp.kinds
        self.decls = _local_decls(module.param_specs(), self.kinds, ax.tp)

    def forward(self, params, x):
        return self.block.forward_with(params, x, self.attn, self.mlp)

    def backward(self, params, grads, cache, dy):
        return self.block.backward_with(params, grads, cache, dy, self.attn, self.mlp)


# ------------------------------------------------------------------------------------ head
class VocabParallelLMHead(_Parallel):
    """LMHead with W's vocabulary rows split over tp (tied or its own): the LMHead module on the
    local rows, logits (B, Ts, V/tp) = x @ W_local.T (x gathered along the sequence first with
    sequence_parallel; dx summed over tp), and the vocabulary-parallel cross-entropy
    (tensor.vocab_crossentropy_forward), whose loss is the mean over this rank's B * Ts
    positions, the same on every tp rank. Collective on tp."""

    def __init__(self, module, ax):
        self.ax, self.kinds = ax, ["vocab"]
        V, C = module.decl.shape
        self.vocab_start = tpl.vocab_range(V, ax.tp_rank, ax.tp)[0]
        self.head = LMHead(V // ax.tp, C)
        self.decls = _local_decls([module.decl], self.kinds, ax.tp)

    def forward(self, params, x):
        if self.ax.sequence_parallel:
            x = tpl.gather_sequence(x, self.ax.tp_group)
        return self.head.forward(params, x)

    def backward(self, params, grads, cache, dy):
        dx = self.head.backward(params, grads, cache, dy)
        return tpl.sum_partial(dx, self.ax.tp_group, self.ax.sequence_parallel)

    def loss_forward(self, y, targets):
        return tpl.vocab_crossentropy_forward(y, targets, self.vocab_start, self.ax.tp_group)

    def loss_backward(self, scale, cache):
        return tpl.vocab_crossentropy_backward(scale, cache)


# --------------------------------------------------------------------------- transformation
class _SequenceSplitUnit(Module):
    """A unit under Megatron sequence parallelism: its replicated parameters saw only this tp
    rank's positions, so backward collects their gradients in a scratch buffer and adds its sum
    over tp (one all-reduce) into the real ones. Collective on tp."""

    def __init__(self, module, kinds, ax):
        self.module, self.ax = module, ax
        self.partial = [j for j, k in enumerate(kinds) if k is None]
        self.backward_needs_params = module.backward_needs_params
        if hasattr(module, "loss_forward"):
            self.loss_forward, self.loss_backward = module.loss_forward, module.loss_backward

    def param_specs(self):
        return self.module.param_specs()

    def forward(self, params, x):
        return self.module.forward(params, x)

    def backward(self, params, grads, cache, dy):
        xp = xp_of(grads[self.partial[0]])
        scratch = xp.zeros(sum(grads[j].size for j in self.partial), grads[self.partial[0]].dtype)
        local, at = list(grads), 0
        for j in self.partial:
            local[j] = scratch[at:at + grads[j].size].reshape(grads[j].shape)
            at += grads[j].size
        dx = self.module.backward(params, local, cache, dy)
        self.ax.tp_group.all_reduce(scratch)
        for j in self.partial:
            grads[j] += local[j]
        return dx


class _Wrapped(Module):
    """A unit around `module`: its declarations, needs and head (loss_forward) are the module's."""

    def __init__(self, module, ax):
        self.module, self.ax = module, ax
        self.backward_needs_params = module.backward_needs_params
        if hasattr(module, "loss_forward"):
            self.loss_forward, self.loss_backward = module.loss_forward, module.loss_backward

    def param_specs(self):
        return self.module.param_specs()


class SplitSequenceAfter(_Wrapped):
    """A unit that makes the positions from the whole input (PatchEmbedding, ClassToken), run
    whole on every sp rank; its output (B, T, C) is cut to this sp rank's positions, (B, T/sp, C)
    (mesh.seq_slice). Backward puts dy at those positions of a zero (B, T, C). Local; raises
    ConfigError (on every rank alike) when sp does not divide T."""

    def forward(self, params, x):
        y, cache = self.module.forward(params, x)
        T, sp = y.shape[1], self.ax.sp
        if T % sp:
            raise ConfigError(f"{T} positions per sample are not divisible by sp({sp}); each sp "
                              f"rank takes T/sp of them (e.g. choose the image and patch sizes "
                              f"so that T = patches (+ 1 class token) divides by sp)")
        Ts = T // sp
        part = xp_of(y).ascontiguousarray(y[:, self.ax.sp_rank * Ts:(self.ax.sp_rank + 1) * Ts])
        return part, (cache, y.shape)

    def backward(self, params, grads, cache, dy):
        cache, shape = cache
        Ts = dy.shape[1]
        full = xp_of(dy).zeros(shape, dy.dtype)
        full[:, self.ax.sp_rank * Ts:(self.ax.sp_rank + 1) * Ts] = dy
        return self.module.backward(params, grads, cache, full)


class GatherSequenceBefore(_Wrapped):
    """A unit that reads every position of a sample (ClassificationHead, ClassTokenHead): its
    input, this sp rank's positions (B, T/sp, C), is all-gathered over sp to (B, T, C) and the
    unit runs whole on every sp rank (the same output and loss on each). Backward keeps this
    rank's positions of dx, times sp: the engines average gradients over sp (mesh.loss_group),
    and the sp ranks' positions carry the one loss's gradient between them. Collective on sp."""

    def forward(self, params, x):
        return self.module.forward(params, tpl.gather_sequence(x, self.ax.sp_group))

    def backward(self, params, grads, cache, dy):
        dx = self.module.backward(params, grads, cache, dy)
        Ts, r = dx.shape[1] // self.ax.sp, self.ax.sp_rank
        return dx[:, r * Ts:(r + 1) * Ts] * self.ax.sp


def _child_names(seq):
    """The (name or None) of each child of a Sequential, recovered from its prefixed
    declarations."""
    names, at = [], 0
    specs = seq.param_specs()
    for child in seq.children:
        own = child.param_specs()
        name = None
        if own:
            full, local = specs[at].name, own[0].name
            name = full[:-len(local) - 1] if full != local else None
        names.append(name)
        at += len(own)
    return names


_PARALLEL = {Embedding: VocabParallelEmbedding, PositionalEmbedding: PositionSlice,
             MultiHeadAttention: ParallelAttention, MLP: ParallelMLP,
             TransformerBlock: ParallelTransformerBlock, LMHead: VocabParallelLMHead}
_WHOLE_SEQUENCE = WHOLE_INPUT + WHOLE_HEAD
_POSITION_WISE = (LayerNorm, Linear)  # replicated parameters, one position at a time


def parallel_module(module, ax):
    """(parallel module, kinds) for one module (see the module docstring). Raises ConfigError
    for a module that cannot run under these axes, naming it."""
    if isinstance(module, Sequential):
        children, kinds = [], []
        for name, child in zip(_child_names(module), module.children):
            par, k = parallel_module(child, ax)
            children.append(par if name is None else (name, par))
            kinds += k
        return Sequential(*children), kinds
    kind = type(module)
    if isinstance(module, _WHOLE_SEQUENCE) and ax.splits_sequence:
        raise ConfigError(f"{kind.__name__} needs every position of a sample, but sequence "
                          f"parallelism (sp={ax.sp}, sequence_parallel={ax.sequence_parallel}) "
                          f"gives each rank only some here; use dp, tp and sp (Ulysses) for "
                          f"this model, with its whole-sequence units first and last")
    if kind in _PARALLEL:
        par = _PARALLEL[kind](module, ax)
        return par, par.kinds
    if isinstance(module, Linear):
        split = module.decls[0].split
        if split == "column":
            par = ColumnParallelLinear(module, ax)
            return par, par.kinds
        if split == "row":
            par = RowParallelLinear(module, ax)
            return par, par.kinds
    decls = module.param_specs()
    if any(d.split != "replicated" for d in decls) and ax.tp > 1:
        raise ConfigError(f"{kind.__name__} declares tensor-parallel splits "
                          f"{[d.split for d in decls]} but has no tensor-parallel version; use tp=1")
    if ax.splits_sequence and not isinstance(module, _POSITION_WISE):
        raise ConfigError(f"{kind.__name__} has no sequence-parallel version (it may mix "
                          f"positions); use sp=1 and sequence_parallel=False")
    return module, [None] * len(decls)


def _leaves(module):
    if isinstance(module, Sequential):
        for child in module.children:
            yield from _leaves(child)
    else:
        yield module


def _check_linear_pairs(modules):
    """ConfigError unless every column-split Linear is followed by a row-split Linear with no
    module between them (that module would see 1/tp of the features), and every row-split Linear
    follows one."""
    column = None
    for m in (leaf for module in modules for leaf in _leaves(module)):
        split = m.decls[0].split if type(m) is Linear else None
        if split == "row" and column is None:
            raise ConfigError("a row-split Linear must follow a column-split Linear (its input is "
                              "split over tp); declare it split='replicated' or add the column one")
        if column is not None and split != "row":
            raise ConfigError(f"{type(m).__name__} follows a column-split Linear, whose output is "
                              f"split over tp: put a row-split Linear right after it")
        column = m if split == "column" else None
    if column is not None:
        raise ConfigError("the model ends in a column-split Linear, whose output is split over tp: "
                          "put a row-split Linear after it")


def whole_sequence_ends(units):
    """(front, back) of a model's units: front, the last unit holding a module that makes the
    positions from the whole input (PatchEmbedding, ClassToken), -1 if none; back, the first
    unit holding one that reads every position (ClassificationHead, ClassTokenHead), len(units)
    if none. Under sp (Ulysses) units 0..front and back.. run whole on every sp rank. Local."""
    modules = [unit[1] if isinstance(unit, tuple) else unit for unit in units]

    def holding(kinds):
        return [u for u, m in enumerate(modules) if any(isinstance(leaf, kinds)
                                                         for leaf in _leaves(m))]
    return max(holding(WHOLE_INPUT), default=-1), min(holding(WHOLE_HEAD), default=len(modules))


def parallelize(units, ax):
    """The units of a tensor/sequence-parallel model: [(name or None, module)] and, per unit,
    the kinds of its declarations (tied ones included). units: Modules or (name, Module) pairs,
    as rtxmpi.nn.module.Model takes. Under sp (Ulysses) the units up to the last that makes
    the positions from the whole input run whole on every sp rank, then their output is cut
    (SplitSequenceAfter), and the units from the first that reads every position on gather the
    sequence first (GatherSequenceBefore): `whole_sequence_ends`. Local; raises ConfigError on
    every rank alike (it depends only on the units and the axes), also when such units are not
    all before and after the sequence-split ones."""
    named = [unit if isinstance(unit, tuple) else (None, unit) for unit in units]
    if ax.tp > 1:
        _check_linear_pairs(m for _, m in named)
    front, back = -1, len(named)
    if ax.sp > 1 and not ax.sequence_parallel:
        front, back = whole_sequence_ends(named)
        if front >= back:
            raise ConfigError(f"unit {back} reads every position of a sample but unit {front}, "
                              f"after it, makes positions from the whole input: under sp the "
                              f"whole-input units must all come before the whole-sequence heads")
    out, kinds = [], []
    for u, (name, module) in enumerate(named):
        par, k = parallel_module(module, ax.whole() if u <= front or u >= back else ax)
        if ax.sequence_parallel and None in k:
            par = _SequenceSplitUnit(par, k, ax)
        if u == front:
            par = SplitSequenceAfter(par, ax)
        if u == back:
            par = GatherSequenceBefore(par, ax)
        out.append(par if name is None else (name, par))
        kinds.append(k)
    return out, kinds


class _LiveViews(FlatParams):
    """The default provider: the model's Param views, read at each fetch (a pipeline stage
    re-points them at its own buffers)."""

    def __init__(self, model):
        self.model = model

    def fetch(self, unit, then=None):
        a, b = self.model.units[unit]
        return [p.data for p in self.model.params[a:b]]

    def grads(self, unit):
        a, b = self.model.units[unit]
        return [p.grad for p in self.model.params[a:b]]


def units_of(model):
    """A Model's units as Modules or (name, Module) pairs, the names recovered from its parameter
    names (what Model was built from, up to units without parameters of their own)."""
    out = []
    for m, (first, _) in zip(model.modules, model.units):
        own = [d for d in m.param_specs() if d.tied_to is None]
        name = None
        if own and model.params[first].name != own[0].name:
            name = model.params[first].name[:-len(own[0].name) - 1]
        out.append(m if name is None else (name, m))
    return out


class TensorParallelModel(Model):
    """One rank's part of a Model under tensor (tp) and sequence (sp) parallelism.

    units: the one-process model's units (Modules or (name, Module) pairs, e.g.
    rtxmpi.nn.gpt.gpt_units(cfg)), or a Model (its units and its current parameter values);
    mesh: rtxmpi.mesh.DeviceMesh (uses group("tp"), group("sp")); seed: the same on every rank;
    xp, dtype: as for Model; sequence_parallel: Megatron sequence parallelism inside tp. Every
    rank draws the full model's initial values (init_flat of the units' declarations; a given
    Model's flat_data instead) and keeps its shard: the one-process Model's values.
    Raises ConfigError (on every rank alike) when a split width is not divisible by tp, the
    heads per tp rank not by sp, or a module cannot run under the layout (parallel_module).

    Attributes (as Model's, for this rank's shards): xp, dtype, modules (the parallel units),
    params (the full model's names, local shapes), flat_data, flat_grad, num_params (local),
    units, provider; and mesh, tp_group, sp_group, tp, sp, tp_rank, sp_rank, sequence_parallel,
    kinds (per parameter: tensor.shard's kind), replicated (per parameter: kind is None),
    full_specs (the one-process layout), full_num_params, whole_input / whole_head (under sp:
    the first units take the whole input / the head reads every position; whole_sequence_ends).
    """

    def __init__(self, units, mesh, seed=0, xp=np, dtype=np.float32, sequence_parallel=False):
        values = None
        if isinstance(units, Model):
            if units.flat_data is None:
                raise ConfigError("the model's parameters are held by its provider (ZeRO-3); "
                                  "pass its units, or a Model that holds them")
            values = np.asarray(to_host(units.flat_data), np.float64)
            units = units_of(units)
        units = list(units)
        ax = self.axes = Axes(mesh, sequence_parallel)
        self.mesh, self.tp_group, self.sp_group = mesh, ax.tp_group, ax.sp_group
        self.tp, self.sp, self.tp_rank, self.sp_rank = ax.tp, ax.sp, ax.tp_rank, ax.sp_rank
        self.sequence_parallel = ax.sequence_parallel
        parallel_units, unit_kinds = parallelize(units, ax)
        front, back = whole_sequence_ends(units) if ax.sp > 1 else (-1, len(units))
        self.whole_input, self.whole_head = front >= 0, back < len(units)
        # Model draws values for the local shapes; they are replaced by the shards of the full draw
        super().__init__(parallel_units, seed=seed, xp=xp, dtype=dtype)
        full_decls, self.full_specs = own_layout(units)
        self.full_num_params = self.full_specs[-1].stop if self.full_specs else 0
        self.kinds = [k for decls, kinds in zip(declarations(units), unit_kinds)
                      for d, k in zip(decls, kinds) if d.tied_to is None]
        self.replicated = [k is None for k in self.kinds]
        full = init_flat(full_decls, self.full_specs, seed) if values is None else values
        local = np.empty(self.num_params, np.float64)
        for p, spec, kind in zip(self.params, self.full_specs, self.kinds):
            piece = tpl.shard(kind, full[spec.offset:spec.stop].reshape(spec.shape), self.tp_rank,
                              self.tp)
            local[p.offset:p.offset + p.size] = piece.reshape(-1)
        self.flat_data[...] = xp.asarray(local.astype(self.dtype))
        self.provider = _LiveViews(self)

    # ------------------------------------------------------------------ shards
    def shard(self, i, full):
        """This tp rank's piece of parameter i from the full array (the one-process shape)."""
        return tpl.shard(self.kinds[i], full, self.tp_rank, self.tp)

    def unshard(self, i, pieces):
        """Parameter i whole from the tp ranks' pieces, in tp-rank order."""
        return tpl.unshard(self.kinds[i], pieces)

    def gather_full(self, local):
        """The one-process model's flat vector (full_specs layout) from every tp rank's `local`
        flat vector (num_params long: parameters, gradients or optimizer state). Collective on
        group("tp") (one all_gather). Returns an array of full_num_params elements."""
        xp, tp = self.xp, self.tp
        pieces = self.tp_group.all_gather(xp.ascontiguousarray(local)).reshape(tp, -1)
        out = xp.empty(self.full_num_params, local.dtype)
        for i, (p, spec) in enumerate(zip(self.params, self.full_specs)):
            parts = [pieces[r, p.offset:p.offset + p.size].reshape(p.shape) for r in range(tp)]
            out[spec.offset:spec.stop] = self.unshard(i, parts).reshape(-1)
        return out

    def local_from_full(self, full):
        """This rank's local flat vector (num_params) from a one-process flat vector. Local."""
        xp = self.xp
        out = xp.empty(self.num_params, self.dtype)
        for i, (p, spec) in enumerate(zip(self.params, self.full_specs)):
            piece = self.shard(i, xp.asarray(full[spec.offset:spec.stop]).reshape(spec.shape))
            out[p.offset:p.offset + p.size] = piece.reshape(-1)
        return out

    def grad_norm_sq(self):
        """Squared L2 norm of the FULL model's gradient (float): the tp-split parts summed over
        group("tp"), the replicated ones counted once. Collective on group("tp")."""
        total = np.zeros(1, np.float64)
        for lo, hi in tpl.norm_ranges(self.params, self.tp_rank, replicated=self.replicated):
            total[0] += grad_norm_sq(self.flat_grad[lo:hi])
        if self.tp > 1:
            self.tp_group.all_reduce(total)
        return float(total[0])

    # ------------------------------------------------------------------ passes
    def check_inputs(self, x, targets):
        """ConfigError when this rank's inputs cannot run: with sequence_parallel, the positions
        per rank (x.shape[1]) must divide by tp. Local; ParallelGPT checks the tokens too."""
        if self.sequence_parallel and (getattr(x, "ndim", 0) < 2 or x.shape[1] % self.tp):
            raise ConfigError(f"sequence_parallel: input of shape {getattr(x, 'shape', None)} "
                              f"does not split into tp({self.tp}) position chunks; use a sequence "
                              f"length divisible by tp * sp")

    def _own_positions(self, x, targets):
        """This sp rank's positions (mesh.seq_slice of dim 1) of x, unless the model's first
        units make the positions from the whole input (whole_input), and of targets, unless its
        head reads every position (whole_head: targets per sample); ConfigError."""
        if self.sp == 1 or (self.whole_input and self.whole_head):
            return x, targets
        if self.whole_head:
            if getattr(x, "ndim", 0) < 2:
                raise ConfigError(f"x must be a (B, T, ...) array, got {getattr(x, 'shape', None)}")
            return x[:, self.mesh.seq_slice(x.shape[1])], targets
        if getattr(targets, "ndim", 0) < 2 or (
                not self.whole_input and getattr(x, "shape", (None,))[:2] != targets.shape[:2]):
            raise ConfigError(f"x and targets must be (B, T, ...) arrays of the same B and T, "
                              f"got {getattr(x, 'shape', None)} and "
                              f"{getattr(targets, 'shape', None)}")
        cols = self.mesh.seq_slice(targets.shape[1])
        return (x if self.whole_input else x[:, cols]), targets[:, cols]

    def _check_same_inputs(self, x, targets, error):
        """Checking mode: every tp rank must feed the same inputs (they compute one model
        together). Collective on tp (one all_gather of a crc32 per rank; a rank whose own check
        failed, `error`, sends -1 and is left out of the comparison). Returns `error`, or a
        ConfigError when the valid ranks' inputs differ."""
        crc = -1
        if error is None:
            host = [a if isinstance(a, np.ndarray) else a.get() for a in (x, targets)]
            crc = zlib.crc32(np.ascontiguousarray(host[1]).tobytes(),
                             zlib.crc32(np.ascontiguousarray(host[0]).tobytes()))
        crcs = self.tp_group.all_gather(np.array([crc], np.int64))
        valid = crcs[crcs >= 0]
        if error is None and not (valid == valid[0]).all():
            return ConfigError(f"tensor-parallel ranks fed different tokens (crc32 per tp rank: "
                               f"{[hex(int(c)) for c in crcs]}); every tp rank of a dp/sp "
                               f"coordinate must read the same samples (mesh.batch_slice)")
        return error

    def forward(self, x, targets, full_sequence=False):
        """Loss and cache for this rank's inputs.

        x, targets: this rank's samples (its dp slice, the same on every tp rank) at its
        positions [sp_rank * Ts, (sp_rank + 1) * Ts) (mesh.seq_slice); with full_sequence=True
        the whole sequence, this sp rank's positions taken here along dim 1. Returns (loss,
        cache): loss a Python float, the mean over this rank's samples and positions (the same
        on every tp rank; average it over mesh.loss_group). Collective on the mesh (every rank
        of mesh.world calls it): raises ConfigError on EVERY rank, naming each offending rank,
        when any rank's inputs are bad (check_inputs; one 1-byte MAX all_reduce over mesh.world
        before any other collective), or in checking mode when tp ranks were fed different
        inputs.
        """
        error = None
        try:
            if full_sequence:
                x, targets = self._own_positions(x, targets)
            self.check_inputs(x, targets)
        except ConfigError as exc:
            error = exc
        if self.tp_group.check and self.tp > 1:
            error = self._check_same_inputs(x, targets, error)
        raise_if_any_failed(self.mesh.world, error, "tensor-parallel batch check")
        x = self.xp.asarray(x)
        if x.dtype.kind == "f":  # e.g. images: computed in the model's dtype
            x = x.astype(self.dtype, copy=False)
        return super().forward(x, self.xp.asarray(targets))

    def unit_forward(self, u, x):
        """Unit u's forward on x (a pipeline stage runs its units one by one). Returns y,
        cache. Collective on tp and sp."""
        params = self._take(u, None, get=True)
        y, cache = self.modules[u].forward(params, x)
        self._release(u)
        return y, cache

    def unit_backward(self, u, dy, cache):
        """Unit u's backward: adds its gradients, returns dx. Collective on tp and sp."""
        fetch = self.modules[u].backward_needs_params
        params = self._take(u, None, get=True) if fetch else None
        dx = run_backward(self.modules[u], params, self._take(u, None, get=False), cache, dy)
        if fetch:
            self._release(u)
        self.provider.grads_ready(u)
        return dx


class ParallelGPT(TensorParallelModel):
    """The GPT of rtxmpi.nn (gpt_units(cfg), same names and initial values) as a
    TensorParallelModel: heads and the MLP width split over tp, vocabulary-parallel embedding,
    head and cross-entropy, Ulysses attention over sp.

    cfg: GPTConfig; mesh, seed, xp, dtype, sequence_parallel: as TensorParallelModel.
    Raises ConfigError (on every rank) when n_head, 4*n_embd or vocab_size is not divisible by
    tp, or n_head/tp not by sp. forward(idx, targets, full_sequence=False) takes (B, Ts) token ids
    (B, T with full_sequence) and checks them (check_tokens) on every rank.
    """

    def __init__(self, cfg, mesh, seed=0, xp=np, dtype=np.float32, sequence_parallel=False):
        if not isinstance(cfg, GPTConfig):
            raise ConfigError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        super().__init__(gpt_units(cfg), mesh, seed=seed, xp=xp, dtype=dtype,
                         sequence_parallel=sequence_parallel)

    def check_inputs(self, idx, targets):
        self.check_tokens(idx, targets)

    def check_tokens(self, idx, targets):
        """Raise ConfigError unless idx, targets are (B, Ts) integer arrays of the same shape,
        B, Ts >= 1, Ts * sp <= seq_len (Ts divisible by tp with sequence_parallel), ids in
        [0, vocab_size): what `forward` checks on this rank, without computing. Local."""
        self._check_ids(idx, "idx")
        self._check_ids(targets, "targets")
        if targets.shape != idx.shape:
            raise ConfigError(f"targets shape {targets.shape} must equal idx shape {idx.shape}")

    def _own_positions(self, idx, targets):
        if getattr(idx, "ndim", None) != 2 or getattr(targets, "shape", None) != idx.shape:
            raise ConfigError(f"idx and targets must be (B, T) arrays of the same shape, got "
                              f"{getattr(idx, 'shape', None)} and {getattr(targets, 'shape', None)}")
        cols = self.mesh.seq_slice(idx.shape[1])
        return idx[:, cols], targets[:, cols]

    def _check_ids(self, arr, what):
        if getattr(arr, "ndim", None) != 2 or arr.dtype.kind not in "iu":
            raise ConfigError(f"{what} must be a (B, Ts) integer array, got "
                              f"{getattr(arr, 'shape', type(arr).__name__)}")
        B, Ts = arr.shape
        if B == 0 or Ts == 0:
            raise ConfigError(f"{what} must have at least one position, got shape {arr.shape}")
        if Ts * self.sp > self.cfg.seq_len:
            raise ConfigError(f"{what} has {Ts} positions per sp rank, {Ts * self.sp} in all, but "
                              f"the model's seq_len is {self.cfg.seq_len}")
        if self.sequence_parallel and Ts % self.tp:
            raise ConfigError(f"sequence_parallel: {Ts} positions per rank are not divisible by "
                              f"tp({self.tp}); use a sequence length divisible by tp * sp")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ConfigError(f"{what} holds token ids in [{lo}, {hi}] but vocab_size is "
                              f"{self.cfg.vocab_size}")


__all__ = ["Axes", "parallel_module", "parallelize", "whole_sequence_ends", "units_of",
           "SplitSequenceAfter", "GatherSequenceBefore", "TensorParallelModel", "ParallelGPT",
           "VocabParallelEmbedding", "PositionSlice", "ColumnParallelLinear", "RowParallelLinear",
           "ParallelAttention", "ParallelMLP", "ParallelTransformerBlock", "VocabParallelLMHead"]
