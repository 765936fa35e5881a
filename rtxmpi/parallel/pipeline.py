"""Pipeline parallelism: a GPT's layers split into contiguous stages, micro-batches run by a
schedule (GPipe or 1F1B, rtxmpi.parallel.schedule), activations and their gradients exchanged with
send/recv on the `pp` group.

Source: GPipe (Huang et al., NeurIPS 2019), PipeDream-Flush / 1F1B (Narayanan et al., SC 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"), Megatron-LM's
embedding group for tied input/output embeddings.

Layout. The GPT's units (embeddings, blocks 0..L-1, head; rtxmpi.nn.gpt) are split by blocks:
`stage_layout` partitions the L blocks into pp contiguous non-empty groups (balanced by estimated
compute, `stage_costs`: the embeddings counted with the first block and the head with the last; or a given
`split` of blocks per stage); stage 0 also holds the embeddings, the last stage the head. A stage's
parameters are therefore one contiguous range [flat_start, flat_stop) of the GPT's flat layout,
which the stage keeps in its own flat buffers (1/pp of the memory). With tied embeddings and
pp > 1 the last stage also keeps a copy of wte for the output head, appended after its range; after
each backward the two wte gradients are summed over the two ranks that hold them (the "embedding
group", first and last stage of each pipeline), so both copies receive the same update and stay
identical (they start identical: copied from the same model and broadcast from stage 0).

Additions: dp gradient buckets reduced while the stage's last backward runs, ZeRO 1/2 per stage
(pipeline_zero.py), Ulysses (sp) stages, the last stage's deferred weight gradients, and
interleaved 1F1B over virtual stages (ChunkedStage); see docs/pipeline.md.

Step. `train_step(x, y)` splits this rank's batch into micro_batches equal micro-batches and runs
its stage's op list: F/B of a micro-batch, blocking receives, non-blocking sends (completed at the
end of the step). The loss of each micro-batch is scaled by 1/micro_batches, so the gradient is
that of the mean loss over this rank's batch; then gradients are summed over the embedding group
and averaged over the dp group, i.e. over the whole global batch (the one-process gradient). The
returned loss is the global mean, the same on every rank.

Checks before anything is sent: the constructor validates the layout and builds and simulates the
whole schedule of every stage (`check_schedule`) on every rank; `train_step` checks the batch shape
against micro_batches, seq_len and vocab_size on each rank and agrees on the verdict (one 1-byte
all_reduce over every rank of the step), so a bad setting or a bad batch on any one rank raises
ConfigError (a ValueError) on every rank, naming the offending ranks, and nothing is sent.
"""
import math
import time

import numpy as np

from ..control import raise_if_any_failed
from ..errors import ConfigError
from ..mesh import DeviceMesh
from ..nn import layers
from ..nn.gpt import GPT, param_layout
from ..nn.optim import AdamW, clip_grad_norm, grad_norm_sq
from ..nn.params import bind, decay_mask, layout
from ..observe import trace
from . import tensor as tpl
from .data import DEFAULT_BUCKET_BYTES, BucketReducer, build_buckets
from .hybrid import ParallelGPT
from .layout import Layout, ModelFacts, no_positions
from .layout import auto_micro_batches as layout_auto_micro_batches
from .pipeline_zero import StageZero
from .zero import even_range, read_range
from .schedule import build_schedule, partition, receiving_chunk

_ACT, _GRAD = 0, 1  # message kinds; tag = 2 * micro_batch + kind


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


class _WholeSequence:
    """Engine hooks of a stage that runs every position of the sequence (no tp / sp split)."""

    def activation_shape(self, b, T):
        """Shape of the activation exchanged between stages for a micro-batch of b x T."""
        return (b, T, self.cfg.n_embd)

    def check_positions(self, T):
        """Raise ConfigError when this stage cannot take T positions (nothing to check here)."""

    def local_tokens(self, a):
        """This rank's positions of a (B, T) id array (all of them here)."""
        return a


