"""Pipeline parallelism: a Model's units (rtxmpi.nn.module: a GPT, a ViT, a Model of one's own
units, or their TensorParallelModel) split into contiguous stages, micro-batches run by a schedule
(GPipe, 1F1B or interleaved 1F1B, rtxmpi.parallel.schedule), activations and their gradients
exchanged with send/recv on the `pp` group. The engine never computes a layer: a stage runs its
units' own forward/backward (Module), the last stage its head's loss_forward/loss_backward.

Source: GPipe (Huang et al., NeurIPS 2019), PipeDream-Flush / 1F1B (Narayanan et al., SC 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"), Megatron-LM's
embedding group for tied input/output embeddings.

Layout. A Model's units are its first unit (a GPT's embeddings), its body units (a GPT's blocks)
and its head. `unit_layout` partitions the body units into pp contiguous non-empty groups, balanced
by `body_costs` (a GPT's: estimated compute, `stage_costs`; any other Model's: the parameter
elements each unit uses), the first unit counted with the first body unit and the head with the
last; or by a given `split` of body units per stage. Stage 0 also runs the first unit, the last
stage the head (`stage_units`). A stage's parameters are therefore one contiguous range
[flat_start, flat_stop) of the model's flat layout, which the stage keeps in its own flat buffers
(1/pp of the memory). A parameter that a unit uses but an earlier stage owns (ParamDecl.tied_to:
a GPT's wte in its tied head) is copied into the using stage, after its range; after each backward
the gradients of the owner and its copies are summed over the ranks that hold them (one group per
such parameter: Megatron's "embedding group" for the GPT, first and last stage), so every copy
receives the same update and stays identical (they start identical: copied from the same model and
broadcast from the owner's rank).

Additions: dp gradient buckets reduced while the stage's last backward runs, ZeRO 1-3 per stage
(pipeline_zero.py), tensor-parallel and Ulysses (sp) stages, the last stage's deferred weight
gradients, per-unit activation recomputation (the Model's `recompute`), and interleaved 1F1B
over virtual stages (ChunkedStage); see docs/pipeline.md.

Step. `train_step(x, y)` splits this rank's batch into micro_batches equal micro-batches and runs
its stage's op list: F/B of a micro-batch, blocking receives, non-blocking sends (completed at the
end of the step). The loss of each micro-batch is scaled by 1/micro_batches, so the gradient is
that of the mean loss over this rank's batch; then tied gradients are summed and all gradients
averaged over the dp group, i.e. over the whole global batch (the one-process gradient). The
returned loss is the global mean, the same on every rank. The shapes of the activations between
stages are found once per batch shape (`_probe_shapes`: each stage runs one micro-batch forward
and sends its output's shape on), so a Model need not declare them.

Checks before anything is sent: the constructor validates the layout and builds and simulates the
whole schedule of every stage (`check_schedule`) on every rank; `train_step` checks the batch
against micro_batches and the model's own input check (a GPT's seq_len and vocab_size, a ViT's
images and labels) on each rank and agrees on the verdict (one 1-byte all_reduce over every rank
of the step), so a bad setting or a bad batch on any one rank raises ConfigError (a ValueError) on
every rank, naming the offending ranks, and nothing is sent.
"""
import math
import time

import numpy as np

from ..backend import to_host
from ..control import raise_if_any_failed
from ..errors import ConfigError
from ..mesh import DeviceMesh
from ..nn.gpt import GPT, GPTConfig
from ..nn.module import Model, run_backward
from ..nn.optim import AdamW, clip_grad_norm, grad_norm_sq
from ..nn.params import bind, decay_mask, layout
from ..observe import trace
from . import tensor as tpl
from .data import DEFAULT_BUCKET_BYTES, BucketReducer, build_buckets
from .layout import Layout, ModelFacts, no_positions
from .layout import auto_micro_batches as layout_auto_micro_batches
from .parallelize import ParallelGPT, TensorParallelModel
from .pipeline_zero import StageZero
from .zero import even_range, optimizer_bytes, read_range
from .schedule import build_schedule, partition, receiving_chunk

_ACT, _GRAD = 0, 1  # message kinds; tag = 2 * micro_batch + kind
_SHAPE_HEADER = 8  # int64s of an activation-shape message: ndim, then the dims, zero-padded


def stage_costs(cfg):
    """Estimated compute of each block, per token of a forward pass (FLOPs; backward is about
    twice that for every piece alike), with the embeddings' added to the first block and the
    head's to the last: block = 24 C^2 (qkv, projection, MLP matmuls) + 4 T C (attention scores
    and their product with V, over the full T x T), embeddings = 2 C (a gather and an add), head =
    2 V C (the output matmul) + 10 V (cross-entropy) + 10 C (ln_f). Measured on this code: the
    small model's head costs 0.14-0.17 of a block, the formula gives 0.15. Local (pure)."""
    C, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.seq_len
    block = 24 * C * C + 4 * T * C
    costs = [float(block)] * L
    costs[0] += 2 * C
    costs[-1] += 2 * V * C + 10 * V + 10 * C
    return costs


def stage_layout(cfg, stages, split=None):
    """Blocks per stage of a GPT with config `cfg` split into `stages` pipeline stages.

    split: None (balanced by estimated compute, `stage_costs`: the embeddings counted with the
    first block, the head and loss with the last; the exact min-max split, `partition`) or a
    sequence of `stages` positive ints (blocks per stage) summing to cfg.n_layer. Returns a list
    of (first_block, stop_block) per stage. Raises ConfigError when stages > n_layer (every stage
    needs a block) or split does not fit. Local (pure).
    """
    return partition(stage_costs(cfg), stages, split)


def _full_specs(model):
    """The one-process flat layout of a Model (a TensorParallelModel's full_specs)."""
    specs = getattr(model, "full_specs", None)
    return specs if specs is not None else layout((p.name, p.shape, p.decay) for p in model.params)


def body_costs(model):
    """Estimated cost of each body unit of a Model (every unit but the first and the last), the
    first unit's cost added to the first body unit and the last's (the head) to the last body
    unit: a GPT's (`cfg` a GPTConfig) are `stage_costs`; any other Model's are the element counts
    of the parameters each unit uses (tied ones included: a tied head multiplies by its table),
    in the one-process shapes. Returns a list of n_units - 2 floats. Local (pure)."""
    cfg = getattr(model, "cfg", None)
    if isinstance(cfg, GPTConfig):
        return stage_costs(cfg)
    specs = _full_specs(model)
    costs = [float(sum(specs[k].size for k in model.unit_params(u)))
             for u in range(len(model.modules))]
    body = costs[1:-1]
    if body:
        body[0] += costs[0]
        body[-1] += costs[-1]
    return body


def unit_layout(model, stages, split=None):
    """How a Model's units are split into `stages` contiguous pipeline stages: a list of (first,
    stop) ranges of body units (every unit but the first and the last; for a GPT its blocks),
    balanced by `body_costs` or given by `split` (body units per stage, see `partition`). Stage 0
    also runs the first unit, the last stage the head: stage s runs units [first + 1, stop + 1),
    widened to 0 and to the end (`stage_units`). Raises ConfigError when stages > the body units
    or split does not fit. Local (pure)."""
    n_body = len(model.modules) - 2
    if stages == 1 and n_body <= 0 and split is None:
        return [(0, max(n_body, 0))]
    if n_body < 1:
        raise ConfigError(f"{stages} pipeline stages: the model has {len(model.modules)} units, no "
                          "unit between its first and its head; every stage needs at least one")
    return partition(body_costs(model), stages, split)


def stage_units(body_range, n_units):
    """The unit range [first, stop) of a stage whose body units are `body_range` (unit_layout)
    in a model of n_units units: body unit k is unit k + 1; the first stage adds unit 0, the
    last the head. Local (pure)."""
    first, stop = body_range
    return (0 if first == 0 else first + 1, n_units if stop >= n_units - 2 else stop + 1)


def _ready_order(units, own_slot, copy_slot, first_user):
    """Per local unit, the grad-unit slots its backward makes final, in report order: the copies
    whose earliest user it is (last slot first), then its own."""
    order = [[] for _ in units]
    for c, u in sorted(first_user.items(), key=lambda kv: -copy_slot[kv[0]]):
        order[u].append(copy_slot[c])
    for u, slot in enumerate(own_slot):
        if slot is not None:
            order[u].append(slot)
    return order


