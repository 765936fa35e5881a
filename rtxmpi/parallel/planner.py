"""The planner: which (dp, tp, pp, sp) layout, micro-batch count, ZeRO stage and pipeline schedule
trains a model fastest on this machine, within its memory.

    rtxmpi plan --model small --global-batch 32 --seq-len 128 --world-size 4 --profile prof.json
    rtxmpi plan --model-kind vit --vit-size small --global-batch 64 --world-size 4
    plan = make_plan(cfg, global_batch=32, world_size=4, profile=default_profile())
    print(plan.table(top=10)); print(plan.reason())

For GPU clusters described by a profile file (thousands of devices, closed forms), see
rtxmpi.parallel.cluster; `rtxmpi plan --profile dgx-a100` runs it.

Inputs: the model (a GPTConfig, a ViTConfig or an rtxmpi.nn Model of the shipped modules, read
once into a ModelCosts by `model_costs`: per unit its parameters, which units are the blocks, the
blocks' width, heads and positions, the head's width and whether it maps every position, what is
vocabulary-parallel, the first unit's matmul FLOPs), the global batch (samples per step), the
world size and ranks per
node, the memory per device (bytes), and a HardwareProfile (rtxmpi/parallel/calibrate.py: matmul
and element-wise rates with every local rank busy, the contention that implies, and alpha-beta fits
of all_reduce, all_gather, reduce_scatter, all_to_all and send/recv inside and across nodes).

Enumeration (`enumerate_layouts`): every dp * tp * pp * sp == world_size, every micro-batch count m
dividing the per-rank batch (global_batch / dp), ZeRO stages 0-3 and, when pp > 1, the GPipe and
1F1B schedules. `check_layout` says why a candidate is invalid: every reason the layout object
gives (rtxmpi.parallel.layout.Layout.reasons, 'rule: explanation': the world size, the model's
heads, vocabulary and layers, the sequence, the batch split the runtime runs, the schedule, what
composes with ZeRO, offload and recomputation; the rules the runtime itself checks), the
planner's own preference (ZeRO with dp * sp == 1 shards nothing), and an optional `supported`
filter (rtxmpi.topology.placement_filter: tp inside an NVLink island); then `estimate` rejects
what does not fit in memory.

Cost model (`estimate`), per step, seconds; n = b * T / sp positions of a micro-batch of b samples
on a rank, h = n_head / (tp * sp) heads, S = b * h * T * T attention scores, P = parameters per
rank, V the head's width, r its rows (n for a language-model head, b for a classifier's):
  compute of one block and micro-batch, at "alone" speed (one rank computing on the node):
    dense GEMMs   3 * 24 n C^2 / tp FLOPs (forward 1x, backward 2x: the 6 * params * tokens rule
                  for the qkv, proj, fc and mlp-proj matrices) at dense_flops
    attention     3 * 4 S hs FLOPs (q k^T and att v, full T x T: the reference layers do not skip
                  the masked half) at attn_flops
    element-wise  S (score_fwd_ns + score_bwd_ns) + 4 n C / tp gelu_ns + 2 n C ln_ns (LayerNorm is
                  replicated over tp)
  head (last stage): 3 * 2 r C V / tp FLOPs and r V / tp cross-entropy elements (score rates;
  "/ tp" only for a vocabulary-parallel head); embeddings: n C ln_ns / 2, plus a patch
  embedding's matmul (3x its forward FLOPs, whole on every sp rank).
  The optimizer: P / (dp if ZeRO >= 1) * adam_ns.
  contention: when n of a node's R ranks compute at once and the others wait in MPI, each runs at
  speed(n) = min(1, effective_cores / (n + wait_weight (R - n))) (processor sharing; waiting
  ranks spin-yield and still take a share), relative to speed(1), the condition the profile's
  rates were measured in; outside the pipeline every rank computes, so n = R.
  communication (alpha-beta, HardwareProfile.comm_time_s; intra-node unless the group spans
  nodes, mesh order pp, dp, sp, tp outermost to innermost as in rtxmpi.mesh):
    every collective also pays HardwareProfile.sync_time_s(n): the wait for the last of n ranks
         that computed before it (measured; large when ranks outnumber cores).
    tp   Megatron: per block 2 all_reduce of n C floats forward and 2 backward; a vocabulary-
         parallel embedding and head add one forward and one backward (Shoeybi et al. 2019).
    sp   Ulysses: per block, forward and backward, an all_to_all of the q, k, v shard (3 n C / tp
         floats) and one of the output (n C / tp) (Jacobs et al. 2023).
    pp   per micro-batch and stage boundary: send/recv of n C floats forward, the same backward.
    dp   gradients of P floats averaged over W = dp * sp (the ranks holding the same
         parameters), exposed in full: on the MPI CPU path a non-blocking reduction progresses
         only inside MPI calls, and a model under the 25 MiB bucket is one bucket reduced after
         backward anyway. ZeRO over the same W (_data_parallel_seconds): 1 all_reduce +
         all_gather, 2 reduce_scatter + all_gather, 3 per micro-batch a gather of every unit in
         forward and backward and a reduce_scatter of the unit gradients; offload copies.
  pipeline: the stage op lists of rtxmpi.parallel.schedule (GPipe, 1F1B) are simulated event by
  event with the processor-sharing rule above (so idle stages lend their cores to busy ones on an
  oversubscribed node); the bubble is 1 - busy / (stages * pipeline time). For equal stages on
  a machine without contention this gives the textbook (p - 1) / (m + p - 1).
  memory per rank (memory_breakdown), bytes, float32: params 4 P, grads 4 P, AdamW 16 P (m, v,
  decay mask, scratch); ZeRO and offload as zero.py's memory_bytes counts them, plus transients;
  activations per block and micro-batch 4 (4 n C + 13 n C / tp + S) bytes (the caches of
  rtxmpi.nn.layers; 17 n C / tp with the numpy references, whose GELU keeps its tanh too:
  RTXMPI_FUSED=0 or no compiled rtxmpi._fused), head 8 r V / tp; in flight: GPipe m
  micro-batches, 1F1B min(m, pp - stage).
  recompute "blocks" (Chen et al. 2016; the job's --recompute): each block
  keeps its input, 4 n C bytes, and one block's activations are rebuilt at a time in backward;
  each block's backward pays its forward again (compute and its tp/sp collectives).
Sources: Narayanan et al. 2021 (Megatron-LM, the bubble and 1F1B memory), Rajbhandari et al. 2020
(ZeRO), Korthikanti et al. 2022 (activation memory per layer).
Pure: nothing here communicates.
"""
import copy
import math
import sys
from dataclasses import asdict, dataclass, field, replace

from .. import fused
from ..comm.node import launch_comm, node_ranks
from ..data import batch_split, micro_batch_split
from ..errors import ConfigError
from ..exchange import broadcast_json
from ..nn.gpt import GPTConfig, gpt_units
from ..nn.module import Model
from ..nn.modules import (ClassificationHead, ClassToken, ClassTokenHead, Embedding, LayerNorm, Linear,
                          LMHead, PatchEmbedding, PositionalEmbedding, TransformerBlock)
from ..nn.vit import ViTConfig, vit_units
from .calibrate import HardwareProfile
from .layout import OFFLOADS, RECOMPUTE, ZERO_STAGES, Layout, ModelFacts, model_facts
from .layout import _leaves
from .schedule import build_schedule, partition

PLANNED_SCHEDULES = ("1f1b", "gpipe")  # the layout.SCHEDULES the cost model simulates
BUCKET_BYTES = 25 * 2**20
TIE_BAND = 0.02  # predictions this close are one estimate: among them, the least peak memory first
STEP_OVERHEAD_ALL_REDUCES = 3  # loss average, overflow agree, grad-norm reduction: small messages


@dataclass
class Estimate:
    """Predicted cost of one layout: times in milliseconds per step, peak memory in bytes per
    rank (the largest over stages), bubble as a fraction of the pipeline time."""

    layout: Layout
    compute_ms: float
    comm_ms: float
    bubble: float
    peak_bytes: int
    total_ms: float
    detail: dict = field(default_factory=dict)