class PipelineStage(_WholeSequence):
    """The part of a GPT that one pipeline stage holds and runs, on its own flat buffers.

    model: a GPT (rtxmpi.nn.GPT) whose parameters are copied (the caller may drop it afterwards);
    stage, stages: this stage's index and the pipeline depth; blocks: (first, stop) block range.
    Attributes: cfg, stage, stages, is_first, is_last, blocks, param_start / param_stop (indices in
    the GPT's param list), flat_start / flat_stop (range in the GPT's flat layout), tied_copy (True
    when the last stage holds a wte copy for the head), params (list[Param] on the stage's own
    buffers, the GPT's names), flat_data, flat_grad (1-D; the copy, if any, at the end), num_params.

    forward(inp, targets) -> (out, cache): inp is (B, T) token ids on stage 0, else the (B, T, C)
    activation of the previous stage; out is the (B, T, C) activation for the next stage, or on
    the last stage the micro-batch's mean cross-entropy (Python float; targets (B, T) ids needed).
    backward(cache, dout=None, scale=1.0) -> dinp: adds the parameter gradients (of scale * loss on
    the last stage, else given dout = d loss / d out) into flat_grad; returns d loss / d inp, or
    None on stage 0. Local: no communication.
    """

    def __init__(self, model, stage, stages, blocks):
        cfg = model.cfg
        self.cfg, self.stage, self.stages, self.blocks = cfg, stage, stages, tuple(blocks)
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self.xp, self.dtype = model.xp, model.dtype
        first, stop = blocks
        self.param_start = 0 if self.is_first else 2 + 12 * first
        self.param_stop = len(model.params) if self.is_last else 2 + 12 * stop
        own = model.params[self.param_start:self.param_stop]
        self.flat_start, self.flat_stop = own[0].offset, own[-1].offset + own[-1].size
        self.tied_copy = cfg.tie_embeddings and self.is_last and not self.is_first
        entries = [(p.name, p.shape, p.decay) for p in own]
        if self.tied_copy:
            entries.append(("wte.head_copy", model.params[0].shape, True))
        specs = layout(entries)
        xp = self.xp
        self.num_params = specs[-1].stop
        self.flat_data = xp.empty(self.num_params, dtype=self.dtype)
        self.flat_data[:self.flat_stop - self.flat_start] = model.flat_data[self.flat_start:self.flat_stop]
        if self.tied_copy:
            self.flat_data[self.flat_stop - self.flat_start:] = model.params[0].data.reshape(-1)
        self.flat_grad = xp.zeros(self.num_params, dtype=self.dtype)
        self.params = bind(specs, self.flat_data, self.flat_grad)
        self.own_size = self.flat_stop - self.flat_start  # without the wte copy
        base = 2 if self.is_first else 0  # local index of block `first`'s first parameter
        self._blocks = [self.params[base + 12 * k: base + 12 * (k + 1)] for k in range(stop - first)]
        if self.is_last:
            k = base + 12 * (stop - first)
            self._ln_f = self.params[k:k + 2]
            if not cfg.tie_embeddings:
                self._head = self.params[k + 2]
            else:
                self._head = self.params[-1] if self.tied_copy else self.params[0]
        self.wte = self.params[0] if self.is_first else (self.params[-1] if self.tied_copy else None)
        # units: (start, stop) ranges of flat_grad in flat order (embeddings, each block, head,
        # wte copy); backward finishes them in reverse order and reports each (unit_ready)
        bounds = ([2] if self.is_first else []) + [base + 12 * (k + 1) for k in range(stop - first)]
        if self.is_last:
            bounds.append(len(own))
        if self.tied_copy:
            bounds.append(len(self.params))
        starts = [0] + bounds[:-1]
        self.units = [(self.params[a].offset, self.params[b - 1].offset + self.params[b - 1].size)
                      for a, b in zip(starts, bounds)]
        self.defer_w, self.held_units, self._deferred = False, (), []
        self.full_specs = param_layout(cfg)
        self.full_start, self.full_stop = self.flat_start, self.flat_stop  # the same layout here
        self.tp, self.tp_rank = 1, 0

    def zero_grad(self):
        """Set flat_grad (own range and the wte copy) to 0. Local."""
        self.flat_grad.fill(0)

    def defer_weight_grads(self):
        """On the last stage of a pipeline: from now on its backward computes the head's weight
        gradient and its last block's MLP weight gradients later, in `flush_weight_grads`, which
        the engine runs after the stage's last op (the stage then idles while the others drain
        the pipeline). Balances the last stage, whose head and loss cost about 15% of a block
        on top of its blocks, against the others (the B/W split of Qi et al., "Zero Bubble
        Pipeline Parallelism", ICLR 2024, used only to fill the last stage's drain). Costs memory:
        the inputs of the deferred products of every micro-batch are kept until the flush.
        Returns True when enabled (the last stage of a pipeline of 2 or more stages)."""
        if not self.is_last or self.is_first:
            return False
        n = len(self.units)
        # the wte copy (if any), the head and the last block: final only after the flush
        self.defer_w, self.held_units = True, tuple(range(n - 1, n - 3 - self.tied_copy, -1))
        return True

    def flush_weight_grads(self, unit_ready=None):
        """Run the deferred weight-gradient products in micro-batch order (the same sums, in
        the same order, as without deferral: bitwise the same gradients), then report the held
        units to unit_ready (last unit first).

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

    # hooks the engine uses (activation_shape, check_positions, local_tokens: _WholeSequence),
    # so that a tensor-parallel stage can differ ----------------------------------------------
    def chunk_is_first(self, chunk):
        """Whether model chunk `chunk` of this rank is the pipeline's first (reads token ids)."""
        return self.is_first

    def chunk_is_last(self, chunk):
        """Whether model chunk `chunk` of this rank is the pipeline's last (computes the loss)."""
        return self.is_last

    def own_pieces(self, local_own):
        """[(full_start, values)]: this rank's own-range vector (own_size) as pieces of the
        one-process flat layout (one piece here; a ChunkedStage has one per chunk)."""
        return [self.own_full(local_own)]

    def grad_norm_sq(self):
        """Squared L2 norm of the stage's own gradient (the wte copy not counted). Local."""
        return grad_norm_sq(self.flat_grad[:self.own_size])

    def own_full(self, local_own):
        """(full_start, values): the one-process flat layout's [full_start, full_stop) from this
        rank's own-range vector (own_size). Local here (the layouts coincide)."""
        return self.full_start, local_own

    def load_from(self, read, name):
        """This rank's whole stage vector (num_params: own range, then the wte copy) from the
        one-process flat vector `name`: exactly two read(name, offset, length) calls on every
        rank (the second of length 0 without a wte copy), as a collective reader needs."""
        copy = self.num_params - self.own_size
        out = self.xp.empty(self.num_params, dtype=self.dtype)
        out[:self.own_size] = self.xp.asarray(
            read_range(read, name, self.flat_start, self.own_size), dtype=self.dtype)
        out[self.own_size:] = self.xp.asarray(read_range(read, name, 0, copy), dtype=self.dtype)
        return out

    def forward(self, inp, targets=None, chunk=0):
        """Forward of this stage for one micro-batch (B = micro-batch rows, T positions, C =
        n_embd). inp: (B, T) integer token ids on the first stage, else the (B, T, C) activation
        received from the previous stage (the model dtype). targets: (B, T) ids, used on the
        last stage only. chunk: ignored (one chunk). Returns (out, cache): out is the (B, T, C)
        activation for the next stage, or on the last stage the micro-batch's mean cross-entropy
        in nats (Python float); cache is for `backward`. Local: no communication."""
        caches = {}
        if self.is_first:
            x, caches["emb"] = layers.embedding_forward(inp, self.params[0].data, self.params[1].data)
        else:
            x = inp
        caches["blocks"] = []
        for ps in self._blocks:
            x, c = layers.block_forward(x, [p.data for p in ps], self.cfg.n_head)
            caches["blocks"].append(c)
        if not self.is_last:
            return x, caches
        g, b = self._ln_f
        h, caches["ln_f"] = layers.layernorm_forward(x, g.data, b.data)
        logits, caches["head"] = layers.linear_forward(h, self._head.data.T)
        loss, caches["ce"] = layers.crossentropy_forward(logits, targets)
        return float(loss), caches

    def backward(self, cache, dout=None, scale=1.0, unit_ready=None, chunk=0):
        """Backward of one micro-batch: ADDS the parameter gradients into flat_grad.

        cache: from `forward`. dout: (B, T, C) d loss / d out received from the next
        stage (None on the last stage, which starts from its loss). scale: the loss weight
        (1 / micro_batches in the engine). unit_ready: None, or callable(u) called once per unit
        u (index into `units`) as soon as that unit's gradient for this backward is final, last
        unit first, except the units held for flush_weight_grads (deferred weight gradients);
        the engine passes its dp bucket callback only to the step's last backward of the stage.
        chunk: ignored. Returns d loss / d inp, (B, T, C), or None on the first stage. Local (the
        callback may start collectives: PipelineParallel._start_buckets)."""
        ready = _Countdown(len(self.units), unit_ready, hold=self.held_units)
        defer = self._deferred if self.defer_w else None
        if self.is_last:
            dlogits = layers.crossentropy_backward(scale, cache["ce"])
            dh, _, _ = layers.linear_backward(dlogits, cache["head"], dw_out=self._head.grad.T,
                                              defer=defer)
            g, b = self._ln_f
            dx, _, _ = layers.layernorm_backward(dh, cache["ln_f"], g.grad, b.grad)
            ready.head(self)
        else:
            dx = dout
        for k, (ps, c) in enumerate(zip(reversed(self._blocks), reversed(cache["blocks"]))):
            dx, _ = layers.block_backward(dx, c, [p.grad for p in ps],
                                          defer=defer if k == 0 else None)
            ready()
        if self.is_first:
            layers.embedding_backward(dx, cache["emb"], self.params[0].grad, self.params[1].grad)
            ready()
            return None
        return dx


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