class PipelineStage:
    """Units [first, stop) of a Model (rtxmpi.nn.module), run by one pipeline stage on its own flat
    buffers.

    model: a Model (any: a GPT, a ViT, a user's) or a TensorParallelModel (TensorParallelStage), the
    same on every rank; its parameters of this stage are copied (the caller may drop it).
    stage, stages: this (virtual) stage's index and the pipeline depth; blocks: its (first, stop)
    range of body units (unit_layout; a GPT's blocks).
    A parameter of an earlier stage that a unit here uses (ParamDecl.tied_to, e.g. the GPT's wte in
    its tied head) is a copy, appended after the own range; the engine sums the copies' gradients
    with the owner's (PipelineParallel.tied).

    Attributes: cfg (the model's, or None), stage, stages, is_first, is_last, blocks, unit_range,
    param_start / param_stop (indices in the model's param list), flat_start / flat_stop (range in
    the model's flat layout), full_specs, full_start / full_stop (range in the one-process layout),
    copies (list of model parameter indices held as copies), tied_copy (any copy), params
    (list[Param] on the stage's buffers: own, then copies), flat_data, flat_grad, num_params,
    own_size, replicated (per own parameter: whole on every tp rank), units (the grad-units:
    (start, stop) ranges of flat_grad, one per unit with parameters of its own, then one per copy;
    the dp buckets' units, and the slots a parameter provider hands out), slot_params (per slot
    its indices into params), fetches (per local unit the slots it uses, its own first), provider
    (None: the stage's own buffers; see use_provider), recompute (local unit indices whose
    forward reruns in backward: the model's `recompute` policy at construction).

    forward(inp, targets) -> (out, cache): inp is what the model's first unit takes on the first
    stage (token ids, images), else the previous stage's activation; out is the activation for the
    next stage, or on the last stage the micro-batch's loss (head.loss_forward; a Python float).
    backward(cache, dout=None, scale=1.0) -> dinp: adds the gradients (of scale * loss on the last
    stage, else given dout = d loss / d out) into flat_grad; returns d loss / d inp, or None on the
    first stage. Local for a plain Model (a TensorParallelModel's units are collective on tp/sp).
    """

    def __init__(self, model, stage, stages, blocks):
        self.cfg = getattr(model, "cfg", None)
        self.stage, self.stages, self.blocks = stage, stages, tuple(blocks)
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self.xp, self.dtype = model.xp, model.dtype
        n = len(model.modules)
        ua, ub = self.unit_range = stage_units(blocks, n)
        self.modules = model.modules[ua:ub]
        self.param_start, self.param_stop = model.units[ua][0], model.units[ub - 1][1]
        own = model.params[self.param_start:self.param_stop]
        self.flat_start = own[0].offset if own else 0
        self.flat_stop = own[-1].offset + own[-1].size if own else 0
        self.full_specs = _full_specs(model)
        full = self.full_specs[self.param_start:self.param_stop]
        self.full_start = full[0].offset if full else 0
        self.full_stop = full[-1].offset + full[-1].size if full else 0
        uses = [model.unit_params(u) for u in range(ua, ub)]
        self.copies = []
        for ks in uses:
            self.copies += [k for k in ks if k < self.param_start and k not in self.copies]
        self.tied_copy = bool(self.copies)
        entries = [(p.name, p.shape, p.decay) for p in own]
        entries += [(f"{model.params[k].name}.copy", model.params[k].shape, model.params[k].decay)
                    for k in self.copies]
        self._specs = specs = layout(entries)
        self._uses, self._n_own = uses, len(own)
        self.num_params = specs[-1].stop if specs else 0
        self.own_size = self.flat_stop - self.flat_start
        values = self.xp.empty(self.num_params, dtype=self.dtype)
        values[:self.own_size] = model.flat_data[self.flat_start:self.flat_stop]
        for c, k in enumerate(self.copies):
            spec = specs[len(own) + c]
            values[spec.offset:spec.stop] = model.params[k].data.reshape(-1)
        self.bind(values, self.xp.zeros(self.num_params, dtype=self.dtype))
        self.replicated = list(getattr(model, "replicated", [True] * len(model.params))
                               [self.param_start:self.param_stop])
        # grad-units: each unit's own range, then each copy; backward reports them final
        self.units, own_slot = [], []
        for u in range(ua, ub):
            a, b = model.units[u]
            if b > a:
                own_slot.append(len(self.units))
                first, last = self.params[a - self.param_start], self.params[b - 1 - self.param_start]
                self.units.append((first.offset, last.offset + last.size))
            else:
                own_slot.append(None)
        copy_slot = {}
        for c, k in enumerate(self.copies):
            copy_slot[k] = len(self.units)
            p = self.params[self._n_own + c]
            self.units.append((p.offset, p.offset + p.size))
        first_user = {k: min(u for u, ks in enumerate(uses) if k in ks) for k in self.copies}
        self._report = _ready_order(uses, own_slot, copy_slot, first_user)
        # provider traffic: per grad-unit (slot) its stage parameter indices; per local unit the
        # (slot, position) of each declaration and the slots it fetches (its own first)
        where = {}
        for u in range(ua, ub):
            a, b = model.units[u]
            for j, k in enumerate(range(a, b)):
                where[k] = (own_slot[u - ua], j)
        where.update({k: (copy_slot[k], 0) for k in self.copies})
        self.slot_params = [[] for _ in self.units]
        for k, (slot, _) in sorted(where.items(), key=lambda kv: kv[1]):
            self.slot_params[slot].append(self._n_own + self.copies.index(k) if k in copy_slot
                                          else k - self.param_start)
        self._sources = [[where[k] for k in ks] for ks in uses]
        self.fetches = [list(dict.fromkeys(slot for slot, _ in src)) for src in self._sources]
        self.provider = None
        chosen = set(model.recompute_units)
        self.recompute = [u - ua for u in range(ua, ub) if u in chosen]
        self._again = [u + ua in chosen for u in range(ub - ua)]
        self.defer_w, self.held_units, self._deferred, self._defer_from = False, (), [], len(uses)
        self.tp, self.tp_rank = 1, 0

    def bind(self, flat_data, flat_grad):
        """Hold the stage's parameters and gradients in the given 1-D arrays of num_params
        elements (flat_data is used as is: its values are the parameters from now on). Local."""
        self.flat_data, self.flat_grad = flat_data, flat_grad
        self.params = bind(self._specs, flat_data, flat_grad)
        local = {k: self.params[k - self.param_start]
                 for k in range(self.param_start, self.param_stop)}
        local.update({k: self.params[self._n_own + c] for c, k in enumerate(self.copies)})
        self._data = [[local[k].data for k in ks] for ks in self._uses]
        self._grad = [[local[k].grad for k in ks] for ks in self._uses]

    def use_provider(self, provider):
        """Take the units' parameters and gradients from `provider` from now on, slot by slot
        (a slot is a grad-unit, an index into `units`): fetch(slot, then=None) -> the slot's
        arrays (then: the slot fetched next, a prefetch hint), release(slot), grads(slot) ->
        arrays to add into, grads_ready(slot) once this backward made its gradient final, and
        finish() after each backward (rtxmpi.parallel.zero.ShardedParams: ZeRO-3). The stage lets
        go of flat_data, flat_grad and its Params' arrays (None): only the provider holds them.
        The calls are in unit order, the same on every rank that shares the provider's group.
        Local."""
        self.provider = provider
        self.flat_data = self.flat_grad = None
        for p in self.params:
            p.data = p.grad = None
        self._data = self._grad = None

    def _take(self, u, then=None):
        """Local unit u's parameter arrays in declaration order: the precomputed views, or
        fetched from the provider slot by slot (then: the slot hinted after the last)."""
        if self.provider is None:
            return self._data[u]
        slots, got = self.fetches[u], {}
        for i, slot in enumerate(slots):
            got[slot] = self.provider.fetch(slot, then=slots[i + 1] if i + 1 < len(slots) else then)
        return [got[slot][j] for slot, j in self._sources[u]]

    def _take_grads(self, u):
        if self.provider is None:
            return self._grad[u]
        got = {slot: self.provider.grads(slot) for slot in self.fetches[u]}
        return [got[slot][j] for slot, j in self._sources[u]]

    def _release(self, u):
        if self.provider is not None:
            for slot in self.fetches[u]:
                self.provider.release(slot)

    def _fetches_in(self, u, backward):
        """Whether local unit u asks the provider for parameters in this pass: always in
        forward; in backward when its forward reruns or its backward reads them."""
        return not backward or self._again[u] or self.modules[u].backward_needs_params

    def _next_fetch(self, u, backward):
        """The first slot of the next local unit that fetches in this pass (after u in forward,
        before it in backward), or None: the prefetch hint, which never leaves the stage's pass
        (no gather is in flight across a pipeline send or receive)."""
        step = -1 if backward else 1
        u += step
        while 0 <= u < len(self.modules):
            if self.fetches[u] and self._fetches_in(u, backward):
                return self.fetches[u][0]
            u += step
        return None

    def zero_grad(self):
        """Set the gradients (own range and the copies; the provider's shard) to 0. Local."""
        if self.flat_grad is not None:
            self.flat_grad.fill(0)
        elif self.provider is not None:
            self.provider.grad.fill(0)

    def defer_weight_grads(self):
        """On the last stage of a pipeline: from now on its backward computes the weight gradients
        that its last two units' modules can defer (Module.defers_weight_grads; a GPT's head
        matmul and its last block's MLP) later, in `flush_weight_grads`, which the engine runs
        after the stage's last op (the stage then idles while the others drain the pipeline).
        Balances the last stage, whose head and loss cost about 15% of a block on top of its
        blocks, against the others (the B/W split of Qi et al., "Zero Bubble Pipeline
        Parallelism", ICLR 2024, used only to fill the last stage's drain). Costs memory: the
        inputs of the deferred products of every micro-batch are kept until the flush.
        Returns True when enabled (the last stage of a pipeline of 2 or more stages, with a
        unit that defers)."""
        n = len(self.modules)
        if not self.is_last or self.is_first or not any(
                m.defers_weight_grads for m in self.modules[max(n - 2, 0):]):
            return False
        self.defer_w, self._defer_from = True, max(n - 2, 0)
        self.held_units = tuple(s for u in range(n - 1, self._defer_from - 1, -1)
                                for s in self._report[u])
        return True

    def flush_weight_grads(self, unit_ready=None):
        """Run the deferred weight-gradient products in micro-batch order (the same sums, in
        the same order, as without deferral: bitwise the same gradients), then report the held
        units to unit_ready (in backward's order).

        unit_ready: None, or callable(u) with u an int index into `units` (this stage's flat_grad
        ranges); called once per held unit, after which that unit's gradient is final for the
        step (the engine's dp bucket callback, PipelineParallel._start_buckets). Called on the
        last stage only, once per step after its last op. Local (what unit_ready does may not
        be: the engine's callback starts an async all_reduce on the dp group).
        """
        for weight_grads in self._deferred:
            weight_grads()
        self._deferred.clear()
        if unit_ready is not None:
            for u in self.held_units:
                unit_ready(u)

    # hooks the engine uses, so that a tensor-parallel stage can differ ---------------------------
    def check_positions(self, x):
        """Raise ConfigError when this stage cannot take the batch x (nothing to check here)."""

    def local_tokens(self, a):
        """This rank's positions of a batch array (all of them here)."""
        return a

    def chunk_is_first(self, chunk):
        """Whether model chunk `chunk` of this rank is the pipeline's first (reads the inputs)."""
        return self.is_first

    def chunk_is_last(self, chunk):
        """Whether model chunk `chunk` of this rank is the pipeline's last (computes the loss)."""
        return self.is_last

    def own_pieces(self, local_own):
        """[(full_start, values)]: this rank's own-range vector (own_size) as pieces of the
        one-process flat layout (one piece here; a ChunkedStage has one per chunk)."""
        return [self.own_full(local_own)]

    def grad_norm_sq(self):
        """Squared L2 norm of the stage's own gradient (the copies not counted). Local."""
        return grad_norm_sq(self.flat_grad[:self.own_size])

    def own_full(self, local_own):
        """(full_start, values): the one-process flat layout's [full_start, full_stop) from this
        rank's own-range vector (own_size). Local here (the layouts coincide)."""
        return self.full_start, local_own

    def load_from(self, read, name, tied=()):
        """This rank's whole stage vector (num_params: own range, then the copies) from the
        one-process flat vector `name`: one read(name, offset, length) call for the own range,
        then one per parameter index in `tied` (every tied parameter of the pipeline, the same
        list on every rank; length 0 where this stage holds no copy of it), as a collective
        reader needs."""
        out = self.xp.empty(self.num_params, dtype=self.dtype)
        out[:self.own_size] = self.xp.asarray(
            read_range(read, name, self.full_start, self.own_size), dtype=self.dtype)
        for k in tied:
            values = self._read_tied(read, name, k)
            if k in self.copies:
                p = self.tied_param(k)
                out[p.offset:p.offset + p.size] = values
        return out

    def vector_range(self, k):
        """(lo, hi): where the model's parameter index k lies in this stage's vector (owned or a
        copy), or None. Local."""
        p = self.tied_param(k)
        return None if p is None else (p.offset, p.offset + p.size)

    def tied_param(self, k):
        """The Param holding the model's parameter index k here (owned or a copy), or None."""
        if self.param_start <= k < self.param_stop:
            return self.params[k - self.param_start]
        if k in self.copies:
            return self.params[self._n_own + self.copies.index(k)]
        return None

    def _read_tied(self, read, name, k):
        spec = self.full_specs[k]
        length = spec.size if k in self.copies else 0
        return self.xp.asarray(read_range(read, name, spec.offset, length), dtype=self.dtype)

    def run_forward(self, inp, chunk=0):
        """The stage's units forward on inp, nothing kept: the activation for the next stage (the
        engine's shape probe). Local (collective on tp/sp for a tensor-parallel stage)."""
        x = inp
        for u, m in enumerate(self.modules):
            x = m.forward(self._take(u, self._next_fetch(u, False)), x)[0]
            self._release(u)
        return x

    def forward(self, inp, targets=None, chunk=0):
        """Forward of this stage's units for one micro-batch. inp: the first unit's input on the
        first stage, else the activation received from the previous stage (the model dtype).
        targets: what the head's loss_forward takes, used on the last stage only. chunk: ignored
        (one chunk). Returns (out, cache): out is the activation for the next stage, or on the
        last stage the micro-batch's loss (Python float); cache is for `backward`. A recomputed
        unit keeps its input instead of its cache. Local (collective on tp/sp for a
        tensor-parallel stage)."""
        x, inputs, caches = inp, [], []
        for u, (m, again) in enumerate(zip(self.modules, self._again)):
            inputs.append(x if again else None)
            x, cache = m.forward(self._take(u, self._next_fetch(u, False)), x)
            caches.append(None if again else cache)
            self._release(u)
        if not self.is_last:
            return x, (inputs, caches, None)
        loss, loss_cache = self.modules[-1].loss_forward(x, targets)
        return float(loss), (inputs, caches, loss_cache)

    def backward(self, cache, dout=None, scale=1.0, unit_ready=None, chunk=0):
        """Backward of one micro-batch: ADDS the parameter gradients into flat_grad.

        cache: from `forward`. dout: d loss / d out received from the next stage (None on the
        last stage, which starts from its loss). scale: the loss weight (1 / micro_batches in the
        engine). unit_ready: None, or callable(u) called once per grad-unit u (index into
        `units`) as soon as that unit's gradient for this backward is final, in backward order,
        except the units held for flush_weight_grads (deferred weight gradients); the engine
        passes its dp bucket callback only to the step's last backward of the stage. chunk:
        ignored. Returns d loss / d inp, or None on the first stage. Local (the callback may
        start collectives: PipelineParallel._start_buckets)."""
        inputs, caches, loss_cache = cache
        dx = self.modules[-1].loss_backward(scale, loss_cache) if self.is_last else dout
        hold, P = self.held_units, self.provider
        for u in range(len(self.modules) - 1, -1, -1):
            m, unit_cache = self.modules[u], caches[u]
            # a provider is asked only for what backward reads: a recomputed unit's parameters,
            # or those its backward needs (Model.backward's rule)
            fetch = P is None or self._fetches_in(u, backward=True)
            params = self._take(u, self._next_fetch(u, True)) if fetch else None
            if unit_cache is None:  # recomputed: the forward kept the unit's input
                unit = u + self.unit_range[0]
                with trace.span(f"unit {unit} recompute", "compute", unit=unit):
                    unit_cache = m.forward(params, inputs[u])[1]
            defer = self._deferred if self.defer_w and u >= self._defer_from else None
            dx = run_backward(m, params if m.backward_needs_params else None, self._take_grads(u),
                              unit_cache, dx, defer=defer)
            if fetch:
                self._release(u)
            for slot in self._report[u]:
                if P is not None:
                    P.grads_ready(slot)
                if unit_ready is not None and slot not in hold:
                    unit_ready(slot)
        if P is not None:
            P.finish()  # every reduction of this backward done before the next pipeline message
        return None if self.is_first else dx