@dataclass
class Plan:
    """The planner's answer: `ranked` valid estimates (fastest first), `rejected` (Layout, reason)
    pairs, the inputs and the profile used. `best` is ranked[0] (None when nothing fits)."""

    ranked: list
    rejected: list
    profile: HardwareProfile
    inputs: dict

    @property
    def best(self):
        return self.ranked[0] if self.ranked else None

    def table(self, top=10, show_rejected=False):
        """The ranked table (markdown) of the first `top` layouts; with show_rejected, every
        rejected candidate and its reason after it."""
        lines = ["| # | dp | tp | pp | sp | micro-batches | zero | schedule | compute ms | "
                 "exposed comm ms | bubble % | peak memory | total ms |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for i, e in enumerate(self.ranked[:top], 1):
            L = e.layout
            lines.append(f"| {i} | {L.dp} | {L.tp} | {L.pp} | {L.sp} | {L.micro_batches} | "
                         f"{L.zero_stage}{'' if L.offload == 'none' else ' +' + L.offload} | {L.schedule} | {e.compute_ms:.1f} | {e.comm_ms:.1f} | "
                         f"{100 * e.bubble:.0f} | {_fmt_bytes(e.peak_bytes)} | {e.total_ms:.1f} |")
        if len(self.ranked) > top:
            lines.append(f"({len(self.ranked) - top} more valid layouts not shown; --top K)")
        if show_rejected:
            lines += ["", f"rejected ({len(self.rejected)}):"]
            lines += [f"  {L}: {why}" for L, why in self.rejected]
        return "\n".join(lines)

    def reason(self, show_rejected=False):
        """One paragraph: why the first choice, against the runner-up of another layout, and what
        was rejected (counted by reason; show_rejected: the table listed them, so no hint to)."""
        p = self.profile
        src = ("the DEFAULT hardware profile (not measured here: run `rtxmpi plan --calibrate` "
               "under mpiexec for this machine)" if p.is_default else f"the profile {p.source}")
        if not self.ranked:
            why = _count_reasons(self.rejected)
            n = len(self.rejected)
            return (f"No layout fits: {'the' if n == 1 else 'all'} {n} candidate"
                    f"{' was' if n == 1 else 's were'} rejected "
                    f"({why}). Using {src}.")
        b = self.best
        L = b.layout
        parts = [f"Chosen: {L} ({L.flags()}), predicted {b.total_ms:.1f} ms per step: compute "
                 f"{b.compute_ms:.1f} ms, exposed communication {b.comm_ms:.1f} ms"
                 + (f", pipeline bubble {100 * b.bubble:.0f}%" if L.pp > 1 else "")
                 + f", peak memory {_fmt_bytes(b.peak_bytes)} per rank."]
        other = next((e for e in self.ranked if e.layout.degrees != L.degrees), None)
        if other is not None:
            gap = 100 * (other.total_ms / b.total_ms - 1)
            tie = (f"; within the {100 * TIE_BAND:.0f}% the estimate cannot separate, the choice "
                   f"needs less memory ({_fmt_bytes(b.peak_bytes)} vs "
                   f"{_fmt_bytes(other.peak_bytes)})" if other.peak_bytes > b.peak_bytes
                   and other.total_ms <= b.total_ms * (1 + TIE_BAND) else "")
            parts.append(f"The best other layout, {other.layout}, is predicted {other.total_ms:.1f} "
                         f"ms ({abs(gap):.0f}% {'slower' if gap >= 0 else 'faster'}): "
                         f"{_why_slower(b, other)}{tie}.")
        R = self.inputs["ranks_per_node"]
        if R > p.effective_cores * 1.05:
            parts.append(f"{R} rank{'' if R == 1 else 's'} per node share {p.effective_cores:.1f} effective cores "
                         f"(a waiting rank takes {p.wait_weight:.2f} of a busy one's share), so a "
                         f"rank computes {_sharing(p, R, 1)(1) / _sharing(p, R, 1)(R):.1f}x slower while all compute "
                         f"than while it alone does: idle pipeline stages lend "
                         f"{'all' if p.wait_weight < 0.005 else 'only part'} of their core.")
        if self.rejected:
            n = len(self.rejected)
            parts.append(f"{n} candidate{'' if n == 1 else 's'} rejected "
                         f"({_count_reasons(self.rejected)}"
                         f"{'' if show_rejected else '; --show-rejected lists them'}).")
        parts.append(f"Estimates use {src}.")
        return " ".join(parts)


def _why_slower(best, other):
    """The cost differences, largest first. The pipeline term is detail["bubble_ms"], the time the
    simulated pipeline takes beyond its compute and communication at the all-busy speed (idle
    stages lend their core, so it is not the table's bubble %, the idle share of stage time)."""
    d_comp = other.compute_ms - best.compute_ms
    d_comm = other.comm_ms - best.comm_ms
    d_bub = other.detail.get("bubble_ms", 0.0) - best.detail.get("bubble_ms", 0.0)
    items = sorted([(d_comp, f"{d_comp:+.1f} ms compute"), (d_comm, f"{d_comm:+.1f} ms exposed "
                    f"communication"), (d_bub, f"{d_bub:+.1f} ms of pipeline time beyond its work")],
                   key=lambda t: -abs(t[0]))
    return ", ".join(text for _, text in items if abs(_) >= 0.05) or "about the same costs"


def _count_reasons(rejected):
    counts = {}
    for _, why in rejected:
        key = why.split(":")[0]
        counts[key] = counts.get(key, 0) + 1
    return "; ".join(f"{n} x {k}" for k, n in sorted(counts.items(), key=lambda t: -t[1]))


def _fmt_bytes(n):
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


# ----------------------------------------------------------------------------- enumeration
def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def factorizations(world_size):
    """Every (dp, tp, pp, sp) of positive ints whose product is world_size."""
    out = []
    for dp in _divisors(world_size):
        for tp in _divisors(world_size // dp):
            for pp in _divisors(world_size // (dp * tp)):
                out.append((dp, tp, pp, world_size // (dp * tp * pp)))
    return out


def enumerate_layouts(world_size, global_batch, max_micro_batches=32, zero_stages=ZERO_STAGES,
                      schedules=PLANNED_SCHEDULES, offloads=("none",)):
    """Every candidate Layout: all factorizations, micro-batch counts dividing the per-rank batch
    (global_batch // dp, the smaller one when dp does not divide the batch: it is split unevenly
    and weighted by samples, rtxmpi.data.batch_split; up to max_micro_batches; 1 when no split
    is possible, dp > global_batch or an uneven one with pp > 1, so that check_layout can say
    why), the given ZeRO stages, for pp > 1 each schedule, and for ZeRO stages >= 1 each of
    `offloads` (a subset of OFFLOADS; stage 0 has no offload)."""
    out = []
    for dp, tp, pp, sp in factorizations(world_size):
        try:  # the smallest rank's batch (rtxmpi.data's rule; a pipeline needs it even)
            local = batch_split(global_batch, dp, equal=pp > 1)[-1]
        except ConfigError:
            local = 0
        micro = [m for m in _divisors(local) if m <= max_micro_batches] if local else [1]
        for m in micro:
            for z in zero_stages:
                for s in (schedules if pp > 1 else ("none",)):
                    for o in (offloads if z else ("none",)):
                        out.append(Layout(dp, tp, pp, sp, m, z, s, o))
    return out


def check_layout(model, layout, global_batch, world_size, supported=None):
    """None when `layout` can run `model` (a GPTConfig, a ViTConfig, a ModelCosts, anything
    rtxmpi.parallel.layout.model_facts takes) at this batch and world size, else every reason, joined
    by '; ', each 'rule: explanation' (Layout.reasons, the runtime's rules), then the planner's
    own: ZeRO with dp * sp == 1 shards nothing; then `supported(layout)` (None or a reason; e.g.
    rtxmpi.topology.placement_filter), as 'runtime: ...'. Local (pure)."""
    L = layout
    why = L.reasons(world_size, model, global_batch)
    if L.zero_stage and L.dp * L.sp == 1 and L.zero_stage in ZERO_STAGES:
        why.append("zero: dp * sp = 1 leaves nothing to shard (same as stage 0)")
    if not why and supported is not None:
        extra = supported(L)
        why += [f"runtime: {extra}"] if extra else []
    return "; ".join(why) or None


# ------------------------------------------------------------------------------ the model side
@dataclass(frozen=True)
class ModelCosts:
    """What the cost model reads of a model: a first unit (embeddings), body units that are
    transformer blocks (what a pipeline places in stages) and a head with the loss.

    seq_len: positions per sample through the blocks (T); n_embd, n_head: the blocks' width and
    heads; first_params, block_params (one per block), head_params: each unit's own parameter
    elements, one-process shapes; head_tied: elements of parameters the head uses that the first
    unit owns (ParamDecl.tied_to: copied into the last stage when pp > 1); head_width: the head's
    output width (vocabulary, classes); head_per_position: the head maps every position (a
    language model) or one row per sample (a classifier); first_vocab / head_vocab: the first
    unit / the head holds a vocabulary-split table (tensor parallelism splits it over tp and
    all_reduces its output / input gradient); first_flops: forward matmul FLOPs per sample of the
    first unit (a patch embedding's; a table lookup has none); facts: the layout rules' ModelFacts.
    Build one with `model_costs`."""

    name: str
    seq_len: int
    n_embd: int
    n_head: int
    first_params: int
    block_params: tuple
    head_params: int
    head_tied: int
    head_width: int
    head_per_position: bool
    first_vocab: bool
    head_vocab: bool
    first_flops: float
    facts: ModelFacts

    @property
    def n_layer(self):
        return len(self.block_params)

    @property
    def num_params(self):
        """Parameter elements of the one-process model (Model.num_params)."""
        return self.first_params + sum(self.block_params) + self.head_params

    def layout_facts(self):
        return self.facts


_FIRST_UNIT = (Embedding, PositionalEmbedding, PatchEmbedding, ClassToken, LayerNorm, Linear)
_HEADS = (LMHead, ClassificationHead, ClassTokenHead)


def _sizes(leaves):
    """(own, tied) parameter elements of `leaves`."""
    decls = [d for m in leaves for d in m.param_specs()]
    return (sum(math.prod(d.shape) for d in decls if d.tied_to is None),
            sum(math.prod(d.shape) for d in decls if d.tied_to is not None))


def _vocab_split(leaves):
    return any(d.split == "vocab" for m in leaves for d in m.param_specs())


def _costs_of_units(modules, seq_len, name, facts):
    """ModelCosts of a Model's unit modules (first, blocks, head). Raises ConfigError."""
    if len(modules) < 3:
        raise ConfigError(f"the planner needs a first unit, at least one block and a head; "
                          f"{name} has {len(modules)} unit(s)")
    first, body, head = _leaves(modules[0]), modules[1:-1], _leaves(modules[-1])
    for k, m in enumerate(body, 1):
        if not isinstance(m, TransformerBlock):
            raise ConfigError(f"the planner's cost model knows TransformerBlock body units; unit {k} "
                              f"of {name} is a {type(m).__name__}")
    widths = {(m.param_specs()[0].shape[0], m.n_head) for m in body}
    if len(widths) > 1:
        raise ConfigError(f"the planner's cost model needs blocks of one width and head count; "
                          f"{name} has (n_embd, n_head) {sorted(widths)}")
    (C, H), = widths
    odd = [type(m).__name__ for m in first if not isinstance(m, _FIRST_UNIT)]
    odd += [type(m).__name__ for m in head[:-1] if not isinstance(m, LayerNorm)]
    if not isinstance(head[-1], _HEADS):
        odd.append(f"{type(head[-1]).__name__} (head)")
    if odd:
        raise ConfigError(f"the planner's cost model has no cost for {', '.join(odd)} in {name}: "
                          f"first unit of {', '.join(t.__name__ for t in _FIRST_UNIT)}, head of "
                          f"LayerNorm and one of {', '.join(t.__name__ for t in _HEADS)}")
    loss = head[-1]
    lm = isinstance(loss, LMHead)
    width = loss.param_specs()[0].shape[0 if lm else 1]
    positions = seq_len - sum(isinstance(m, ClassToken) for m in first)
    flops = sum(2 * math.prod(m.param_specs()[0].shape) * positions for m in first
                if isinstance(m, (PatchEmbedding, Linear)))
    first_own, _ = _sizes(first)
    head_own, head_tied = _sizes(head)
    return ModelCosts(name, seq_len, C, H, first_own, tuple(_sizes([m])[0] for m in body), head_own,
                      head_tied, width, lm, _vocab_split(first), _vocab_split(head), float(flops),
                      facts)


def model_costs(model, seq_len=None):
    """The ModelCosts of `model`: a ModelCosts; a GPTConfig or ViTConfig (or a model holding one
    as `.cfg`); an rtxmpi.nn Model of the shipped modules, or its list of units. seq_len: the
    positions per sample (default: the config's, else the first unit's PositionalEmbedding
    max_len). Pure. Raises ConfigError for a model the cost model cannot read (a body unit that
    is not a TransformerBlock, a module it has no cost for, no sequence length)."""
    if isinstance(model, ModelCosts):
        return model
    cfg = getattr(model, "cfg", model)
    if isinstance(cfg, (GPTConfig, ViTConfig)):
        gpt = isinstance(cfg, GPTConfig)
        units = gpt_units(cfg) if gpt else vit_units(cfg)
        return _costs_of_units([u[1] if isinstance(u, tuple) else u for u in units], cfg.seq_len,
                               "GPT" if gpt else "ViT", model_facts(cfg))
    if isinstance(model, Model):
        modules = list(model.modules)
    elif isinstance(model, (list, tuple)):
        modules = [u[1] if isinstance(u, tuple) else u for u in model]
    else:
        raise ConfigError(f"cannot plan a {type(model).__name__}: pass a GPTConfig, a ViTConfig, an "
                          "rtxmpi.nn Model of the shipped modules or its units")
    if seq_len is None:
        pos = [m for m in _leaves(modules[0]) if isinstance(m, PositionalEmbedding)] if modules else []
        if not pos:
            raise ConfigError("the model has no PositionalEmbedding to read its sequence length "
                              "from: pass seq_len")
        seq_len = pos[0].decl.shape[0]
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ConfigError(f"seq_len must be an integer >= 1, got {seq_len!r}")
    facts = replace(model_facts(modules), seq_len=seq_len)
    return _costs_of_units(modules, seq_len, "the model", facts)


def calibration_config(model):
    """The GPTConfig `calibrate` measures for `model` (anything model_costs takes): a GPT's own,
    else a GPT with the same blocks (n_layer, n_head, n_embd, seq_len) and the head's width as its
    vocabulary, whose kernel rates and reference run stand for the model's (the profile format
    holds a GPT reference). Raises ConfigError as model_costs does."""
    cfg = getattr(model, "cfg", model)
    if isinstance(cfg, GPTConfig):
        return cfg
    c = model_costs(model)
    return GPTConfig(vocab_size=c.head_width, seq_len=c.seq_len, n_layer=c.n_layer,
                     n_head=c.n_head, n_embd=c.n_embd)


# ------------------------------------------------------------------------------ cost model
def _stage_params(c, pp):
    """Parameters held by each stage (the first unit on the first, the head and its tied copy on
    the last when pp > 1, as rtxmpi.parallel.pipeline.stage_units does) and each stage's block
    count. c: ModelCosts."""
    costs = list(c.block_params)
    costs[0] += c.first_params
    costs[-1] += c.head_params + (c.head_tied if pp > 1 else 0)
    bounds = partition(costs, pp)
    params = [sum(costs[a:b]) for a, b in bounds]
    return params, [b - a for a, b in bounds]


def _micro_batch(global_batch, L):
    """Samples in the largest micro-batch of the busiest rank, which paces the step: rank 0's
    first micro-batch under rtxmpi.data.micro_batch_split (global_batch / dp / micro_batches
    when even). Raises ConfigError for a split the runtime refuses (check_layout first)."""
    return micro_batch_split(global_batch, L.dp, L.micro_batches)[0][0]


class _Costs:
    """Per-micro-batch costs of one layout: compute work (alone-seconds) and communication
    (wall seconds) per stage for forward and backward."""

    def __init__(self, c, L, global_batch, profile, ranks_per_node, factor=1.0, hop_s=None):
        c = model_costs(c)
        p, C, H, V, T = profile, c.n_embd, c.n_head, c.head_width, c.seq_len
        b = _micro_batch(global_batch, L)
        n = b * T / L.sp
        h = H / (L.tp * L.sp)
        hs = C / H
        S = b * h * T * T
        tp, sp = L.tp, L.sp
        # compute per block: forward share of the element-wise work taken as 0.4 (the backward
        # passes are about 1.5x the forward ones in rtxmpi.nn.layers)
        dense = 24 * n * C * C / tp / p.dense_flops
        attn = 4 * S * hs / p.attn_flops
        elem_f = S * p.score_fwd_ns * 1e-9 + 0.4 * (4 * n * C / tp * p.gelu_ns + 2 * n * C * p.ln_ns) * 1e-9
        elem_b = S * p.score_bwd_ns * 1e-9 + 0.6 * (4 * n * C / tp * p.gelu_ns + 2 * n * C * p.ln_ns) * 1e-9
        call = p.block_call_us * 1e-6
        self.block_f = dense + attn + elem_f + 0.4 * call
        self.block_b = 2 * (dense + attn) + elem_b + 0.6 * call
        rows, tp_head = _head_rows(c, b, L), (tp if c.head_vocab else 1)
        head_mm = 2 * rows * C * V / tp_head / p.dense_flops
        ce = rows * V / tp_head * 1e-9
        self.head_f = head_mm + ce * p.score_fwd_ns + n * C * p.ln_ns * 0.4e-9
        self.head_b = 2 * head_mm + ce * p.score_bwd_ns + n * C * p.ln_ns * 0.6e-9
        self.head_f, self.head_b = self.head_f + 0.2 * call, self.head_b + 0.3 * call
        self.emb_f = self.emb_b = n * C * p.ln_ns * 0.5e-9 / 2 + 0.1 * call
        if c.first_flops:  # a patch embedding's matmul: backward 2x (input and weight gradient);
            # a unit that needs every position runs whole on each sp rank
            emb = c.first_flops * b / (1 if c.facts.whole_sequence else L.sp) / p.dense_flops
            self.emb_f, self.emb_b = self.emb_f + emb, self.emb_b + 2 * emb
        for name in ("block_f", "block_b", "head_f", "head_b", "emb_f", "emb_b"):
            setattr(self, name, getattr(self, name) * factor)
        # communication per block and micro-batch
        R = ranks_per_node
        act = 4 * n * C  # bytes of one (b, T/sp, C) float32 activation
        tp_inter, sp_inter = tp > R, tp * sp > R
        # each collective: alpha-beta + the wait for the last rank to arrive (sync_time_s)
        sync_tp, sync_sp = p.sync_time_s(tp), p.sync_time_s(sp)
        self.tp_block = 2 * (p.comm_time_s("all_reduce", act, tp, tp_inter) + sync_tp) if tp > 1 else 0.0
        edge = p.comm_time_s("all_reduce", act, tp, tp_inter) + sync_tp if tp > 1 else 0.0
        self.tp_edge_first = edge if c.first_vocab else 0.0  # vocabulary-parallel embedding
        self.tp_edge_head = edge if c.head_vocab else 0.0     # and head
        self.sp_block = (p.comm_time_s("all_to_all", 3 * act / tp, sp, sp_inter)
                         + p.comm_time_s("all_to_all", act / tp, sp, sp_inter)
                         + 2 * sync_sp) if sp > 1 else 0.0
        # a stage boundary's send/recv: alpha-beta + the receiver's wait for the sender (hop_s,
        # default the profile's 2-rank sync wait: each hand-over between stages is one; in the
        # steady state of 1F1B every stage computes, so it is charged whole)
        hop_s = p.sync_time_s(2) if hop_s is None else hop_s
        self.p2p = (p.comm_time_s("send_recv", act, 2, L.dp * tp * sp * L.pp > R)
                    + hop_s) if L.pp > 1 else 0.0
        self.n, self.S, self.b = n, S, b
        self.recompute = L.recompute != "none"


def _head_rows(c, b, L):
    """Rows the head maps for a micro-batch of b samples on a rank: every position of the
    rank's sequence shard (a language model), else one per sample."""
    return b * c.seq_len / L.sp if c.head_per_position else b


def _kernel_seconds(cfg, b, profile):
    c = model_costs(cfg)
    k = _Costs(c, Layout(1, 1, 1, 1), b, profile, 1)
    return c.n_layer * (k.block_f + k.block_b) + k.head_f + k.head_b + k.emb_f + k.emb_b


def model_factor(profile, working_set=None, blocks=None):
    """How much slower the real model runs than its kernels on warm buffers (fresh allocations,
    cache misses, Python between calls): profile.ref_ms / the kernel-sum prediction of the same
    reference run. With profile.ref_small (the run at a quarter of the micro-batch) and a
    `working_set` (activation bytes per block and micro-batch, activation_bytes), the factor is
    interpolated log-linearly between the two runs' working sets and held constant beyond them.
    With profile.ref_block (the model with one block) and `blocks` (the most blocks a rank's
    stage holds), it is scaled log-linearly in blocks between the one-block run's factor (at 1)
    and the whole model's (at the reference's n_layer). Clamped to [0.5, 10]."""
    ref = dict(profile.ref_model)
    b = int(ref.pop("micro_batch"))
    cfg = GPTConfig(**ref)
    big = profile.ref_ms * 1e-3 / _kernel_seconds(cfg, b, profile)
    scale = 1.0
    one_info = profile.ref_block or {}
    if blocks is not None and one_info.get("ms_ratio") and cfg.n_layer > 1:
        one_cfg = GPTConfig(**{**ref, "n_layer": 1})
        one = profile.ref_ms * 1e-3 * float(one_info["ms_ratio"]) / _kernel_seconds(one_cfg, b, profile)
        t = min(1.0, max(0.0, math.log(max(blocks, 1)) / math.log(cfg.n_layer)))
        scale = math.exp(math.log(max(one / big, 1e-9)) * (1 - t))
    small_info = profile.ref_small or {}
    if working_set is None or not small_info.get("micro_batch"):
        return min(10.0, max(0.5, big * scale))
    bs = int(small_info["micro_batch"])
    small = (profile.ref_ms * 1e-3 * float(small_info["ms_ratio"])
             / _kernel_seconds(cfg, bs, profile))
    ref_costs = model_costs(cfg)
    x_big = activation_bytes(ref_costs, Layout(1, 1, 1, 1, 1), b)[0]
    x_small = activation_bytes(ref_costs, Layout(1, 1, 1, 1, 1), bs)[0]
    if x_big <= x_small:
        return min(10.0, max(0.5, big))
    t = (math.log(max(working_set, 1.0)) - math.log(x_small)) / (math.log(x_big) - math.log(x_small))
    t = min(1.0, max(0.0, t))
    factor = math.exp(math.log(max(small, 1e-9)) * (1 - t) + math.log(max(big, 1e-9)) * t)
    return min(10.0, max(0.5, factor * scale))


def _stage_tasks(costs, blocks, stage, stages):
    """(forward work, forward comm, backward work, backward comm) of one micro-batch on a stage."""
    c = costs
    fw = blocks * c.block_f
    bw = blocks * (c.block_b + c.block_f * c.recompute)  # a recomputed block's forward reruns
    fc = blocks * (c.tp_block + c.sp_block)
    bc = blocks * (c.tp_block + c.sp_block) * (1 + c.recompute)
    if stage == 0:
        fw, bw = fw + c.emb_f, bw + c.emb_b
        fc += c.tp_edge_first
    if stage == stages - 1:
        fw, bw = fw + c.head_f, bw + c.head_b
        bc += c.tp_edge_head
    return fw, fc, bw, bc


def simulate_pipeline(tasks, schedule, micro_batches, p2p_s, speed):
    """Event simulation of one step of a pipeline schedule with processor sharing.

    tasks: per stage (forward work, forward comm, backward work, backward comm), work in
    alone-seconds (scaled by speed), comm in seconds (not). schedule: "gpipe", "1f1b" or "none"
    (one stage). p2p_s: seconds from a send to its receive. speed(k): the speed of each of k
    stages computing at once (1.0 = alone). Returns (pipeline seconds, busy seconds per stage).
    """
    p = len(tasks)
    lists = build_schedule("gpipe" if schedule == "none" else schedule, micro_batches, p)
    pos = [0] * p
    ready = {}  # (kind, micro_batch, dst stage) -> time the message can be received
    state = [None] * p  # None or [phase, remaining] with phase "work" / "comm"
    busy = [0.0] * p
    now = 0.0
    done = [False] * p
    for _ in range(100 * (len(lists[0]) + 1) * p + 1000):
        # start what can start
        for s in range(p):
            while state[s] is None and pos[s] < len(lists[s]):
                op = lists[s][pos[s]]
                if op.kind in ("F", "B"):
                    fw, fc, bw, bc = tasks[s]
                    work, comm = (fw, fc) if op.kind == "F" else (bw, bc)
                    state[s] = ["work", work, comm]
                elif op.kind.startswith("send"):
                    ready[(op.kind[5:], op.micro_batch, op.peer)] = now + p2p_s
                    pos[s] += 1
                else:
                    t = ready.get((op.kind[5:], op.micro_batch, s))
                    if t is None or t > now + 1e-15:
                        break
                    pos[s] += 1
            if state[s] is None and pos[s] >= len(lists[s]):
                done[s] = True
        if all(done):
            return now, busy
        computing = [s for s in range(p) if state[s] is not None and state[s][0] == "work"]
        v = speed(len(computing)) if computing else 1.0
        # next event
        dt = math.inf
        for s in range(p):
            if state[s] is not None:
                dt = min(dt, state[s][1] / v if state[s][0] == "work" else state[s][1])
            elif pos[s] < len(lists[s]):
                op = lists[s][pos[s]]
                t = ready.get((op.kind[5:], op.micro_batch, s))
                if t is not None:
                    dt = min(dt, t - now)
        if dt == math.inf:
            raise ConfigError("pipeline simulation deadlocked (schedule bug)")
        dt = max(dt, 0.0)
        now += dt
        for s in range(p):
            st = state[s]
            if st is None:
                continue
            busy[s] += dt
            st[1] -= dt * v if st[0] == "work" else dt
            if st[1] <= 1e-15:
                if st[0] == "work" and st[2] > 0:
                    state[s] = ["comm", st[2], 0.0]
                else:
                    state[s] = None
                    pos[s] += 1
    raise ConfigError("pipeline simulation did not finish (schedule bug)")


def activation_bytes(model, layout, global_batch):
    """Bytes of activations one micro-batch keeps per block and for the head (see the module
    docstring): (per block, head) on one rank. Under recompute a block keeps only its input
    (4 n C) and rebuilds the rest in backward; that is not this function's (memory_breakdown).
    model: anything model_costs takes."""
    c, L = model_costs(model), layout
    b = _micro_batch(global_batch, L)
    n = b * c.seq_len / L.sp
    S = b * c.n_head / (L.tp * L.sp) * c.seq_len * c.seq_len
    C = c.n_embd
    head = 8 * _head_rows(c, b, L) * c.head_width / (L.tp if c.head_vocab else 1)
    mlp = 13 if fused.enabled() else 17  # the references' GELU keeps tanh(.) beside its input
    return 4 * (4 * n * C + mlp * n * C / L.tp + S), head


def _block_input_bytes(c, layout, global_batch):
    """Bytes of one block's (b, T / sp, C) float32 input for one micro-batch: what a recomputed
    block keeps."""
    return 4 * _micro_batch(global_batch, layout) * c.seq_len / layout.sp * c.n_embd


def _sharing(profile, R, ranks_per_stage):
    """speed(k): speed of each rank while k stages (k * ranks_per_stage ranks of a node of R)
    compute and the rest wait: min(1, C / (n + w (R - n))), the profile's fitted
    processor-sharing model (calibrate.fit_sharing). On a "cpu"-clock profile (the rates are CPU
    time, the work at a whole core's speed) that is the speed itself; on a "wall"-clock one
    (older profiles, the default) relative to n = 1, the condition its rates were timed in."""
    C, w = profile.effective_cores, profile.wait_weight
    R_prof = profile.ranks_per_node

    def raw(n, total):
        return min(1.0, C / max(1e-9, n + w * (total - n)))

    base = 1.0 if profile.clock == "cpu" else raw(1, R_prof)

    def speed(k):
        return raw(k * ranks_per_stage, R) / base
    return speed


def _units(c, stage, stages, blocks):
    """Parameter counts of the ZeRO-3 units one stage gathers (the Model's unit hooks: the first
    unit, each block, the head; a tied table is gathered with the head). The blocks are taken
    as alike (the cost model's blocks have one width)."""
    units = [c.block_params[0]] * blocks
    if stage == 0:
        units.append(c.first_params)
    if stage == stages - 1:
        units.append(c.head_params + c.head_tied)
    return units


def memory_breakdown(model, layout, global_batch, device="cpu"):
    """Peak bytes per rank of each pipeline stage, float32, of `model` (anything model_costs
    takes): a list (one per stage) of dicts
    {"params", "grads", "optimizer", "activations", "transient", "total"}.

    ZeRO shards over the ranks holding the same parameters, W = dp * sp (the gradient averaging
    group, rtxmpi.mesh loss_group), as ZeroDataParallel.memory_bytes counts it (docs/zero.md);
    P = the stage's parameters / tp:
      stage 0    params 4P, grads 4P, AdamW 16P (m, v, decay mask, scratch)
      stage 1-2  params 4P, grads 4P (backward writes the full buffer), AdamW 16P / W; at the
                 step the all_gather result, 4P, is transient; when W does not divide P, shards
                 are ceil(P / W) and a short one keeps a send buffer (zero.zero_state_bytes,
                 the runtime's own accounting, gives params, grads and AdamW at every stage)
      stage 3    params, grads and AdamW / W; transient while forward / backward run: two gathered
                 units (the one in use and the prefetched one) and two unit gradient buffers;
                 with pp > 1 per stage (its own units and shard: PipelineParallel.memory_bytes)
      offload "cpu": a master copy of the shard (4P / W) and a host copy of its gradient
                 (4P / W); on device "cpu" (numpy) they are in the same memory, so they add to
                 it; on "cuda" they, and AdamW, are host memory and the device holds only params
                 and grads
      offload "nvme": master parameters, m and v in files; in memory the host gradient copy
                 (4P / W) and the store's bound, min(chunks, 3) chunks of the three tensors plus
                 the chunk-sized AdamW scratch and mask (rtxmpi.parallel.offload defaults), all
                 host memory (none of it on a "cuda" device)
    activations: per block and micro-batch (activation_bytes), times the micro-batches in flight
    (1 without a pipeline: accumulation frees each cache; GPipe m; 1F1B min(m, pp - stage));
    with recompute "blocks", each block's input instead, plus one block's activations (the one
    backward rebuilds at a time).
    total = params + grads + optimizer + max(activations + transient during backward, the
    step's transient)."""
    from .offload import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_CHUNKS
    from .zero import zero_state_bytes

    cfg, L = model_costs(model), layout
    stage_params, stage_blocks = _stage_params(cfg, L.pp)
    per_block, head_act = activation_bytes(cfg, L, global_batch)
    W, z, host = L.dp * L.sp, L.zero_stage, device == "cpu"
    out = []
    for s in range(L.pp):
        P = stage_params[s] / L.tp
        shard = P / W if z else P
        biggest = max(_units(cfg, s, L.pp, stage_blocks[s])) / L.tp
        # params, grads and AdamW as the runtime counts them (ZeroDataParallel.memory_bytes);
        # cpu offload's host copies only where they share the device's memory
        state = zero_state_bytes(math.ceil(P), W, z, itemsize=4,
                                 offload="cpu" if L.offload == "cpu" and host and z else None,
                                 unit_numel=math.ceil(biggest))
        params, grads, optimizer = state["params"], state["grads"], state["optimizer"]
        transient_fb = transient_step = 0.0
        if z in (1, 2):
            transient_step = 4 * P
        if z == 3:  # the gathered units, and as many unit gradient buffers
            transient_fb = state["transient"] + 2 * 4 * biggest
        if L.offload == "cpu" and not host:
            optimizer = 0.0
        elif L.offload == "nvme":
            chunk = DEFAULT_CHUNK_BYTES / 4
            chunks = max(1, math.ceil(shard / chunk))
            elems = min(chunk, shard)
            optimizer = 4 * elems * (3 * min(DEFAULT_MAX_CHUNKS, chunks) + 2) if host else 0.0
            if host:
                grads += 4 * chunks * chunk  # the host gradient copy, padded to whole chunks
        in_flight = (L.micro_batches if L.schedule == "gpipe"
                     else min(L.micro_batches, L.pp - s))
        if L.pp == 1:
            in_flight = 1
        kept = _block_input_bytes(cfg, L, global_batch) if L.recompute != "none" else per_block
        act = in_flight * (stage_blocks[s] * kept + (head_act if s == L.pp - 1 else 0))
        act += per_block if L.recompute != "none" else 0
        total = params + grads + optimizer + max(act + transient_fb, transient_step)
        out.append({"params": int(params), "grads": int(grads), "optimizer": int(optimizer),
                    "activations": int(act), "transient": int(max(transient_fb, transient_step)),
                    "total": int(total)})
    return out


def _data_parallel_seconds(cfg, L, P, profile, inter, units_per_stage=None):
    """Exposed seconds per step of the gradient reduction and ZeRO traffic over the ranks with
    the same parameters (W = dp * sp), P parameters per rank (busiest stage / tp), and of the
    optimizer's offload copies (docs/zero.md, "Communication per step"):
      stage 0   all_reduce of the gradient (after the last micro-batch)
      stage 1   the same all_reduce, then an all_gather of the updated parameters
      stage 2   reduce_scatter of the gradient, all_gather of the parameters
      stage 3   per micro-batch: every unit gathered in forward and again in backward (the bytes
                of an all_gather of the stage, a collective per unit) and the unit gradients
                reduce_scattered (every backward, also under no_sync); no all_gather at the step
    Every blocking collective also pays the measured sync wait. Offload copies: "cpu" the
    gradient shard to the host and the master back (2 copies of the shard), "nvme" also reads
    and writes master, m and v through the files (8 copies), at profile.copy_ns per element."""
    p, W, z = profile, L.dp * L.sp, L.zero_stage
    units_per_stage = units_per_stage or len(_units(cfg, 0, 1, cfg.n_layer))
    if W <= 1:
        return 0.0, 0.0
    sync = p.sync_time_s(W)
    grad = 4 * P
    if z == 0:
        dp_s = p.comm_time_s("all_reduce", grad, W, inter) + sync
    elif z == 1:
        dp_s = (p.comm_time_s("all_reduce", grad, W, inter)
                + p.comm_time_s("all_gather", grad, W, inter) + 2 * sync)
    elif z == 2:
        dp_s = (p.comm_time_s("reduce_scatter", grad, W, inter)
                + p.comm_time_s("all_gather", grad, W, inter) + 2 * sync)
    else:
        units = units_per_stage
        alpha = p.comm_time_s("all_gather", 1, W, inter)
        gather = p.comm_time_s("all_gather", grad, W, inter) + (units - 1) * alpha + units * sync
        reduce = p.comm_time_s("reduce_scatter", grad, W, inter) + (units - 1) * alpha
        dp_s = L.micro_batches * (2 * gather + reduce)
    copies = {"none": 0, "cpu": 2, "nvme": 8}[L.offload]
    offload_s = copies * (P / W) * p.copy_ns * 1e-9
    return dp_s, offload_s


def estimate(model, layout, global_batch, profile, ranks_per_node=None, device="cpu"):
    """Predicted Estimate of one valid layout (check_layout first). Local (pure).

    model: anything model_costs takes (a GPTConfig, a ViTConfig, a Model, a ModelCosts);
    global_batch: samples per step; profile: HardwareProfile; ranks_per_node:
    default profile.ranks_per_node capped at the world size; device: "cpu" (numpy: host memory
    is the device's) or "cuda" (offload moves state off the device), for memory_breakdown."""
    cfg, L, p = model_costs(model), layout, profile
    world = L.dp * L.tp * L.pp * L.sp
    R = min(world, ranks_per_node or p.ranks_per_node)
    stage_params, stage_blocks = _stage_params(cfg, L.pp)
    factor = model_factor(p, activation_bytes(cfg, L, global_batch)[0], max(stage_blocks))
    costs = _Costs(cfg, L, global_batch, p, R, factor)
    tasks = [_stage_tasks(costs, stage_blocks[s], s, L.pp) for s in range(L.pp)]
    ranks_per_stage_on_node = R / L.pp  # the stages' ranks spread evenly over the nodes
    speed = _sharing(p, R, ranks_per_stage_on_node)

    pipe_s, busy = simulate_pipeline(tasks, L.schedule, L.micro_batches, costs.p2p, speed)
    share = 1.0
    if L.pp > 1 and (L.tp > 1 or L.sp > 1) and p.sync_s:
        # the tp/sp sync wait inside the stages, measured with every rank of the node busy,
        # comes from ranks outnumbering cores: a pipeline keeps only R (1 - bubble) ranks busy
        # on average, so it is charged in proportion to the oversubscription left (the
        # hand-overs between stages keep the whole wait: _Costs.p2p)
        C = p.effective_cores
        busy_ranks = R * sum(busy) / (L.pp * pipe_s) if pipe_s > 0 else R
        share = min(1.0, max(0.0, (busy_ranks - C) / (R - C))) if R > C else 1.0
        if share < 1.0:
            scaled = copy.copy(p)
            scaled.sync_s = {n: v * share for n, v in p.sync_s.items()}
            costs = _Costs(cfg, L, global_batch, scaled, R, factor, p.sync_time_s(2))
            tasks = [_stage_tasks(costs, stage_blocks[s], s, L.pp) for s in range(L.pp)]
            pipe_s, busy = simulate_pipeline(tasks, L.schedule, L.micro_batches, costs.p2p,
                                             speed)
    all_speed = speed(L.pp)
    # compute alone: the same work at the busy-all speed, for the compute column
    compute_s = max(L.micro_batches * (t[0] + t[2]) for t in tasks) / all_speed
    comm_pipe_s = max(L.micro_batches * (t[1] + t[3]) for t in tasks)
    # data-parallel gradient reduction and ZeRO traffic over dp * sp, optimizer, small collectives
    P = max(stage_params) / L.tp
    dp_inter = world > R and L.dp * L.sp * L.tp > R
    units = max(len(_units(cfg, s, L.pp, stage_blocks[s])) for s in range(L.pp))
    dp_s, offload_s = _data_parallel_seconds(cfg, L, P, p, dp_inter, units)
    shard = P / (L.dp * L.sp) if L.zero_stage else P
    opt_s = (shard * p.adam_ns * 1e-9 + offload_s) / all_speed
    small_s = STEP_OVERHEAD_ALL_REDUCES * p.comm_time_s("all_reduce", 8, world, world > R)
    small_s += p.sync_time_s(world)  # the first small reduction waits for the slowest rank
    total_s = pipe_s + dp_s + opt_s + small_s
    ideal = compute_s + comm_pipe_s
    bubble = max(0.0, 1.0 - sum(busy) / (L.pp * pipe_s)) if L.pp > 1 and pipe_s > 0 else 0.0
    memory = max(memory_breakdown(cfg, L, global_batch, device), key=lambda m: m["total"])
    comm_ms = (comm_pipe_s + dp_s + small_s) * 1e3
    detail = {"pipeline_ms": pipe_s * 1e3, "bubble_ms": max(0.0, pipe_s - ideal) * 1e3,
              "dp_ms": dp_s * 1e3, "optimizer_ms": opt_s * 1e3, "tp_sp_pp_ms": comm_pipe_s * 1e3,
              "speed_all_busy": all_speed, "sync_share": share, "memory": memory}
    return Estimate(L, compute_s * 1e3 + opt_s * 1e3, comm_ms, bubble, memory["total"],
                    total_s * 1e3, detail)


def make_plan(cfg, global_batch, world_size, profile, ranks_per_node=None, mem_per_device=None,
              max_micro_batches=32, zero_stages=ZERO_STAGES, schedules=PLANNED_SCHEDULES,
              supported=None, layouts=None, offloads=("none",), device="cpu",
              recompute="none"):
    """Enumerate, check, estimate and rank. Local (pure); every rank gets the same Plan.

    cfg: the model, anything model_costs takes (a GPTConfig: seq_len is the sequence length; a
    ViTConfig; an rtxmpi.nn Model of the shipped modules; a ModelCosts); global_batch: samples
    per step;
    world_size: ranks; profile: HardwareProfile; ranks_per_node: default min(world_size,
    profile.ranks_per_node); mem_per_device: bytes per rank (None: unlimited); offloads: the
    ZeRO offload modes to consider (subset of OFFLOADS; "nvme" only when the job has an
    --offload-dir); device: "cpu" or "cuda" (memory_breakdown); layouts: an explicit candidate
    list instead of enumerate_layouts (e.g. the benchmark's); recompute: the job's activation
    recomputation, set on every enumerated candidate ("blocks" leaves data parallelism only).
    Returns Plan (ranked by predicted total time, ties broken by lower memory, then fewer
    micro-batches, then lower ZeRO stage). Raises ConfigError on bad inputs.
    """
    costs = model_costs(cfg)
    for name, value in (("global_batch", global_batch), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    if ranks_per_node is not None and (not isinstance(ranks_per_node, int) or ranks_per_node < 1):
        raise ConfigError(f"ranks_per_node must be an integer >= 1, got {ranks_per_node!r}")
    if mem_per_device is not None and not mem_per_device > 0:
        raise ConfigError(f"mem_per_device must be > 0 bytes, got {mem_per_device!r}")
    if not offloads or set(offloads) - set(OFFLOADS):
        raise ConfigError(f"offloads must be a non-empty subset of {OFFLOADS}, got {offloads!r}")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if recompute not in RECOMPUTE:
        raise ConfigError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    R = min(world_size, ranks_per_node or profile.ranks_per_node)
    candidates = layouts if layouts is not None else [
        replace(L, recompute=recompute) for L in enumerate_layouts(
            world_size, global_batch, max_micro_batches, zero_stages, schedules, offloads)]
    ranked, rejected = [], []
    for L in candidates:
        why = check_layout(costs, L, global_batch, world_size, supported)
        if why:
            rejected.append((L, why))
            continue
        e = estimate(costs, L, global_batch, profile, R, device)
        if mem_per_device is not None and e.peak_bytes > mem_per_device:
            rejected.append((L, f"memory: peak {_fmt_bytes(e.peak_bytes)} > "
                                f"{_fmt_bytes(mem_per_device)} per device"))
            continue
        ranked.append(e)
    ranked.sort(key=lambda e: e.total_ms)
    near = sum(e.total_ms <= ranked[0].total_ms * (1 + TIE_BAND) for e in ranked) if ranked else 0
    ranked[:near] = sorted(ranked[:near], key=lambda e: (  # e.g. 1F1B before GPipe at equal time
        e.peak_bytes, e.layout.micro_batches, e.layout.zero_stage, OFFLOADS.index(e.layout.offload),
        e.total_ms))
    inputs = {"model": cfg, "global_batch": global_batch, "world_size": world_size,
              "ranks_per_node": R, "mem_per_device": mem_per_device, "device": device,
              "offloads": tuple(offloads)}
    return Plan(ranked, rejected, profile, inputs)


# --------------------------------------------------------------------------- `rtxmpi plan`
def node_memory_per_rank(comm):
    """This node's physical memory (bytes) over the ranks of `comm` on it, or None where the
    system does not say. Collective over `comm` (a shared-memory split)."""
    import os

    _, ranks, _ = node_ranks(comm)
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // ranks
    except (ValueError, OSError, AttributeError):
        return None


def parse_bytes(text):
    """'16G' -> 17179869184, '512M', '2GiB', '1000' (bytes; binary units). ConfigError if bad."""
    import re

    units = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20,
             "MIB": 2**20, "G": 2**30, "GB": 2**30, "GIB": 2**30, "T": 2**40, "TB": 2**40,
             "TIB": 2**40}
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).upper() not in units or not float(match.group(1)) > 0:
        raise ConfigError(f"not a memory size: {text!r} (examples: 512M, 16G, 80GiB)")
    return int(float(match.group(1)) * units[match.group(2).upper()])


def add_arguments(parser):
    """The `rtxmpi plan` flags (rtxmpi/cli.py)."""
    from ..nn.gpt import MODEL_SIZES
    from ..nn.vit import VIT_SIZES

    parser.add_argument("--model-kind", default="gpt", choices=("gpt", "vit"),
                        help="the model: the GPT (--model, --seq-len) or the ViT (--vit-size, "
                             "--patch; examples/train_vit.py's digits images)")
    parser.add_argument("--model", default="small", choices=sorted(MODEL_SIZES), help="GPT size")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence (GPT; default 128)")
    for flag, what in (("--n-layer", "blocks"), ("--n-head", "attention heads"),
                       ("--n-embd", "width (hidden size)"), ("--vocab-size", "vocabulary")):
        parser.add_argument(flag, type=int, default=None,
                            help=f"GPT {what}, overriding --model's")
    parser.add_argument("--vit-size", default="small", choices=list(VIT_SIZES), help="ViT size")
    parser.add_argument("--patch", type=int, default=None,
                        help="ViT patch side in pixels (default 2; 8 must divide)")
    parser.add_argument("--global-batch", type=int, default=32,
                        help="samples per step (sequences, images)")
    parser.add_argument("--world-size", "--devices", dest="world_size", type=int, default=None,
                        help="ranks (default: the MPI world size when launched with mpiexec)")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="ranks per node (default: the profile's, at most the world size)")
    parser.add_argument("--mem-per-device", default=None, metavar="SIZE",
                        help="memory per rank, e.g. 16G (default: unlimited)")
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="hardware profile: a CPU profile JSON from --save-profile, or a "
                             "cluster profile (a file, or a shipped one: dgx-a100, dgx-h100, "
                             "dgx-h200, ci-cpu; docs/planner.md) (default: the built-in CPU "
                             "default profile, labelled as such)")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure the hardware profile now (collective: run under mpiexec "
                             "with the ranks to plan for; 5-15 s)")
    parser.add_argument("--save-profile", default=None, metavar="FILE",
                        help="write the measured profile (with --calibrate)")
    parser.add_argument("--top", type=int, default=10, metavar="K", help="rows of the table")
    parser.add_argument("--show-rejected", action="store_true",
                        help="list every rejected candidate with its reason")
    parser.add_argument("--max-micro-batches", type=int, default=None,
                        help="largest micro-batch count considered (default 32; with a cluster "
                             "profile up to the batch)")
    parser.add_argument("--dtype", default=None, choices=("fp32", "tf32", "bf16", "fp16", "fp8"),
                        help="compute dtype (cluster profile; default the profile's)")
    parser.add_argument("--recompute", default="none,selective,full", metavar="POLICIES",
                        help="activation recomputation policies to consider (cluster profile), "
                             "comma-separated from none, selective, full")
    parser.add_argument("--flash-attention", action="store_true",
                        help="cluster profile: attention never materializes the s x s scores")
    parser.add_argument("--no-overlap", action="store_true",
                        help="cluster profile: the data-parallel reduction does not overlap "
                             "backward (Megatron-LM 2021)")
    parser.add_argument("--offload", default="none", metavar="MODES",
                        help="ZeRO offload modes to consider, comma-separated from none, cpu, "
                             "nvme (default none; a job's automatic plan adds nvme when it "
                             "has an offload directory, cpu on cuda)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the model computes: with cuda, offloaded state leaves the "
                             "device's memory")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="also write the ranked estimates and rejections as JSON")


def _progress_on_rank_0(group):
    """calibrate's progress lines, printed by rank 0 to stderr (stdout keeps the plan)."""
    return lambda line: print(line, file=sys.stderr, flush=True) if group.rank == 0 else None


def load_or_calibrate(args, group=None, cfg=None):
    """The HardwareProfile for `args` (--profile FILE, --calibrate, or the default). With
    --calibrate: collective over `group` (default: rtxmpi.init())."""
    from .calibrate import default_profile

    if args.calibrate and args.profile:
        raise ConfigError("--calibrate measures a new profile; --profile reads one: use one of them")
    if args.save_profile and not args.calibrate:
        raise ConfigError("--save-profile needs --calibrate")
    if args.profile:
        return HardwareProfile.load(args.profile)
    if args.calibrate:
        from ..comm import init
        from .calibrate import calibrate

        group = group or init()
        profile = calibrate(group, cfg=cfg, progress=_progress_on_rank_0(group))
        if args.save_profile and group.rank == 0:
            profile.save(args.save_profile)
        return profile
    return default_profile()


def _plan_json(plan):
    rows = [{"layout": vars(e.layout), "compute_ms": e.compute_ms, "comm_ms": e.comm_ms,
             "bubble": e.bubble, "peak_bytes": e.peak_bytes, "total_ms": e.total_ms,
             "detail": e.detail} for e in plan.ranked]
    return {"inputs": {k: (str(v) if k == "model" else v) for k, v in plan.inputs.items()},
            "profile": plan.profile.source, "ranked": rows,
            "rejected": [{"layout": vars(L), "reason": why} for L, why in plan.rejected],
            "reason": plan.reason()}


def _cli_model(args):
    """(config, description) of the `rtxmpi plan` flags. Raises ConfigError for a flag of the
    other model kind."""
    from ..nn.vit import ViTConfig

    if args.model_kind == "vit":
        gpt_only = [f"--{k.replace('_', '-')}" for k in ("n_layer", "n_head", "n_embd", "vocab_size")
                    if getattr(args, k) is not None]
        if gpt_only:
            raise ConfigError(f"{', '.join(gpt_only)}: the GPT's sizes; a ViT's come from --vit-size")
        if args.seq_len is not None:
            raise ConfigError("--seq-len is the GPT's; a ViT's positions are its patches and the "
                              "class token (--patch)")
        cfg = ViTConfig.named(args.vit_size, patch_size=args.patch or 2)
        side, patch = cfg.image_size, cfg.patch_size
        return cfg, f"ViT {args.vit_size}, {side}x{side} images in {patch}x{patch} patches"
    sizes = {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size")
             if getattr(args, k) is not None}
    if args.patch is not None:
        raise ConfigError("--patch is the ViT's: use it with --model-kind vit")
    if {"n_layer", "n_head", "n_embd"} <= set(sizes):
        what = "GPT"
    else:
        what = f"model {args.model}" + (" with " + ", ".join(f"{k} {v}" for k, v in sizes.items())
                                        if sizes else "")
    return GPTConfig.named(args.model, seq_len=args.seq_len or 128, **sizes), what


def main(args):
    """`rtxmpi plan`: print the ranked table and the reason (rank 0). Exit status 0, 1 when no
    layout fits, 2 for bad flags (ConfigError, printed on one line)."""
    import json
    import os
    import sys

    launch = launch_comm()
    rank = launch.Get_rank()
    try:
        for name in ("seq_len", "patch", "global_batch", "top", "max_micro_batches", "n_layer",
                     "n_head", "n_embd", "vocab_size"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        if args.world_size is not None and args.world_size < 1:  # 0 is a bad flag, not "unset"
            raise ConfigError(f"--world-size must be >= 1, got {args.world_size}")
        world_size = launch.Get_size() if args.world_size is None else args.world_size
        if args.world_size is None and world_size == 1:
            raise ConfigError("--world-size is needed outside mpiexec (the ranks to plan for)")
        cfg, what = _cli_model(args)
        from .cluster_profile import is_cluster_profile, load_cluster_profile

        if args.profile and is_cluster_profile(args.profile):
            from .cluster import run_cli

            profile = load_cluster_profile(args.profile)
            return run_cli(args, cfg, what, world_size, profile) if rank == 0 else 0
        if args.profile and not os.path.exists(args.profile):
            from .cluster_profile import shipped_profiles

            raise ConfigError(f"no profile file {args.profile!r} (shipped cluster profiles: "
                              f"{', '.join(shipped_profiles())})")
        cluster_flags = [f for f, given in (("--dtype", args.dtype is not None),
                                            ("--recompute", args.recompute != "none,selective,full"),
                                            ("--no-overlap", args.no_overlap),
                                            ("--flash-attention", args.flash_attention)) if given]
        if cluster_flags:
            raise ConfigError(f"{', '.join(cluster_flags)}: only with a cluster profile "
                              f"(--profile dgx-a100, ...; docs/planner.md)")
        memory = parse_bytes(args.mem_per_device) if args.mem_per_device else None
        profile = load_or_calibrate(args, cfg=calibration_config(cfg))
        offloads = tuple(dict.fromkeys(m.strip() for m in args.offload.split(",") if m.strip()))
        if not offloads or set(offloads) - set(OFFLOADS):
            raise ConfigError(f"--offload {args.offload!r}: comma-separated modes from "
                              f"{', '.join(OFFLOADS)}")
        plan = make_plan(cfg, args.global_batch, world_size, profile,
                         ranks_per_node=args.ranks_per_node, mem_per_device=memory,
                         max_micro_batches=args.max_micro_batches or 32, offloads=offloads,
                         device=args.device)
    except ConfigError as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    if rank != 0:
        return 0 if plan.ranked else 1
    mem = _fmt_bytes(memory) if memory else "unlimited"
    print(f"plan: {what} ({cfg.n_layer} layers, {cfg.n_head} heads, n_embd {cfg.n_embd}), "
          f"global batch {args.global_batch} x {cfg.seq_len} positions, world size "
          f"{world_size}, {plan.inputs['ranks_per_node']} rank"
          f"{'' if plan.inputs['ranks_per_node'] == 1 else 's'} per node, memory {mem} per rank")
    print(f"profile: {profile.source}")
    print()
    print(plan.table(top=args.top, show_rejected=args.show_rejected))
    print()
    print(plan.reason(show_rejected=args.show_rejected))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_plan_json(plan), f, indent=1)
    return 0 if plan.ranked else 1


# ------------------------------------------------------------------------- a job's automatic plan
LAYOUT_FLAGS = ("--dp", "--tp", "--pp", "--sp", "--micro-batches", "--zero-stage", "--schedule",
                "--offload")


def explicit_layout_flags(argv):
    """The layout flags (LAYOUT_FLAGS) given on a command line (`--tp 2` or `--tp=2`)."""
    return [f for f in LAYOUT_FLAGS if any(a == f or a.startswith(f + "=") for a in argv)]


def plan_for_job(group, cfg, global_batch, profile_path=None, mem_per_device=None,
                 offload_dir=None, device="cpu", recompute="none"):
    """`--plan auto`: the fastest layout for this job. Collective: every rank of `group` calls it.

    cfg: the model, anything make_plan takes (a GPTConfig, a ViTConfig, a Model); global_batch:
    samples per step.

    The profile is read from `profile_path` when that file exists, else measured now (calibrate,
    5-15 s) and, with a path, saved there for the next run (rank 0 writes). Rank 0 plans and
    broadcasts the choice, so every rank runs the same layout. mem_per_device: bytes per rank
    (None: the host's physical memory / ranks on it). ZeRO stages 0-3 are considered where the
    runtime supports them; offload "nvme" only with an `offload_dir`, "cpu" only on device
    "cuda" (on numpy it adds host copies to the same memory); recompute: the job's
    (make_plan). Returns (Layout, Plan).
    Raises ConfigError on every rank when the profile is unreadable or no layout fits.
    """
    import os

    from .calibrate import calibrate

    # the group's communicator: after an elastic shrink COMM_WORLD still holds the failed ranks
    comm = group.backend.comm if hasattr(getattr(group, "backend", None), "comm") else launch_comm()
    from .cluster_profile import is_cluster_profile

    if profile_path and is_cluster_profile(profile_path):
        raise ConfigError(f"--plan-profile {profile_path}: a cluster profile, for `rtxmpi plan "
                          f"--profile`; --plan auto reads or measures this machine's CPU profile")
    if profile_path and os.path.exists(profile_path):
        error, profile = None, None
        if group.rank == 0:
            try:
                profile = HardwareProfile.load(profile_path)
            except ConfigError as exc:
                error = str(exc)
        error, data = broadcast_json(group, [error, asdict(profile) if profile else None])
        if error:
            raise ConfigError(error)
        profile = HardwareProfile.from_dict(data, what=profile_path)
    else:
        profile = calibrate(group, cfg=calibration_config(cfg), progress=_progress_on_rank_0(group))
        if profile_path and group.rank == 0:
            profile.save(profile_path)
    if mem_per_device is None:
        mem_per_device = node_memory_per_rank(comm)
    from ..topology import discover, placement_filter

    supported = placement_filter(discover(group))  # collective: tp in NVLink
    choice, plan, error = None, None, None
    if group.rank == 0:
        offloads = ("none",) + (("cpu",) if device == "cuda" else ()) + \
            (("nvme",) if offload_dir else ())
        plan = make_plan(cfg, global_batch, group.world_size, profile,
                         mem_per_device=mem_per_device, supported=supported, offloads=offloads,
                         device=device, recompute=recompute)
        if plan.best is None:
            error = plan.reason()
        else:
            choice = vars(plan.best.layout)
    error, choice = broadcast_json(group, [error, choice])
    if error:
        raise ConfigError(f"--plan auto: {error}")
    return Layout(**choice), plan