class _Countdown:
    """Reports a stage's units as final, last unit first (the order backward finishes them),
    except the units in `hold` (deferred weight gradients: reported by flush_weight_grads).

    n_units: len(stage.units); unit_ready: None (nothing reported) or callable(u), u an int index
    into stage.units; hold: unit indices not to report. Each call marks the next unit (counting
    down from n_units - 1) final. Local."""

    def __init__(self, n_units, unit_ready, hold=()):
        self.next, self.unit_ready, self.hold = n_units - 1, unit_ready, hold

    def __call__(self):
        if self.unit_ready is not None and self.next not in self.hold:
            self.unit_ready(self.next)
        self.next -= 1

    def head(self, stage):
        """After the head's backward: the wte copy (if any) and the head unit are final (on a
        one-stage pipeline with tied embeddings wte is in unit 0, final after the embeddings)."""
        if stage.tied_copy:
            self()
        self()


class TensorParallelStage(PipelineStage):
    """A pipeline stage of a ParallelGPT (rtxmpi.parallel.hybrid): the stage's blocks with
    Megatron tensor parallelism over the model's tp group and Ulysses attention over its sp group.

    model: ParallelGPT on a mesh (any tp, sp); its parameters of this stage are copied into the
    stage's own flat buffers and the model's Param views are re-pointed at them (the model's own
    flat buffers, and every other stage's parameters, are dropped), so the model's parallel
    units run on the stage's buffers. flat_start / flat_stop are the range in this tp rank's
    local layout; full_start / full_stop in the one-process GPT layout. forward/backward as
    PipelineStage, collective on the tp group (every tp rank of the stage calls them in the same
    order); activations between stages are (B, T/tp, C) under sequence_parallel, else (B, T, C).
    """

    def __init__(self, model, stage, stages, blocks):
        super().__init__(model, stage, stages, blocks)
        self.model, self.tp, self.tp_rank = model, model.tp, model.tp_rank
        self.tp_group = model.tp_group
        full = model.full_specs
        self.full_start = full[self.param_start].offset
        self.full_stop = full[self.param_stop - 1].offset + full[self.param_stop - 1].size
        own = self.params[:self.param_stop - self.param_start]
        for k, p in enumerate(model.params):
            if self.param_start <= k < self.param_stop:
                mine = own[k - self.param_start]
                p.data, p.grad = mine.data, mine.grad
            elif k == 0 and self.tied_copy:
                p.data, p.grad = self.params[-1].data, self.params[-1].grad
            else:
                p.data = p.grad = None
        model.flat_data = model.flat_grad = None
        self._wte_local = (model.params[0].offset, model.params[0].offset + model.params[0].size)

    def activation_shape(self, b, T):
        Ts = T // self.model.sp
        return (b, Ts // self.tp if self.model.sequence_parallel else Ts, self.cfg.n_embd)

    def check_positions(self, T):
        sp = self.model.sp
        if T % sp:
            raise ConfigError(f"T={T} positions are not divisible by sp({sp}) (Ulysses splits "
                              f"each sample's positions over sp); use a multiple of {sp}")
        if self.model.sequence_parallel and (T // sp) % self.tp:
            raise ConfigError(f"sequence_parallel: T={T} positions are not divisible by "
                              f"sp({sp}) * tp({self.tp}); use a sequence length divisible by "
                              f"{sp * self.tp}")

    def local_tokens(self, a):
        """Positions [sp_rank * Ts, (sp_rank + 1) * Ts) of a (B, T) array, Ts = T / sp."""
        sp = self.model.sp
        if sp == 1:
            return a
        Ts = a.shape[1] // sp
        return a[:, self.model.sp_rank * Ts:(self.model.sp_rank + 1) * Ts]

    # the model's units one by one (TensorParallelModel.unit_forward / unit_backward): unit 0 the
    # embeddings, unit l + 1 block l, the last the head
    def forward(self, inp, targets=None, chunk=0):
        """As PipelineStage.forward, on this tp/sp rank's part: inp is this rank's (B, Ts) ids
        on the first stage (Ts = T / sp, local_tokens), else the activation_shape(B, T) array
        from the previous stage; targets (B, Ts) on the last stage. Returns (activation_shape
        array or the loss over this rank's positions, cache). Collective on the tp group (and sp
        with Ulysses): every tp rank of the stage calls it in the same order."""
        m = self.model
        caches = {}
        if self.is_first:
            x, caches["emb"] = m.unit_forward(0, inp)
        else:
            x = inp
        caches["blocks"] = []
        for l in range(*self.blocks):
            x, c = m.unit_forward(l + 1, x)
            caches["blocks"].append(c)
        if not self.is_last:
            return x, caches
        y, c = m.unit_forward(len(m.units) - 1, x)
        loss, loss_cache = m.modules[-1].loss_forward(y, targets)
        caches["head"] = (c, loss_cache)
        return float(loss), caches

    def backward(self, cache, dout=None, scale=1.0, unit_ready=None, chunk=0):
        """As PipelineStage.backward, on this tp rank's shards: dout and the returned gradient
        are activation_shape(B, T) arrays; unit_ready(u) is called once per unit, last first (no
        deferred units here). Collective on the tp group (and sp with Ulysses): every tp rank of
        the stage calls it in the same order."""
        m, ready = self.model, _Countdown(len(self.units), unit_ready)
        if self.is_last:
            c, loss_cache = cache["head"]
            dy = m.modules[-1].loss_backward(scale, loss_cache)
            dx = m.unit_backward(len(m.units) - 1, dy, c)
            ready.head(self)
        else:
            dx = dout
        first, stop = self.blocks
        for l, c in zip(range(stop - 1, first - 1, -1), reversed(cache["blocks"])):
            dx = m.unit_backward(l + 1, dx, c)
            ready()
        if not self.is_first:
            return dx
        m.unit_backward(0, dx, cache["emb"])
        ready()
        return None

    def grad_norm_sq(self):
        """The full model's squared norm over this stage's parameters: tp-split parts summed over
        tp, replicated ones counted once. Collective on the tp group."""
        total = np.zeros(1, np.float64)
        for lo, hi in tpl.norm_ranges(self.params[:self.param_stop - self.param_start],
                                      self.tp_rank):
            total[0] += grad_norm_sq(self.flat_grad[lo:hi])
        if self.tp > 1:
            self.tp_group.all_reduce(total)
        return float(total[0])

    def _local_full(self, local_own):
        out = self.xp.zeros(self.model.num_params, dtype=local_own.dtype)
        out[self.flat_start:self.flat_stop] = local_own
        return out

    def own_full(self, local_own):
        """Collective on the tp group (one all_gather of this rank's local layout)."""
        full = self.model.gather_full(self._local_full(local_own))
        return self.full_start, full[self.full_start:self.full_stop]

    def load_from(self, read, name):
        n_full = self.full_specs[-1].stop
        full = self.xp.zeros(n_full, dtype=self.dtype)
        full[self.full_start:self.full_stop] = self.xp.asarray(
            read_range(read, name, self.full_start, self.full_stop - self.full_start), dtype=self.dtype)
        wte = self.full_specs[0].size if self.tied_copy else 0  # two reads on every rank
        full[:wte] = self.xp.asarray(read_range(read, name, 0, wte), dtype=self.dtype)
        local = self.model.local_from_full(full)
        out = self.xp.empty(self.num_params, dtype=self.dtype)
        out[:self.own_size] = local[self.flat_start:self.flat_stop]
        if self.tied_copy:
            out[self.own_size:] = local[self._wte_local[0]:self._wte_local[1]]
        return out


class ChunkedStage(_WholeSequence):
    """The V model chunks one rank runs under the interleaved schedule, on one flat buffer.

    model: a GPT (rtxmpi.nn.GPT; tensor- or sequence-parallel chunks are not supported);
    stage, stages: this rank and the pipeline depth p; chunk_blocks: V (first, stop) block ranges,
    chunk v being virtual stage v * p + stage of the p * V (stage_layout over p * V). Each chunk is
    a PipelineStage of the p * V virtual stages (chunk 0 of rank 0 holds the embeddings, chunk
    V - 1 of rank p - 1 the head and, tied, the wte copy); their parameters live in one flat
    buffer, chunk after chunk (the copy last), so the optimizer, gradient buckets, ZeRO and the
    gradient norm see one vector as for a PipelineStage. Attributes as PipelineStage (params,
    flat_data, flat_grad, num_params, own_size, units, wte, tied_copy, is_first / is_last: this
    rank holds the first / last virtual stage) plus chunks. Local: no communication.
    """

    def __init__(self, model, stage, stages, chunk_blocks):
        V = len(chunk_blocks)
        self.chunks = [PipelineStage(model, v * stages + stage, stages * V, blocks)
                       for v, blocks in enumerate(chunk_blocks)]
        first, last = self.chunks[0], self.chunks[-1]
        self.cfg, self.stage, self.stages, self.xp, self.dtype = (model.cfg, stage, stages,
                                                                  model.xp, model.dtype)
        self.is_first, self.is_last, self.tied_copy = first.is_first, last.is_last, last.tied_copy
        self.tp, self.tp_rank = 1, 0
        self.full_specs = first.full_specs
        entries, self.segments, at = [], [], 0
        for ch in self.chunks:
            entries += [(p.name, p.shape, p.decay) for p in ch.params]
            self.segments.append(at)
            at += ch.num_params
        specs = layout(entries)
        self.num_params = specs[-1].stop
        self.flat_data = self.xp.empty(self.num_params, dtype=self.dtype)
        self.flat_grad = self.xp.zeros(self.num_params, dtype=self.dtype)
        self.params = bind(specs, self.flat_data, self.flat_grad)
        self.units, k = [], 0
        for ch, base in zip(self.chunks, self.segments):  # re-point each chunk at its segment
            self.flat_data[base:base + ch.num_params] = ch.flat_data
            for p in ch.params:
                p.data, p.grad = self.params[k].data, self.params[k].grad
                k += 1
            ch.flat_data = self.flat_data[base:base + ch.num_params]
            ch.flat_grad = self.flat_grad[base:base + ch.num_params]
            self.units += [(a + base, b + base) for a, b in ch.units]
        self.own_size = self.num_params - (last.num_params - last.own_size)
        self.wte = first.wte if self.is_first else (last.wte if self.tied_copy else None)
        self.defer_w, self.held_units = False, ()
        self._unit_base = [sum(len(c.units) for c in self.chunks[:v]) for v in range(V)]

    def zero_grad(self):
        """Set flat_grad (every chunk, and the wte copy) to 0. Local."""
        self.flat_grad.fill(0)

    def chunk_is_first(self, chunk):
        """Whether chunk `chunk` (int in [0, V)) is virtual stage 0 (reads token ids). Local."""
        return self.chunks[chunk].is_first

    def chunk_is_last(self, chunk):
        """Whether chunk `chunk` (int in [0, V)) is the last virtual stage (computes the loss).
        Local."""
        return self.chunks[chunk].is_last

    def grad_norm_sq(self):
        """Squared L2 norm (Python float, accumulated in float64) of the rank's own gradient
        (every chunk; the wte copy not counted). Local: the engine sums it over pp."""
        return grad_norm_sq(self.flat_grad[:self.own_size])

    def own_pieces(self, local_own):
        """[(full_start, values)] per chunk, in chunk order: local_own is a 1-D (own_size,)
        vector in this rank's layout (flat_data[:own_size], or an optimizer moment); values is
        chunk v's slice of it (a view), full_start where it begins in the one-process GPT flat
        layout (rtxmpi.nn.gpt.param_layout). Local."""
        return [(ch.flat_start, local_own[base:base + ch.own_size])
                for ch, base in zip(self.chunks, self.segments)]

    def load_from(self, read, name):
        """The rank's whole vector, (num_params,) in the model dtype: every chunk's range, then
        the wte copy, from the one-process flat vector `name` through read(name, offset, length)
        (a checkpoint reader): V + 1 read calls on every rank (the last of length 0 without a
        copy), as a collective reader needs. Raises a typed error naming the call when read
        returns another shape, and what read raises (CheckpointError)."""
        out = self.xp.empty(self.num_params, dtype=self.dtype)
        for ch, base in zip(self.chunks, self.segments):
            out[base:base + ch.own_size] = self.xp.asarray(
                read_range(read, name, ch.flat_start, ch.own_size), dtype=self.dtype)
        copy = self.num_params - self.own_size
        out[self.own_size:] = self.xp.asarray(read_range(read, name, 0, copy), dtype=self.dtype)
        return out

    def forward(self, inp, targets=None, chunk=0):
        """Forward of chunk `chunk` (int in [0, V)) for one micro-batch: PipelineStage.forward
        of that chunk (inp (B, T) ids on virtual stage 0, else (B, T, C) activations; returns
        (out, cache), out the loss on the last virtual stage). Local."""
        return self.chunks[chunk].forward(inp, targets)

    def backward(self, cache, dout=None, scale=1.0, unit_ready=None, chunk=0):
        """Backward of chunk `chunk`: PipelineStage.backward of that chunk, adding into its
        segment of flat_grad. unit_ready(u), if given, receives u as an index into this rank's
        `units` (the chunk's own unit index plus the units of the chunks before it), once per
        unit of the chunk, last first. Returns (B, T, C) d loss / d inp, or None on virtual
        stage 0. Local (the callback may start the dp all_reduce)."""
        base = self._unit_base[chunk]
        ready = None if unit_ready is None else (lambda u: unit_ready(base + u))
        return self.chunks[chunk].backward(cache, dout=dout, scale=scale, unit_ready=ready)


class PipelineParallel:
    """Train a GPT split into pipeline stages over `pp_group`, replicated over `dp_group`.

    model: GPT (rtxmpi.nn.GPT), the same config and seed on every rank; this rank copies its
    stage's parameters (stage = pp_group.rank) and the caller may drop the model. Or a
    ParallelGPT (rtxmpi.parallel.hybrid): tensor- and/or Ulysses-parallel stages
    (TensorParallelStage; every collective then also involves the model's tp and sp groups).
    pp_group: ProcessGroup of the pipeline (group rank = stage). dp_group: ProcessGroup of the
    replicas of this stage that see different tokens (None: no data parallelism): the dp ranks,
    and with sp > 1 the sp ranks too (mesh.loss_group); every replica runs the same schedule on
    its own tokens, and gradients and loss are averaged over it.
    bucket_bytes: dp gradient bucket size (whole units: blocks, embeddings, head); each bucket's
    all_reduce starts during the stage's last backward (overlap_dp=True) or after the schedule.
    micro_batches: m, micro-batches per step on each pipeline (>= 1; >= pp for 1F1B; a multiple
    of pp for interleaved). schedule: "1f1b" (default), "gpipe" or "interleaved" (with
    virtual_stages = V >= 2 plain-GPT chunks a rank: ChunkedStage). split: blocks per (virtual)
    stage (see stage_layout), None: balanced by estimated compute. optimizer: callable(params_flat,
    decay_mask) -> AdamW-like (default AdamW(lr=3e-4)); it updates this stage's flat_data (own
    range and the wte copy), or with zero_stage 1 or 2 only this rank's shard of it
    (rtxmpi.parallel.pipeline_zero.StageZero over dp_group). defer_weight_grads: the last stage of
    a plain-GPT pipeline (V = 1) computes its head's and last block's MLP weight gradients after
    its last op (PipelineStage.defer_weight_grads; bitwise the same gradients).
    Construction broadcasts the stage's parameters from dp rank 0 and the tied wte from stage 0
    to the last stage, so every copy starts identical.

    Collective: every rank of pp_group and dp_group must construct it and call train_step / step /
    grad_norm / eval_loss the same number of times in the same order, with same-shaped batches.
    Raises ConfigError on every rank (before any send) for an unknown schedule, pp > n_layer,
    micro_batches < 1 or < pp with 1F1B, a split that does not fit, a schedule that fails
    check_schedule, ZeRO stage 3, virtual stages with tp or sp.

    Attributes: stage (PipelineStage, TensorParallelStage or ChunkedStage), model (the same stage: dtype,
    num_params, full_specs, as train.py reads a model), mesh (from_mesh), num_params (the whole
    one-process model's), embed_group, optimizer, schedule (this stage's op list), schedules (every stage's),
    layouts (blocks per stage), micro_batches, timeline (after train_step: list of (kind,
    micro_batch, start_s, stop_s) per op of this rank, perf_counter seconds; recv spans are the
    time blocked waiting; "dp_wait": the wait for the dp reduction after the schedule, "W": the
    deferred weight gradients), buckets (dp gradient buckets), zero (StageZero or None).
    """

    def __init__(self, model, pp_group, dp_group=None, *, micro_batches, schedule="1f1b",
                 split=None, optimizer=None, bucket_bytes=DEFAULT_BUCKET_BYTES, overlap_dp=True,
                 zero_stage=0, defer_weight_grads=True, virtual_stages=1):
        if not isinstance(model, (GPT, ParallelGPT)):
            raise ConfigError(f"PipelineParallel needs an rtxmpi.nn.GPT or a ParallelGPT, got "
                              f"{type(model).__name__}")
        if isinstance(model, ParallelGPT) and model.sp > 1 and (
                dp_group is None or dp_group.world_size % model.sp):
            raise ConfigError(f"with sp({model.sp}) > 1 the replica group must hold the sp ranks "
                              f"(mesh.loss_group = group('dp', 'sp')), got "
                              f"{getattr(dp_group, 'world_size', None)} ranks")
        p = pp_group.world_size
        self.pp_group, self.dp_group = pp_group, dp_group
        self.micro_batches, self.schedule_name = micro_batches, schedule
        V = self.virtual_stages = virtual_stages
        if isinstance(V, bool) or not isinstance(V, int) or V < 1:
            raise ConfigError(f"virtual_stages must be an int >= 1, got {V!r}")
        if V != 1 and isinstance(model, ParallelGPT):
            raise ConfigError(f"virtual stages ({V}, the interleaved schedule) run plain GPT "
                              "chunks only; use tp = sp = 1 or the 1f1b/gpipe schedule")
        self.layouts = stage_layout(model.cfg, p * V, split)  # blocks per virtual stage
        self.schedules = build_schedule(schedule, micro_batches, p, V)  # every stage's, checked
        self.schedule = self.schedules[pp_group.rank]
        s = pp_group.rank
        if V > 1:  # chunk v = virtual stage v * p + s
            self.stage = ChunkedStage(model, s, p, [self.layouts[v * p + s] for v in range(V)])
        else:
            stage_type = TensorParallelStage if isinstance(model, ParallelGPT) else PipelineStage
            self.stage = stage_type(model, s, p, self.layouts[s])
        self.cfg = model.cfg
        self.num_params = self.stage.full_specs[-1].stop  # the one-process model's
        self.full_specs = param_layout(model.cfg)  # the GPT's flat layout (checkpoint metadata)
        self.model = self.stage  # what train.py reads as "the model": dtype, num_params, full_specs
        self.mesh = None  # set by from_mesh
        self.timeline = []
        st = self.stage
        # the embedding group: first and last stage (each pipeline), for the tied wte gradient
        self.embed_group = None
        if model.cfg.tie_embeddings and p > 1:
            self.embed_group = pp_group.new_group([0, p - 1])
        if dp_group is not None and dp_group.world_size > 1:
            dp_group.broadcast(st.flat_data, src=0)
        if self.embed_group is not None:
            self.embed_group.broadcast(st.wte.data, src=0)
        make = optimizer or (lambda params, mask: AdamW(params, lr=3e-4, decay_mask=mask))
        self.zero_stage = zero_stage
        if zero_stage:  # ZeRO 1/2 over the stage's replica group (rtxmpi.parallel.pipeline_zero)
            self.zero = StageZero(st, dp_group, zero_stage, make)
            self.optimizer = self.zero.optimizer
        else:
            self.zero = None
            self.optimizer = make(st.flat_data, decay_mask(st.params, xp=st.xp, dtype=st.dtype))
        if not bucket_bytes > 0:
            raise ConfigError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.overlap_dp = bool(overlap_dp)
        self.buckets = stage_buckets(st.units, int(bucket_bytes), st.flat_grad.itemsize)
        # DataParallel's bucket engine over the stage's units; every bucket launches async as it
        # completes (sends and the deferred weight gradients still follow the last backward)
        self.reducer = (BucketReducer(self.buckets, len(st.units), st.flat_grad, dp_group,
                                      op="avg", block_last=False) if self._dp_active() else None)
        # the stage's last backward (micro-batch of the schedule's last B): its gradients are final
        # unit by unit during it, and the dp all_reduce of each bucket starts as soon as it is
        self._last_b = {op.chunk: op.micro_batch for op in self.schedule if op.kind == "B"}
        # the last stage's head and last-block MLP weight gradients run in its drain idle time
        self.deferred_w = (defer_weight_grads and type(st) is PipelineStage
                           and st.defer_weight_grads())

    @classmethod
    def from_mesh(cls, model, mesh, **kwargs):
        """Build over a DeviceMesh (rtxmpi.mesh): pp_group = mesh.group("pp"), dp_group =
        mesh.loss_group (group("dp", "sp"): with Ulysses every sp rank holds the whole stage and
        the loss of its positions, so gradients and loss average over dp x sp). With mesh.tp > 1
        or mesh.sp > 1 the model must be a ParallelGPT on the same mesh. Raises ConfigError when
        tp or sp > 1 with a plain GPT."""
        if (mesh.tp > 1 or mesh.sp > 1) and not isinstance(model, ParallelGPT):
            raise ConfigError(f"pipeline parallelism with tp({mesh.tp}) or sp({mesh.sp}) > 1 needs "
                              "the model as a ParallelGPT on the same mesh "
                              "(rtxmpi.parallel.hybrid)")
        engine = cls(model, mesh.group("pp"), mesh.loss_group, **kwargs)
        engine.mesh = mesh
        return engine

    # ---------------------------------------------------------------------------------- a step
    def _check_batch(self, x, y):
        """Validate this rank's batch, agreed over every rank of the step: (b, T) when every
        rank's batch is good, else ConfigError on EVERY rank naming each offending rank and its
        problem (one 1-byte MAX all_reduce over the mesh's world, or over the pp, dp and tp
        groups in turn, before anything is sent). Collective: every rank of the step calls."""
        error = None
        try:
            b, T = self._check_local_batch(x, y)
        except ConfigError as exc:
            error = exc
        groups = ([self.mesh.world] if self.mesh is not None else
                  [self.pp_group, self.dp_group, getattr(self.stage, "tp_group", None)])
        raise_if_any_failed(groups, error, "pipeline batch check")
        return b, T

    def _check_local_batch(self, x, y):
        """(b, T) of this rank's batch (b = B // micro_batches); ConfigError here only."""
        m = self.micro_batches
        if getattr(x, "ndim", None) != 2 or getattr(y, "shape", None) != x.shape:
            raise ConfigError(f"pipeline batch: x and y must be (B, T) arrays of the same shape, "
                              f"got {getattr(x, 'shape', None)} and {getattr(y, 'shape', None)}")
        B, T = x.shape
        if B % m or B == 0:
            raise ConfigError(f"the per-rank batch {B} is not divisible by micro_batches {m}: every "
                              f"micro-batch must have the same size; use a batch that is a "
                              f"multiple of {m} per data-parallel rank")
        if T > self.cfg.seq_len or T == 0:
            raise ConfigError(f"batch has T={T} positions but the model's seq_len is "
                              f"{self.cfg.seq_len}; use 1 <= T <= seq_len")
        for name, a in (("x", x), ("y", y)):
            if a.dtype.kind not in "iu" or int(a.min()) < 0 or int(a.max()) >= self.cfg.vocab_size:
                raise ConfigError(f"pipeline batch: {name} must hold integer token ids in [0, "
                                  f"{self.cfg.vocab_size}), got dtype {a.dtype}, range "
                                  f"[{a.min()}, {a.max()}]")
        self.stage.check_positions(T)
        return B // m, T

    def train_step(self, x, y):
        """Forward and backward of this rank's batch through the pipeline; gradients accumulate
        into stage.flat_grad (summed over the embedding group, averaged over dp). Returns the
        global mean loss (Python float, the same on every rank).

        x, y: (B, T) integer token ids and targets, this dp replica's slice of the global batch,
        the same on every stage of the pipeline (stage 0 reads x, the last stage y, the others
        only the shape); B divisible by micro_batches. Collective (pp, dp and embedding groups).
        Raises ConfigError (before any send, on every rank of the pp x dp (x tp) step, naming
        each offending rank) when any rank's batch has a bad shape, dtype, length or token id
        (outside [0, vocab_size)); CollectiveTimeout when a peer does not send or receive in time.
        """
        b, T = self._check_batch(x, y)
        self._run(x, y, b, T, backward=True)
        st = self.stage
        t0 = time.perf_counter()
        if self.zero_stage == 2:  # the wte sum on whole gradients, then each rank's shard
            if self.embed_group is not None:
                self.embed_group.all_reduce(st.wte.grad, op="sum")
            with trace.span("pp.dp_wait", "pipeline", stage=st.stage):
                self.zero.reduce_scatter()
        else:
            with trace.span("pp.dp_wait", "pipeline", stage=st.stage):
                self._finish_dp()
            if self.embed_group is not None:  # a sum: commutes with the dp average
                self.embed_group.all_reduce(st.wte.grad, op="sum")
        self.timeline.append(("dp_wait", -1, t0, time.perf_counter()))
        return self._global_loss()

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
        b, T = self._check_batch(x, y)
        self._run(x, y, b, T, backward=False)
        return self._global_loss()

    def forward(self, x, y):
        """Evaluation: (mean loss over this dp replica's batch x, y, None), forward only, the same
        on every stage; x, y as for train_step. Collective over pp_group, and its batch check
        (as train_step's) over every rank of the step: every pipeline of the mesh calls it."""
        b, T = self._check_batch(x, y)
        self._run(x, y, b, T, backward=False)
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

    def _run(self, x, y, b, T, backward):
        st, pp, m, xp = self.stage, self.pp_group, self.micro_batches, self.stage.xp
        shape = st.activation_shape(b, T)
        x, y = st.local_tokens(x), st.local_tokens(y)  # Ulysses: this sp rank's positions
        x, y = xp.asarray(x), xp.asarray(y)  # host batch -> the model's device (cupy)
        ops = self.schedule if backward else [op for op in self.schedule
                                              if op.kind in ("F", "send_act", "recv_act")]
        inputs, outputs, caches, grads = {}, {}, {}, {}  # keyed by (micro-batch, chunk)
        # the dp buckets' callback, passed to each chunk's last backward (and the deferred units)
        ready = (self._start_buckets() if backward and self.overlap_dp and self._dp_active()
                 and self.zero_stage != 2 else None)
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
        return self._full_of(self.stage.flat_data)

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
        for name, local in (("params", st.flat_data), ("adam.m", state["m"]),
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
        st = self.stage
        state = {"step": int(read_range(read, "adam.step", 0, 1)[0]),
                 "m": st.load_from(read, "adam.m"), "v": st.load_from(read, "adam.v")}
        st.flat_data[...] = st.load_from(read, "params")
        if self.zero:
            self.zero.load_full_state(state)
        else:
            self.optimizer.load_state_dict(state)
        st.zero_grad()


def _pipeline_layout(pp, micro_batches, schedule, zero_stage, offload, virtual_stages):
    return Layout(1, 1, pp, 1, micro_batches, zero_stage, schedule, offload,
                  virtual_stages=virtual_stages)


def check_pipeline(*, pp, micro_batches, schedule, n_layer, zero_stage=0, offload="none",
                   virtual_stages=1):
    """A job's pipeline settings, checked by rtxmpi.parallel.layout.Layout before anything is
    built (pure, local, the same verdict on every rank). Raises ConfigError naming every problem:
    pp (x virtual_stages) > n_layer, an impossible schedule (unknown, micro_batches < 1, 1F1B
    with micro_batches < pp; the schedule is built and simulated), ZeRO stage 3 or offload with
    pp > 1 (stages 1 and 2 shard each stage over its replicas: rtxmpi.parallel.pipeline_zero)."""
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ConfigError(f"--pp must be >= 1, got {pp}")
    _pipeline_layout(pp, micro_batches, schedule, zero_stage, offload, virtual_stages).check(
        pp, ModelFacts(n_units=n_layer))


def auto_micro_batches(*, pp, per_rank_batch, schedule, n_layer, zero_stage=0, offload="none",
                       virtual_stages=1):
    """`--micro-batches auto` (rtxmpi.parallel.layout.auto_micro_batches) for these pipeline
    settings: 1 with pp == 1; else the smallest multiple of pp dividing per_rank_batch, else the
    smallest divisor the schedule accepts. Raises ConfigError as check_pipeline, or naming the
    per-rank batch."""
    layout = _pipeline_layout(pp, 1, schedule, zero_stage, offload, virtual_stages)
    return layout_auto_micro_batches(layout, max(pp, 1), ModelFacts(n_units=n_layer),
                                     per_rank_batch)


def build_pipeline(cfg, group, *, dp=None, pp, tp=1, sp=1, micro_batches, schedule="1f1b", split=None,
                   seed=0, dtype=np.float32, sequence_parallel=False, optimizer=None,
                   bucket_bytes=DEFAULT_BUCKET_BYTES, xp=np, zero_stage=0, virtual_stages=1):
    """The mesh (dp x pp x tp x sp) and PipelineParallel engine for a training job: builds the
    GPT (a ParallelGPT when tp or sp > 1, optionally with Megatron sequence_parallel) from (cfg, seed),
    keeps this rank's stage and drops the rest. Returns the engine (engine.mesh, engine.model =
    its stage). Collective on `group`. Raises ConfigError on every rank (layout, schedule, split,
    a model that does not divide by tp or sp)."""
    Layout(dp, tp, pp, sp, micro_batches, zero_stage, schedule, virtual_stages=virtual_stages,
           sequence_parallel=sequence_parallel).check(group.world_size, no_positions(cfg))
    mesh = DeviceMesh(dp=dp, tp=tp, pp=pp, sp=sp, group=group)
    model = (ParallelGPT(cfg, mesh, seed=seed, xp=xp, dtype=dtype,
                         sequence_parallel=sequence_parallel)
             if tp > 1 or sp > 1 else GPT(cfg, seed=seed, xp=xp, dtype=dtype))  # xp: numpy or cupy
    return PipelineParallel.from_mesh(model, mesh, micro_batches=micro_batches, schedule=schedule,
                                      split=split, optimizer=optimizer,
                                      bucket_bytes=bucket_bytes, zero_stage=zero_stage,
                                      virtual_stages=virtual_stages)