def _tied_stages(model, unit_ranges):
    """[(k, stages)]: each parameter index k that units of more than one (virtual) stage use,
    with those stages in order (the first owns it: a tie points to an earlier unit), in index
    order; unit_ranges: each stage's (first, stop) units. The same list on every rank. Local
    (pure)."""
    where = {}
    for c, (a, b) in enumerate(unit_ranges):
        for u in range(a, b):
            for k in model.unit_params(u):
                where.setdefault(k, set()).add(c)
    return [(k, sorted(where[k])) for k in sorted(where) if len(where[k]) > 1]


def _input_check(model):
    """The batch check a Model offers, callable(x, y) raising ConfigError: a GPT's (and a
    ParallelGPT's) token check of the pipeline (`_check_tokens`), else the model's check_tokens
    (a ViT's images and labels), else None (only the engine's shape checks)."""
    if isinstance(getattr(model, "cfg", None), GPTConfig):
        return lambda x, y: _check_tokens(model.cfg, x, y)
    check = getattr(model, "check_tokens", None)
    if check is not None and not isinstance(model, TensorParallelModel):
        return check
    return None


def _check_tokens(cfg, x, y):
    """ConfigError unless x, y are (B, T) integer token ids, 1 <= T <= cfg.seq_len, in
    [0, vocab_size). Local."""
    if getattr(x, "ndim", None) != 2 or getattr(y, "shape", None) != x.shape:
        raise ConfigError(f"pipeline batch: x and y must be (B, T) arrays of the same shape, "
                          f"got {getattr(x, 'shape', None)} and {getattr(y, 'shape', None)}")
    T = x.shape[1]
    if T > cfg.seq_len or T == 0:
        raise ConfigError(f"batch has T={T} positions but the model's seq_len is "
                          f"{cfg.seq_len}; use 1 <= T <= seq_len")
    for name, a in (("x", x), ("y", y)):
        if a.dtype.kind not in "iu" or int(a.min()) < 0 or int(a.max()) >= cfg.vocab_size:
            raise ConfigError(f"pipeline batch: {name} must hold integer token ids in [0, "
                              f"{cfg.vocab_size}), got dtype {a.dtype}, range "
                              f"[{a.min()}, {a.max()}]")


def stage_buckets(units, bucket_bytes, itemsize):
    """Data-parallel gradient buckets of a stage: its units (flat (start, stop) ranges in flat
    order) grouped, from the last unit back, into contiguous buckets of about bucket_bytes
    (rtxmpi.parallel.data.build_buckets; a bucket's first/last are unit indices). Returns the
    buckets in launch order (last units first). Local (pure)."""
    spans = [_Span(a, b - a) for a, b in units]
    return build_buckets(spans, bucket_bytes, itemsize)


class _Span:
    __slots__ = ("offset", "size")

    def __init__(self, offset, size):
        self.offset, self.size = offset, size


class TensorParallelStage(PipelineStage):
    """A pipeline stage of a TensorParallelModel (rtxmpi.parallel.parallelize, e.g. a
    ParallelGPT): the stage's units are the model's parallel units (Megatron tensor parallelism
    over the model's tp group, Ulysses attention over its sp group), run as PipelineStage runs
    any units. The model's own flat buffers are dropped (its Param views become None; the model
    keeps the layout metadata gather_full and local_from_full need). flat_start / flat_stop are
    the range in this tp rank's local layout; full_start / full_stop in the one-process layout.
    forward/backward: collective on the tp group (every tp rank of the stage calls them in the
    same order); activations between stages are this rank's positions (T / sp, and / tp under
    sequence_parallel).
    """

    def __init__(self, model, stage, stages, blocks):
        super().__init__(model, stage, stages, blocks)
        self.model, self.tp, self.tp_rank = model, model.tp, model.tp_rank
        self.tp_group = model.tp_group
        for p in model.params:
            p.data = p.grad = None
        model.flat_data = model.flat_grad = None

    def use_provider(self, provider):
        """Refused (ConfigError): a tensor-parallel stage's parameters stay in its buffers (its
        checkpoint and norm read the model's tp layout); ZeRO-3 under pp needs tp = sp = 1."""
        raise ConfigError("ZeRO stage 3 under pipeline parallelism shards stages of a plain Model "
                          f"(tp = sp = 1), not tp({self.tp}) x sp({self.model.sp}) stages; use "
                          "ZeRO stage 1 or 2 with tensor or sequence parallelism")

    def check_positions(self, x):
        m, T = self.model, x.shape[1] if x.ndim >= 2 else 1
        if m.sp > 1 and T % m.sp:
            raise ConfigError(f"T={T} positions are not divisible by sp({m.sp}) (Ulysses splits "
                              f"each sample's positions over sp); use a multiple of {m.sp}")
        if m.sequence_parallel and (T // m.sp) % self.tp:
            raise ConfigError(f"sequence_parallel: T={T} positions are not divisible by "
                              f"sp({m.sp}) * tp({self.tp}); use a sequence length divisible by "
                              f"{m.sp * self.tp}")

    def local_tokens(self, a):
        """Positions [sp_rank * Ts, (sp_rank + 1) * Ts) of a (B, T, ...) array, Ts = T / sp."""
        sp = self.model.sp
        if sp == 1 or a.ndim < 2:
            return a
        Ts = a.shape[1] // sp
        return a[:, self.model.sp_rank * Ts:(self.model.sp_rank + 1) * Ts]

    def grad_norm_sq(self):
        """The full model's squared norm over this stage's parameters: tp-split parts summed over
        tp, replicated ones counted once. Collective on the tp group."""
        total = np.zeros(1, np.float64)
        for lo, hi in tpl.norm_ranges(self.params[:self.param_stop - self.param_start],
                                      self.tp_rank, replicated=self.replicated):
            total[0] += grad_norm_sq(self.flat_grad[lo:hi])
        if self.tp > 1:
            self.tp_group.all_reduce(total)
        return float(total[0])

    def own_full(self, local_own):
        """Collective on the tp group (one all_gather of this rank's local layout)."""
        local = self.xp.zeros(self.model.num_params, dtype=local_own.dtype)
        local[self.flat_start:self.flat_stop] = local_own
        full = self.model.gather_full(local)
        return self.full_start, full[self.full_start:self.full_stop]

    def load_from(self, read, name, tied=()):
        full = self.xp.zeros(self.full_specs[-1].stop, dtype=self.dtype)
        full[self.full_start:self.full_stop] = self.xp.asarray(
            read_range(read, name, self.full_start, self.full_stop - self.full_start),
            dtype=self.dtype)
        for k in tied:
            spec = self.full_specs[k]
            values = self._read_tied(read, name, k)
            full[spec.offset:spec.offset + values.shape[0]] = values
        local = self.model.local_from_full(full)
        out = self.xp.empty(self.num_params, dtype=self.dtype)
        out[:self.own_size] = local[self.flat_start:self.flat_stop]
        for c, k in enumerate(self.copies):
            p, q = self.tied_param(k), self.model.params[k]
            out[p.offset:p.offset + p.size] = local[q.offset:q.offset + q.size]
        return out


class ChunkedStage:
    """The V model chunks one rank runs under the interleaved schedule, on one flat buffer.

    model: a Model (tensor- or sequence-parallel chunks are not supported); stage, stages: this
    rank and the pipeline depth p; chunk_blocks: V (first, stop) body-unit ranges, chunk v being
    virtual stage v * p + stage of the p * V (unit_layout over p * V). Each chunk is a
    PipelineStage of the p * V virtual stages (chunk 0 of rank 0 holds the first unit, chunk
    V - 1 of rank p - 1 the head and, tied, its copies); their parameters live in one flat
    buffer, chunk after chunk (only the last chunk may hold copies: they end the vector, else
    ConfigError), so the optimizer, gradient buckets, ZeRO and the gradient norm see one vector
    as for a PipelineStage. Attributes as PipelineStage (params,
    flat_data, flat_grad, num_params, own_size, units, tied_copy, is_first / is_last: this rank
    holds the first / last virtual stage) plus chunks. Local: no communication.
    """

    def __init__(self, model, stage, stages, chunk_blocks):
        V = len(chunk_blocks)
        self.chunks = [PipelineStage(model, v * stages + stage, stages * V, blocks)
                       for v, blocks in enumerate(chunk_blocks)]
        if any(ch.copies for ch in self.chunks[:-1]):
            raise ConfigError("interleaved virtual stages: only a rank's last chunk may use a tied "
                              "parameter of another stage (its copies end the rank's vector)")
        first, last = self.chunks[0], self.chunks[-1]
        self.cfg, self.stage, self.stages = getattr(model, "cfg", None), stage, stages
        self.xp, self.dtype = model.xp, model.dtype
        self.is_first, self.is_last, self.tied_copy = first.is_first, last.is_last, last.tied_copy
        self.tp, self.tp_rank = 1, 0
        self.full_specs = first.full_specs
        self.segments, at = [], 0
        for ch in self.chunks:
            self.segments.append(at)
            at += ch.num_params
        self.num_params = at
        self.flat_data = self.xp.empty(self.num_params, dtype=self.dtype)
        self.flat_grad = self.xp.zeros(self.num_params, dtype=self.dtype)
        self.params = bind(layout((p.name, p.shape, p.decay) for ch in self.chunks
                                  for p in ch.params), self.flat_data, self.flat_grad)
        self.units, self.replicated = [], []
        for ch, base in zip(self.chunks, self.segments):  # re-point each chunk at its segment
            end = base + ch.num_params
            self.flat_data[base:end] = ch.flat_data
            ch.bind(self.flat_data[base:end], self.flat_grad[base:end])
            self.units += [(a + base, b + base) for a, b in ch.units]
            self.replicated += ch.replicated
        self.own_size = self.num_params - (last.num_params - last.own_size)
        self.copies = last.copies
        self._unit_base = [sum(len(c.units) for c in self.chunks[:v]) for v in range(V)]
        param_base = [sum(len(c.params) for c in self.chunks[:v]) for v in range(V)]
        self.slot_params = [[base + k for k in ks] for ch, base in zip(self.chunks, param_base)
                            for ks in ch.slot_params]
        self.provider = None

    def use_provider(self, provider):
        """PipelineStage.use_provider for every chunk, over this rank's slots (`units`: chunk
        v's slot j is its units index, the slots of the chunks before it plus j); flat_data,
        flat_grad and the Params' arrays become None. Local."""
        self.provider = provider
        for ch, base in zip(self.chunks, self._unit_base):
            ch.use_provider(_ShiftedSlots(provider, base))
        self.flat_data = self.flat_grad = None
        for p in self.params:
            p.data = p.grad = None

    def vector_range(self, k):
        """(lo, hi): where the model's parameter index k lies in this rank's vector, or None
        when no chunk holds it. Local."""
        for ch, base in zip(self.chunks, self.segments):
            where = ch.vector_range(k)
            if where is not None:
                return where[0] + base, where[1] + base
        return None

    def zero_grad(self):
        """Set the gradients (every chunk, and the copies; the provider's shard) to 0. Local."""
        if self.flat_grad is not None:
            self.flat_grad.fill(0)
        elif self.provider is not None:
            self.provider.grad.fill(0)

    def check_positions(self, x):
        """Nothing to check (whole sequences)."""

    def local_tokens(self, a):
        """All positions of a batch array."""
        return a

    def chunk_is_first(self, chunk):
        """Whether chunk `chunk` (int in [0, V)) is virtual stage 0 (reads the inputs). Local."""
        return self.chunks[chunk].is_first

    def chunk_is_last(self, chunk):
        """Whether chunk `chunk` (int in [0, V)) is the last virtual stage (computes the loss).
        Local."""
        return self.chunks[chunk].is_last

    def grad_norm_sq(self):
        """Squared L2 norm (Python float, accumulated in float64) of the rank's own gradient
        (every chunk; the copies not counted). Local: the engine sums it over pp."""
        return grad_norm_sq(self.flat_grad[:self.own_size])

    def own_pieces(self, local_own):
        """[(full_start, values)] per chunk, in chunk order: local_own is a 1-D (own_size,)
        vector in this rank's layout (flat_data[:own_size], or an optimizer moment); values is
        chunk v's slice of it (a view), full_start where it begins in the one-process flat
        layout. Local."""
        return [(ch.full_start, local_own[base:base + ch.own_size])
                for ch, base in zip(self.chunks, self.segments)]

    def load_from(self, read, name, tied=()):
        """The rank's whole vector, (num_params,) in the model dtype, from the one-process flat
        vector `name` through read(name, offset, length) (a checkpoint reader): one read call per
        chunk, then one per index in `tied` (see PipelineStage.load_from), the same count on
        every rank, as a collective reader needs. Raises a typed error naming the call when read
        returns another shape, and what read raises (CheckpointError)."""
        out = self.xp.empty(self.num_params, dtype=self.dtype)
        for v, (ch, base) in enumerate(zip(self.chunks, self.segments)):
            last = v == len(self.chunks) - 1
            out[base:base + ch.num_params] = ch.load_from(read, name, tied if last else ())
        return out

    def run_forward(self, inp, chunk=0):
        """PipelineStage.run_forward of chunk `chunk`. Local."""
        return self.chunks[chunk].run_forward(inp)

    def forward(self, inp, targets=None, chunk=0):
        """Forward of chunk `chunk` (int in [0, V)) for one micro-batch: PipelineStage.forward
        of that chunk (returns (out, cache), out the loss on the last virtual stage). Local."""
        return self.chunks[chunk].forward(inp, targets)

    def backward(self, cache, dout=None, scale=1.0, unit_ready=None, chunk=0):
        """Backward of chunk `chunk`: PipelineStage.backward of that chunk, adding into its
        segment of flat_grad. unit_ready(u), if given, receives u as an index into this rank's
        `units` (the chunk's own unit index plus the units of the chunks before it), once per
        unit of the chunk, in backward order. Returns d loss / d inp, or None on virtual stage 0.
        Local (the callback may start the dp all_reduce)."""
        base = self._unit_base[chunk]
        ready = None if unit_ready is None else (lambda u: unit_ready(base + u))
        return self.chunks[chunk].backward(cache, dout=dout, scale=scale, unit_ready=ready)



class _ShiftedSlots:
    """A chunk's view of its rank's provider: the chunk's slot j is the rank's slot base + j."""

    def __init__(self, provider, base):
        self.provider, self.base = provider, base

    def fetch(self, slot, then=None):
        return self.provider.fetch(self.base + slot, then=None if then is None else self.base + then)

    def release(self, slot):
        self.provider.release(self.base + slot)

    def grads(self, slot):
        return self.provider.grads(self.base + slot)

    def grads_ready(self, slot):
        self.provider.grads_ready(self.base + slot)

    def finish(self):
        self.provider.finish()


class PipelineParallel:
    """Train a Model split into pipeline stages over `pp_group`, replicated over `dp_group`.

    model: an rtxmpi.nn Model (a GPT, a ViT, a Model of one's own units; at least one unit between
    its first and its head per stage), the same units, seed and recompute policy on every rank;
    this rank copies its stage's parameters (stage = pp_group.rank) and the caller may drop the
    model. Or a TensorParallelModel (rtxmpi.parallel.parallelize, e.g. a ParallelGPT): tensor-
    and/or Ulysses-parallel stages (TensorParallelStage; every collective then also involves the
    model's tp and sp groups). pp_group: ProcessGroup of the pipeline (group rank = stage).
    dp_group: ProcessGroup of the replicas of this stage that see different samples (None: no
    data parallelism): the dp ranks, and with sp > 1 the sp ranks too (mesh.loss_group); every
    replica runs the same schedule on its own samples, and gradients and loss are averaged over it.
    bucket_bytes: dp gradient bucket size (whole units); each bucket's all_reduce starts during
    the stage's last backward (overlap_dp=True) or after the schedule.
    micro_batches: m, micro-batches per step on each pipeline (>= 1; >= pp for 1F1B; a multiple
    of pp for interleaved). schedule: "1f1b" (default), "gpipe" or "interleaved" (with
    virtual_stages = V >= 2 chunks of a plain Model a rank: ChunkedStage). split: body units (a
    GPT's blocks) per (virtual) stage (see unit_layout), None: balanced by body_costs.
    optimizer: callable(params_flat, decay_mask) -> AdamW-like (default AdamW(lr=3e-4)); it
    updates this stage's flat_data (own range and tied copies), or with zero_stage 1-3 only
    this rank's shard of it (rtxmpi.parallel.pipeline_zero.StageZero over dp_group; at stage 3
    the stage keeps only that shard and gathers each unit per micro-batch, see
    PipelineStage.use_provider; the last stage's weight gradients are then not deferred).
    defer_weight_grads: the last stage of a plain-Model pipeline (V = 1) computes the weight
    gradients its last two units can defer (a GPT's head and last block's MLP) after its last op
    (PipelineStage.defer_weight_grads; bitwise the same gradients). Recomputation: the units the
    model's `recompute` names keep only their input in forward and rerun it in backward (bitwise
    the same gradients). Construction broadcasts the stage's parameters from dp rank 0 and each
    tied parameter from its owner's rank to the ranks holding copies, so every copy starts
    identical.

    Collective: every rank of pp_group and dp_group must construct it and call train_step / step /
    grad_norm / eval_loss the same number of times in the same order, with same-shaped batches.
    Raises ConfigError on every rank (before any send) for an unknown schedule, more stages than
    body units, micro_batches < 1 or < pp with 1F1B, a split that does not fit, a schedule that
    fails check_schedule, ZeRO stage 3 with tp or sp, virtual stages with tp or sp, a tied
    parameter that two chunks of one rank would hold.

    Attributes: stage (PipelineStage, TensorParallelStage or ChunkedStage), model (the same stage:
    dtype, num_params, full_specs, as the training loop reads a model), mesh (from_mesh), num_params (the
    whole one-process model's), tied (this rank's [(parameter index, group, Param)] of the tied
    parameters it holds), tied_indices (every tied parameter index of the pipeline), embed_group
    (the first tied group, or None: a GPT's embedding group), optimizer, schedule (this stage's
    op list), schedules (every stage's), layouts (body units per stage), micro_batches, timeline
    (after train_step: list of (kind, micro_batch, start_s, stop_s) per op of this rank,
    perf_counter seconds; recv spans are the time blocked waiting; "dp_wait": the wait for the dp
    reduction after the schedule, "W": the deferred weight gradients), buckets (dp gradient
    buckets), zero (StageZero or None).
    """

    def __init__(self, model, pp_group, dp_group=None, *, micro_batches, schedule="1f1b",
                 split=None, optimizer=None, bucket_bytes=DEFAULT_BUCKET_BYTES, overlap_dp=True,
                 zero_stage=0, defer_weight_grads=True, virtual_stages=1):
        if not isinstance(model, Model):
            raise ConfigError(f"PipelineParallel needs an rtxmpi.nn Model (a GPT, a ViT, a Model of "
                              f"one's own units) or a TensorParallelModel, got {type(model).__name__}")
        parallel = isinstance(model, TensorParallelModel)
        if parallel and model.sp > 1 and (dp_group is None or dp_group.world_size % model.sp):
            raise ConfigError(f"with sp({model.sp}) > 1 the replica group must hold the sp ranks "
                              f"(mesh.loss_group = group('dp', 'sp')), got "
                              f"{getattr(dp_group, 'world_size', None)} ranks")
        p = pp_group.world_size
        self.pp_group, self.dp_group = pp_group, dp_group
        self.micro_batches, self.schedule_name = micro_batches, schedule
        V = self.virtual_stages = virtual_stages
        if isinstance(V, bool) or not isinstance(V, int) or V < 1:
            raise ConfigError(f"virtual_stages must be an int >= 1, got {V!r}")
        if V != 1 and parallel:
            raise ConfigError(f"virtual stages ({V}, the interleaved schedule) run chunks of a plain "
                              "Model only; use tp = sp = 1 or the 1f1b/gpipe schedule")
        self.layouts = unit_layout(model, p * V, split)  # body units (blocks) per virtual stage
        self.schedules = build_schedule(schedule, micro_batches, p, V)  # every stage's, checked
        self.schedule = self.schedules[pp_group.rank]
        s = pp_group.rank
        tied = _tied_stages(model, [stage_units(b, len(model.modules)) for b in self.layouts])
        for k, where in tied:  # where[0] holds the parameter, the others copies
            ranks = [c % p for c in where]
            if len(set(ranks)) < len(ranks) or any(c // p < V - 1 for c in where[1:]):
                raise ConfigError(f"parameter {model.params[k].name!r} is used on virtual stages "
                                  f"{where} of {p * V}: a copy must be on another rank than the "
                                  "parameter and in a rank's last chunk; use another split or "
                                  "the 1f1b schedule")
        if V > 1:  # chunk v = virtual stage v * p + s
            self.stage = ChunkedStage(model, s, p, [self.layouts[v * p + s] for v in range(V)])
        else:
            stage_type = TensorParallelStage if parallel else PipelineStage
            self.stage = stage_type(model, s, p, self.layouts[s])
        self.cfg = getattr(model, "cfg", None)
        self._check_inputs = _input_check(model)
        self.num_params = self.stage.full_specs[-1].stop  # the one-process model's
        self.full_specs = self.stage.full_specs  # the one-process flat layout (checkpoint metadata)
        self.model = self.stage  # what the training loop reads as "the model": dtype, num_params, full_specs
        self.mesh = None  # set by from_mesh
        self.timeline = []
        self._shapes = {}  # activation shapes per batch shape (_probe_shapes)
        st = self.stage
        # tied parameters used on other stages (the GPT's wte in its head): one group per
        # parameter over the pipeline ranks holding it (Megatron's embedding group), in which
        # the copies' gradients are summed after each backward; every copy starts as the owner's
        self.tied = []
        owners = []  # the group rank of each tied parameter's owner
        for k, where in tied:  # the same list on every rank: new_group is collective on pp
            ranks = sorted(c % p for c in where)
            group = pp_group.new_group(ranks)
            if group is not None:
                param = next(q for ch in getattr(st, "chunks", [st]) for q in [ch.tied_param(k)] if q)
                self.tied.append((k, group, param))
                owners.append(ranks.index(where[0] % p))
        self.tied_indices = [k for k, _ in tied]
        self.embed_group = self.tied[0][1] if self.tied else None
        if dp_group is not None and dp_group.world_size > 1:
            dp_group.broadcast(st.flat_data, src=0)
        for (_, group, param), owner in zip(self.tied, owners):
            group.broadcast(param.data, src=owner)
        make = optimizer or (lambda params, mask: AdamW(params, lr=3e-4, decay_mask=mask))
        self.zero_stage, self.provider = zero_stage, None
        if not bucket_bytes > 0:
            raise ConfigError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.overlap_dp = bool(overlap_dp)
        self.buckets = stage_buckets(st.units, int(bucket_bytes), np.dtype(st.dtype).itemsize)
        # DataParallel's bucket engine over the stage's units; every bucket launches async as it
        # completes (sends and the deferred weight gradients still follow the last backward).
        # ZeRO-3 reduces each unit in every backward instead (its provider)
        self.reducer = (BucketReducer(self.buckets, len(st.units), st.flat_grad, dp_group,
                                      op="avg", block_last=False)
                        if self._dp_active() and zero_stage != 3 else None)
        if zero_stage:  # ZeRO 1-3 over the stage's replica group (rtxmpi.parallel.pipeline_zero)
            self.zero = StageZero(st, dp_group, zero_stage, make)
            self.optimizer = self.zero.optimizer
            self.provider = self.zero.provider  # stage 3: gathered units (peak_bytes)
        else:
            self.zero = None
            self.optimizer = make(st.flat_data, decay_mask(st.params, xp=st.xp, dtype=st.dtype))
        # the stage's last backward (micro-batch of the schedule's last B): its gradients are final
        # unit by unit during it, and the dp all_reduce of each bucket starts as soon as it is
        self._last_b = {op.chunk: op.micro_batch for op in self.schedule if op.kind == "B"}
        # the last stage's head and last-block MLP weight gradients run in its drain idle time
        self.deferred_w = (defer_weight_grads and V == 1 and not parallel and zero_stage != 3
                           and st.defer_weight_grads())  # ZeRO-3 frees a unit after backward

    @classmethod
    def from_mesh(cls, model, mesh, **kwargs):
        """Build over a DeviceMesh (rtxmpi.mesh): pp_group = mesh.group("pp"), dp_group =
        mesh.loss_group (group("dp", "sp"): with Ulysses every sp rank holds the whole stage and
        the loss of its positions, so gradients and loss average over dp x sp). With mesh.tp > 1
        or mesh.sp > 1 the model must be a TensorParallelModel (e.g. a ParallelGPT) on the same
        mesh. Raises ConfigError when tp or sp > 1 with a plain Model."""
        if (mesh.tp > 1 or mesh.sp > 1) and not isinstance(model, TensorParallelModel):
            raise ConfigError(f"pipeline parallelism with tp({mesh.tp}) or sp({mesh.sp}) > 1 needs "
                              "the model as a ParallelGPT or another TensorParallelModel on the "
                              "same mesh (rtxmpi.parallel.parallelize)")
        engine = cls(model, mesh.group("pp"), mesh.loss_group, **kwargs)
        engine.mesh = mesh
        return engine

    # ---------------------------------------------------------------------------------- a step
    def _check_batch(self, x, y):
        """Validate this rank's batch, agreed over every rank of the step: the micro-batch size b
        when every rank's batch is good, else ConfigError on EVERY rank naming each offending
        rank and its problem (one 1-byte MAX all_reduce over the mesh's world, or over the pp, dp
        and tp groups in turn, before anything is sent). Collective: every rank of the step
        calls."""
        error = None
        try:
            b = self._check_local_batch(x, y)
        except ConfigError as exc:
            error = exc
        groups = ([self.mesh.world] if self.mesh is not None else
                  [self.pp_group, self.dp_group, getattr(self.stage, "tp_group", None)])
        raise_if_any_failed(groups, error, "pipeline batch check")
        return b

    def _check_local_batch(self, x, y):
        """b = B // micro_batches of this rank's batch; ConfigError here only: x and y not arrays
        of the same first (batch) dim B, B not a positive multiple of micro_batches, what the
        model's own check refuses (_input_check: a GPT's token ids, a ViT's images and labels),
        positions a tensor-parallel stage cannot split."""
        m = self.micro_batches
        if (getattr(x, "ndim", 0) < 1 or getattr(y, "ndim", 0) < 1 or y.shape[0] != x.shape[0]):
            raise ConfigError(f"pipeline batch: x and y must be arrays of the same first (batch) "
                              f"dim, got {getattr(x, 'shape', None)} and {getattr(y, 'shape', None)}")
        if self._check_inputs is not None:
            self._check_inputs(x, y)
        B = x.shape[0]
        if B % m or B == 0:
            raise ConfigError(f"the per-rank batch {B} is not divisible by micro_batches {m}: every "
                              f"micro-batch must have the same size; use a batch that is a "
                              f"multiple of {m} per data-parallel rank")
        self.stage.check_positions(x)
        return B // m

    def train_step(self, x, y):
        """Forward and backward of this rank's batch through the pipeline; gradients accumulate
        into stage.flat_grad (tied parameters summed over their groups, averaged over dp).
        Returns the global mean loss (Python float, the same on every rank).

        x, y: this dp replica's slice of the global batch, the same on every stage of the
        pipeline (stage 0 reads x, the last stage y, the others only the shapes): what the
        model's first unit and its head's loss take, B = x.shape[0] = y.shape[0] rows divisible
        by micro_batches (a GPT: (B, T) integer token ids and targets; a ViT: (B, S, S, Ci)
        images and (B,) labels). The first step of a new batch shape first finds the activation
        shapes (_probe_shapes). Collective (pp, dp and tied groups). Raises ConfigError (before
        any send, on every rank of the pp x dp (x tp) step, naming each offending rank) when any
        rank's batch fails the checks (_check_local_batch: a GPT's shape, dtype, length, token
        ids outside [0, vocab_size)); CollectiveTimeout when a peer does not send or receive in
        time.
        """
        b = self._check_batch(x, y)
        self._run(x, y, b, backward=True)
        st = self.stage
        t0 = time.perf_counter()
        if self.zero_stage == 2:  # the tied sums on whole gradients, then each rank's shard
            self._sum_tied()
            with trace.span("pp.dp_wait", "pipeline", stage=st.stage):
                self.zero.reduce_scatter()
        elif self.zero_stage == 3:  # units were reduced in each backward: tied sums, average
            with trace.span("pp.dp_wait", "pipeline", stage=st.stage):
                self.zero.finish_step(self.tied)
        else:
            with trace.span("pp.dp_wait", "pipeline", stage=st.stage):
                self._finish_dp()
            self._sum_tied()  # a sum: commutes with the dp average
        self.timeline.append(("dp_wait", -1, t0, time.perf_counter()))
        return self._global_loss()

    def _sum_tied(self):
        """Each tied parameter's gradient summed over the ranks that hold it (owner and copies),
        so every copy gets the same update. Collective on each tied group, in index order."""
        for _, group, param in self.tied:
            group.all_reduce(param.grad, op="sum")

    # data-parallel gradient buckets (DataParallel's scheme, per stage) ----------------------------
    def _dp_active(self):
        return self.dp_group is not None and self.dp_group.world_size > 1

    @property
    def dp_launched_in_backward(self):
        """Buckets whose all_reduce the last step started during its backward (0 without dp)."""
        return 0 if self.reducer is None else self.reducer.launched

    def _start_buckets(self):
        """Arm the dp buckets (BucketReducer) for the stage's last backward of the step; returns
        the unit_ready callback the stage's backward (and flush_weight_grads) calls.

        unit_ready(u): u an int index into stage.units; called once per unit per step, when that
        unit's gradient (all micro-batches accumulated) is final. When the last unit of a bucket
        arrives, that bucket's averaging all_reduce over dp_group starts (async_op; awaited in
        _finish_dp), and every bucket in flight is polled (test) so it progresses. Every dp
        replica launches the buckets in the same order (fixed by unit index), so the
        collectives match. Raises RtxmpiError when a unit is reported again after its bucket
        was launched (a stage bug: it would reduce a partial gradient)."""
        self.reducer.arm()
        return self.reducer.ready

    def _finish_dp(self):
        """Wait for every bucket's all_reduce (launch those not started: overlap_dp off); after
        it, flat_grad holds the dp average. Collective on dp_group (no-op without dp > 1);
        raises CollectiveTimeout when a replica does not join in time, RtxmpiError when the
        armed backward reported fewer units than the stage has."""
        if self.reducer is not None:
            self.reducer.finish()

    def eval_loss(self, x, y):
        """Mean loss of a batch, forward only (every micro-batch forward in order, no backward,
        no gradients); x, y as for train_step. Returns the mean over the global batch (the same
        on every rank). Collective like train_step."""
        b = self._check_batch(x, y)
        self._run(x, y, b, backward=False)
        return self._global_loss()

    def forward(self, x, y):
        """Evaluation: (mean loss over this dp replica's batch x, y, None), forward only, the same
        on every stage; x, y as for train_step. Collective over pp_group, and its batch check
        (as train_step's) over every rank of the step: every pipeline of the mesh calls it."""
        b = self._check_batch(x, y)
        self._run(x, y, b, backward=False)
        return self._pipeline_loss(), None

    def _pipeline_loss(self):
        losses = np.array([self._loss_sum / self.micro_batches], np.float64)
        self.pp_group.broadcast(losses, src=self.pp_group.world_size - 1)
        return float(losses[0])

    def _global_loss(self):
        losses = np.array([self._pipeline_loss()])
        if self.dp_group is not None and self.dp_group.world_size > 1:
            self.dp_group.all_reduce(losses, op="avg")
        return float(losses[0])

    def _probe_shapes(self, x, b):
        """{chunk: (input shape, output shape)} of this rank's chunks' activations for
        micro-batches of b rows of x (None where the chunk takes the batch or gives the loss):
        found once per batch shape by running each virtual stage's units forward on a
        micro-batch (the first stage on x's first b rows, the others on zeros of the shape the
        previous stage sent: one small message per stage boundary). Collective over pp_group (and
        tp/sp within a stage), like a step: every rank of the pipeline calls it with a same-shaped
        batch."""
        key = (b,) + tuple(x.shape[1:]) + (str(x.dtype),)
        if key in self._shapes:
            return self._shapes[key]
        st, pp, xp = self.stage, self.pp_group, self.stage.xp
        p, V = pp.world_size, self.virtual_stages
        tag = 2 * self.micro_batches * V  # above every schedule message's tag
        shapes, failed = {}, False
        for c in range(pp.rank, p * V, p):  # this rank's virtual stages, in pipeline order
            v, first, last = c // p, c == 0, c == p * V - 1
            inp = out = None
            if not first:
                header = to_host(pp.recv(xp.zeros(_SHAPE_HEADER, np.int64), (c - 1) % p, tag))
                inp = tuple(int(d) for d in header[1:1 + header[0]]) if header[0] >= 0 else None
            if not last:
                if first or inp is not None:
                    out = tuple(st.run_forward(x[:b] if first else xp.zeros(inp, st.dtype),
                                               chunk=v).shape)
                bad = out is None or len(out) >= _SHAPE_HEADER  # -1: no shape, every stage raises
                header = [-1] if bad else [len(out), *out]
                header += [0] * (_SHAPE_HEADER - len(header))
                pp.send(xp.asarray(np.array(header, np.int64)), (c + 1) % p, tag)
                failed = failed or bad
            failed = failed or (not first and inp is None)
            shapes[v] = (inp, out)
        if failed:  # after every message of this rank, so no stage waits for one
            raise ConfigError(f"an activation between pipeline stages has more than "
                              f"{_SHAPE_HEADER - 1} dims; at most {_SHAPE_HEADER - 1} can pass")
        self._shapes[key] = shapes
        return shapes

    def _run(self, x, y, b, backward):
        st, pp, m, xp = self.stage, self.pp_group, self.micro_batches, self.stage.xp
        x, y = st.local_tokens(x), st.local_tokens(y)  # Ulysses: this sp rank's positions
        x, y = xp.asarray(x), xp.asarray(y)  # host batch -> the model's device (cupy)
        if x.dtype.kind == "f":  # e.g. images: computed in the model's dtype
            x = x.astype(st.dtype, copy=False)
        shapes = self._probe_shapes(x, b)
        ops = self.schedule if backward else [op for op in self.schedule
                                              if op.kind in ("F", "send_act", "recv_act")]
        inputs, outputs, caches, grads = {}, {}, {}, {}  # keyed by (micro-batch, chunk)
        # the dp buckets' callback, passed to each chunk's last backward (and the deferred units)
        ready = (self._start_buckets() if backward and self.overlap_dp and self._dp_active()
                 and self.zero_stage not in (2, 3) else None)
        sends, timeline, now = [], [], time.perf_counter
        self._loss_sum, scale = 0.0, 1.0 / m
        span = trace.span
        p, V = pp.world_size, self.virtual_stages
        for op in ops:
            i, kind, v = op.micro_batch, op.kind, op.chunk
            key = (i, v)
            t0 = now()
            with span(f"pp.{kind}", "pipeline", micro_batch=i, stage=st.stage, chunk=v):
                if kind == "F":
                    inp = x[i * b:(i + 1) * b] if st.chunk_is_first(v) else inputs.pop(key)
                    last = st.chunk_is_last(v)
                    out, cache = st.forward(inp, y[i * b:(i + 1) * b] if last else None, chunk=v)
                    if last:
                        self._loss_sum += out
                    else:
                        outputs[key] = out
                    if backward:
                        caches[key] = cache
                elif kind == "B":
                    dinp = st.backward(caches.pop(key), dout=grads.pop(key, None), scale=scale,
                                       unit_ready=ready if i == self._last_b[v] else None,
                                       chunk=v)
                    if dinp is not None:
                        outputs[key] = dinp
                elif kind.startswith("send_"):  # tag: micro-batch and the receiving chunk
                    to = receiving_chunk(kind, v, st.stage, p)
                    tag = 2 * (i * V + to) + (_ACT if kind == "send_act" else _GRAD)
                    sends.append(pp.send(outputs.pop(key), op.peer, tag, async_op=True))
                else:  # a receive: blocks until the peer's send arrived (CollectiveTimeout)
                    shape = shapes[v][0 if kind == "recv_act" else 1]
                    buf = xp.empty(shape, dtype=st.dtype)
                    into = inputs if kind == "recv_act" else grads
                    tag = 2 * (i * V + v) + (_ACT if kind == "recv_act" else _GRAD)
                    into[key] = pp.recv(buf, op.peer, tag)
            timeline.append((kind, i, t0, now()))
            sends = [w for w in sends if not w.test()]  # let sends in flight progress
        if backward and self.deferred_w:  # after the last send: the stage idles from here on
            t0 = now()
            with span("pp.W", "pipeline", stage=st.stage):
                st.flush_weight_grads(ready)
            timeline.append(("W", -1, t0, now()))
        for w in sends:
            w.wait()
        self.timeline = timeline

    # ---------------------------------------------------------------------------------- optimizer
    def grad_norm(self):
        """Global L2 norm of the gradient (every stage's own parameters, the wte copy counted
        once). Collective over pp_group; the same on every rank."""
        st = self.stage
        total = np.array([self.zero.grad_norm_sq() if self.zero else st.grad_norm_sq()],
                         np.float64)
        if self.pp_group.world_size > 1:
            self.pp_group.all_reduce(total, op="sum")
        return math.sqrt(float(total[0]))

    def step(self, lr=None, max_grad_norm=None, total_norm=None):
        """Clip (to max_grad_norm, by the global norm: total_norm or grad_norm(), collective)
        then update this stage's parameters, and zero the gradients."""
        st = self.stage
        if max_grad_norm is not None:
            norm = self.grad_norm() if total_norm is None else total_norm
            grad = self.zero.grad_shard() if self.zero else st.flat_grad
            clip_grad_norm(grad, max_grad_norm, total_norm=norm)
        if self.zero:  # this rank's shard, then the parameters all-gathered over the replicas
            self.zero.step(lr=lr)
        else:
            self.optimizer.step(st.flat_grad, lr=lr)
        st.zero_grad()

    def zero_grad(self):
        """Drop the accumulated gradients (e.g. an agreed overflow skip). Local."""
        self.stage.zero_grad()

    # ---------------------------------------------------------------------------------- state
    def full_params(self):
        """The whole model's flat parameter vector (one-process GPT layout, num_params) on every
        rank. Collective over pp_group (one all_reduce of num_params elements) and tp."""
        return self._full_of(self.zero.stage_vector() if self.zero else self.stage.flat_data)

    def _full_of(self, local):
        """The one-process flat vector from every stage's `local` (a stage vector: params or an
        optimizer state). Collective over pp_group (an all_reduce of num_params) and tp."""
        st = self.stage
        full = st.xp.zeros(self.num_params, dtype=local.dtype)
        for start, values in st.own_pieces(local[:st.own_size]):
            full[start:start + values.shape[0]] = values
        if self.pp_group.world_size > 1:
            self.pp_group.all_reduce(full, op="sum")
        return full

    def shards(self):
        """Checkpoint pieces: name -> (local 1-D array, global_offset, global_size). "params",
        "adam.m", "adam.v": the stage's range of the one-process flat layout, split evenly over
        the stage's dp x tp ranks (the wte copy is not written: stage 0 holds the same values);
        "adam.step": one int64 held by stage 0's first rank. Together the world's pieces cover
        each tensor once, so the checkpoint loads at any layout. Collective on tp (gathers)."""
        st, n = self.stage, self.num_params
        state = self.zero.full_state() if self.zero else self.optimizer.state_dict()
        dp_rank, dp = ((0, 1) if self.dp_group is None
                       else (self.dp_group.rank, self.dp_group.world_size))
        w, writers = st.tp_rank * dp + dp_rank, st.tp * dp
        out = {}
        params = self.zero.stage_vector() if self.zero else st.flat_data
        for name, local in (("params", params), ("adam.m", state["m"]),
                            ("adam.v", state["v"])):
            if self.virtual_stages > 1:  # V ranges a rank: whole vectors, 1/world of each a rank
                full, p = self._full_of(local), self.pp_group.world_size
                r = self.pp_group.rank * writers + w
                lo, hi = even_range(n, p * writers, r)
                out[name] = (full[lo:hi].copy(), lo, n)
                continue
            start, values = st.own_full(local[:st.own_size])
            k = values.shape[0]
            lo, hi = even_range(k, writers, w)
            out[name] = (values[lo:hi], start + lo, n)
        first = self.pp_group.rank == 0 and w == 0
        out["adam.step"] = (np.full(1 if first else 0, state["step"], np.int64), 0, 1)
        return out

    def load_shards(self, read):
        """Load parameters and optimizer state from a checkpoint of any layout: read(name, offset,
        length) -> 1-D array of the one-process flat vector's elements (rtxmpi.checkpoint's
        Checkpoint.read). Reads the stage's range and wte for the copy, with the same number of
        read calls (7) on every rank, so a collective reader works. Collective when `read` is;
        drops accumulated gradients. Raises CheckpointError when read returns the wrong length."""
        st, tied = self.stage, self.tied_indices
        state = {"step": int(read_range(read, "adam.step", 0, 1)[0]),
                 "m": st.load_from(read, "adam.m", tied), "v": st.load_from(read, "adam.v", tied)}
        params = st.load_from(read, "params", tied)
        if self.zero:
            self.zero.load_params(params)
            self.zero.load_full_state(state)
        else:
            st.flat_data[...] = params
            self.optimizer.load_state_dict(state)
        st.zero_grad()

    def memory_bytes(self):
        """{"params", "grads", "optimizer", "total"}: bytes of model state this rank holds for
        its stage (own range and tied copies): parameters and gradients whole, or only this
        rank's shards at ZeRO stage 3; the optimizer's arrays (sharded at stages 1-3).
        Activations and transient buffers are not counted. Local."""
        if self.zero:
            return self.zero.memory_bytes()
        st = self.stage
        params, grads = st.flat_data.nbytes, st.flat_grad.nbytes
        optimizer = optimizer_bytes(self.optimizer)
        return {"params": int(params), "grads": int(grads), "optimizer": int(optimizer),
                "total": int(params + grads + optimizer)}


def _pipeline_layout(pp, micro_batches, schedule, zero_stage, offload, virtual_stages):
    return Layout(1, 1, pp, 1, micro_batches, zero_stage, schedule, offload,
                  virtual_stages=virtual_stages)


def auto_micro_batches(*, pp, per_rank_batch, schedule, n_layer, zero_stage=0, offload="none",
                       virtual_stages=1):
    """`--micro-batches auto` (rtxmpi.parallel.layout.auto_micro_batches) for these pipeline
    settings: 1 with pp == 1; else the smallest multiple of pp dividing per_rank_batch, else the
    smallest divisor the schedule accepts. Raises ConfigError naming every problem of these
    settings (Layout.check), or naming the per-rank batch."""
    layout = _pipeline_layout(pp, 1, schedule, zero_stage, offload, virtual_stages)
    return layout_auto_micro_batches(layout, max(pp, 1), ModelFacts(n_units=n_layer),
                                     per_rank_batch)


def build_pipeline(cfg, group, *, dp=None, pp, tp=1, sp=1, micro_batches, schedule="1f1b", split=None,
                   seed=0, dtype=np.float32, sequence_parallel=False, optimizer=None,
                   bucket_bytes=DEFAULT_BUCKET_BYTES, xp=np, zero_stage=0, virtual_stages=1,
                   recompute="none", model=None):
    """The mesh (dp x pp x tp x sp) and PipelineParallel engine for a training job: builds the
    GPT (a ParallelGPT when tp or sp > 1, optionally with Megatron sequence_parallel) from (cfg, seed),
    or calls model(mesh) for another Model (cfg then unused; a TensorParallelModel on the mesh
    when tp or sp > 1), keeps this rank's stage and drops the rest. recompute: the Model's
    activation recomputation policy ("none", "blocks": every unit between the first and the head
    reruns its forward in its stage's backward). Returns the engine (engine.mesh, engine.model =
    its stage). Collective on `group`. Raises ConfigError on every rank (layout, schedule, split,
    recompute, a model that does not divide by tp or sp)."""
    Layout(dp, tp, pp, sp, micro_batches, zero_stage, schedule, recompute=recompute,
           virtual_stages=virtual_stages, sequence_parallel=sequence_parallel).check(
        group.world_size, None if model is not None else no_positions(cfg))
    mesh = DeviceMesh(dp=dp, tp=tp, pp=pp, sp=sp, group=group)
    if model is not None:
        model = model(mesh)
    elif tp > 1 or sp > 1:
        model = ParallelGPT(cfg, mesh, seed=seed, xp=xp, dtype=dtype,
                            sequence_parallel=sequence_parallel)
    else:
        model = GPT(cfg, seed=seed, xp=xp, dtype=dtype)  # xp: numpy or cupy
    model.recompute = recompute
    return PipelineParallel.from_mesh(model, mesh, micro_batches=micro_batches, schedule=schedule,
                                      split=split, optimizer=optimizer,
                                      bucket_bytes=bucket_bytes, zero_stage=zero_stage,
                                      virtual_stages=virtual_stages)
