"""Tensor parallelism (Megatron-LM), with Megatron sequence parallelism: its collectives and the
vocabulary-parallel pieces, as forward/backward pairs, and how parameters are cut over tp.

Sources: Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (2019) for the column/row split of the MLP and the head split of attention, the
vocabulary-parallel embedding and cross-entropy; Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models" (2022) for sequence parallelism.

Shape legend: B batch, T sequence length (this rank's positions), C channels, tp = group size,
V vocabulary; a tensor split over tp keeps 1/tp of a dim (`Cout/tp`, `V/tp`).

A column-parallel linear keeps w[:, cols] (its output dim split): its input is replicated on every
tp rank and its output is split. A row-parallel linear keeps w[rows, :] (its input dim split): it
takes the split activation and its output is a partial sum, all-reduced over tp (the bias is added
after the sum). Chained, column then row, a layer has one all-reduce in forward and one in backward.

With sequence_parallel=True the activations between the layers (LayerNorm, residual, dropout
regions) are split along the sequence over tp, (B, T/tp, C): the column-parallel linear first
all-gathers the sequence, and the row-parallel linear reduce-scatters along the sequence instead
of all-reducing. The same bytes move; activations outside the matmuls take 1/tp of the memory.
Parameters used in the split region (LayerNorm gains and biases, the row-parallel bias, the
position embedding) then get partial gradients: the caller sums them over tp (`ParallelGPT` does).

The parallel linears themselves (rtxmpi.parallel.parallelize: ColumnParallelLinear,
RowParallelLinear) are the rtxmpi.nn Linear module on a shard's shape between these collectives.

Every function here is a collective on the tp group (every tp rank calls it in the same order,
with the same shapes) unless said otherwise. Inputs are not validated (inner loop); the model
validates once, at the edge.
"""
from rtxmpi.backend import xp_of
from rtxmpi.errors import ConfigError


def split_size(n, parts, what, hint=""):
    """n // parts, or ConfigError naming `what` when parts does not divide n."""
    if n % parts:
        raise ConfigError(f"{what} ({n}) is not divisible by {parts}{hint}")
    return n // parts


# ------------------------------------------------------------------------- sequence gather/scatter
def gather_sequence(x, group):
    """All-gather dim 1 (the sequence): (B, T/tp, ...) on each rank -> (B, T, ...), tp-rank order."""
    if group.world_size == 1:
        return x
    xp = xp_of(x)
    full = group.all_gather(xp.ascontiguousarray(x.swapaxes(0, 1)))  # (T, B, ...)
    return xp.ascontiguousarray(full.swapaxes(0, 1))


def reduce_scatter_sequence(x, group):
    """Sum over tp and keep this rank's sequence chunk: (B, T, ...) -> (B, T/tp, ...)."""
    if group.world_size == 1:
        return x
    xp = xp_of(x)
    part = group.reduce_scatter(xp.ascontiguousarray(x.swapaxes(0, 1)))  # (T/tp, B, ...)
    return xp.ascontiguousarray(part.swapaxes(0, 1))


def sum_partial(x, group, sequence_parallel=False):
    """The sum over tp of a partial (B, T, C) (a row-parallel output, a column-parallel input's
    gradient): all-reduce in place, or with sequence_parallel reduce-scatter along T to
    (B, T/tp, C). Returns the sum."""
    if sequence_parallel:
        return reduce_scatter_sequence(x, group)
    if group.world_size > 1:
        group.all_reduce(x)
    return x


# ------------------------------------------------------------------------------- vocab parallel
def vocab_range(vocab_size, rank, world_size):
    """(first, stop) of the vocabulary rows rank `rank` holds; ConfigError when V % tp != 0."""
    per = split_size(vocab_size, world_size, "vocab_size", f" (tp={world_size})")
    return rank * per, (rank + 1) * per


def vocab_embedding_forward(idx, wte, vocab_start, group, sequence_parallel=False):
    """Vocabulary-parallel token embedding: x[b, t] = W[idx[b, t]] with W's rows split over tp.

    idx: (B, T) integer ids in [0, V) (the same on every tp rank); wte: (V/tp, C), rows
    [vocab_start, vocab_start + V/tp) of W. Each rank looks up the ids it owns (zeros elsewhere);
    the sum over tp (all-reduce, or reduce-scatter along T) is the embedding.
    Returns x: (B, T, C) or (B, T/tp, C) with sequence_parallel, cache. Collective on `group`.
    """
    xp = xp_of(wte)
    local = (idx >= vocab_start) & (idx < vocab_start + wte.shape[0])
    ids = xp.where(local, idx - vocab_start, 0)
    x = wte[ids]
    x *= local[..., None].astype(x.dtype)
    return sum_partial(x, group, sequence_parallel), (ids, local, wte.shape, sequence_parallel)


def vocab_embedding_backward(dx, cache, dwte_out=None):
    """Gradient of `vocab_embedding_forward` for the local rows. dx: (B, T, C), the gradient of
    the whole sequence (with sequence_parallel, all-gather it first: `gather_sequence`). Returns
    dwte: (V/tp, C), added into dwte_out. Rows of repeated ids are summed by a stable sort and a
    segmented sum (deterministic). Local: no collective."""
    ids, local, shape, _ = cache
    xp = xp_of(dx)
    C = dx.shape[-1]
    dwte = xp.zeros(shape, dx.dtype) if dwte_out is None else dwte_out
    keep = local.reshape(-1)
    rows = ids.reshape(-1)[keep]
    if rows.size:
        order = xp.argsort(rows, kind="stable")
        sorted_rows = rows[order]
        starts = xp.flatnonzero(sorted_rows[1:] != sorted_rows[:-1]) + 1
        starts = xp.concatenate([xp.zeros(1, dtype=starts.dtype), starts])
        picked = dx.reshape(-1, C)[keep][order]
        dwte[sorted_rows[starts]] += xp.add.reduceat(picked, starts, axis=0)
    return dwte


def vocab_crossentropy_forward(logits, targets, vocab_start, group):
    """Mean cross-entropy over all B*T positions with the logits split over tp by vocabulary.

    logits: (B, T, V/tp), columns [vocab_start, vocab_start + V/tp) of the full logits;
    targets: (B, T) ids in [0, V), the same on every tp rank. The full (B, T, V) logits are never
    formed: the row max is all-reduced (max), then the sum of exponentials and the target's logit
    in one all-reduce (sum) of 2*B*T values. Returns loss (0-d array of the logits' dtype, the same
    on every tp rank), cache (the local (N, V/tp) softmax). Collective on `group`.
    """
    xp = xp_of(logits)
    Vl = logits.shape[-1]
    l2 = logits.reshape(-1, Vl)
    tgt = targets.reshape(-1)
    N = l2.shape[0]
    m = l2.max(axis=1)
    if group.world_size > 1:
        group.all_reduce(m, op="max")
    probs = l2 - m[:, None]
    local = (tgt >= vocab_start) & (tgt < vocab_start + Vl)
    cols = xp.where(local, tgt - vocab_start, 0)
    rows = xp.arange(N)
    sums = xp.empty((2, N), probs.dtype)
    sums[1] = probs[rows, cols] * local  # logit[target] - max, on the rank that owns the target
    xp.exp(probs, out=probs)
    probs.sum(axis=1, out=sums[0])
    if group.world_size > 1:
        group.all_reduce(sums)
    probs /= sums[0][:, None]
    nll = xp.log(sums[0])
    nll -= sums[1]
    return nll.mean(), (probs, cols, local, logits.shape)


def vocab_crossentropy_backward(dloss, cache):
    """Gradient of `vocab_crossentropy_forward` times `dloss` for the local vocabulary columns:
    dlogits (B, T, V/tp) = dloss * (softmax - onehot(targets)) / (B*T). Local: no collective."""
    probs, cols, local, shape = cache
    xp = xp_of(probs)
    N = probs.shape[0]
    c = float(dloss) / N
    dlogits = probs * c
    rows = xp.flatnonzero(local)
    dlogits[rows, cols[rows]] -= c
    return dlogits.reshape(shape)


# --------------------------------------------------------------------- parameter shards over tp
# How each GPT parameter (by the name after "h{l}.") is split over tp:
#   "vocab": rows (vocabulary) split;  "qkv": the q, k, v column blocks each split by heads;
#   "cols": output dim split (column-parallel);  "rows": input dim split (row-parallel);
#   None: replicated (LayerNorm, position embedding, row-parallel biases).
_SPLIT = {"wte": "vocab", "lm_head": "vocab", "attn.w_qkv": "qkv", "attn.b_qkv": "qkv",
          "attn.w_proj": "rows", "mlp.w_fc": "cols", "mlp.b_fc": "cols", "mlp.w_proj": "rows"}


def split_kind(name):
    """How parameter `name` (a GPT parameter name) is split over tp: "vocab", "qkv", "cols",
    "rows" or None (replicated)."""
    return _SPLIT.get(name.split(".", 1)[1] if name.startswith("h") else name)


def local_shape(kind, shape, tp):
    """The shape of one tp rank's piece of a parameter of `shape` split as `kind`."""
    if kind is None:
        return tuple(shape)
    if kind in ("vocab", "rows"):
        return (shape[0] // tp,) + tuple(shape[1:])
    return tuple(shape[:-1]) + (shape[-1] // tp,)  # "cols", "qkv"


def shard(kind, full, rank, tp):
    """This tp rank's part of the full parameter `full` split as `kind` ("vocab", "qkv", "cols",
    "rows" or None). Local. For "qkv" the local columns are [q_local | k_local | v_local], heads
    contiguous inside each: exactly the layout MultiHeadAttention (rtxmpi.nn) uses for n_head / tp
    heads."""
    if kind is None:
        return full
    if kind in ("vocab", "rows"):
        n = full.shape[0] // tp
        return full[rank * n:(rank + 1) * n]
    if kind == "cols":
        n = full.shape[-1] // tp
        return full[..., rank * n:(rank + 1) * n]
    C3 = full.shape[-1]
    n = C3 // 3 // tp
    blocks = full.reshape(full.shape[:-1] + (3, C3 // 3))[..., rank * n:(rank + 1) * n]
    return blocks.reshape(full.shape[:-1] + (3 * n,))


def unshard(kind, pieces):
    """Inverse of `shard`: the full parameter from the tp ranks' pieces (in tp-rank order; for a
    replicated parameter the first piece). Local."""
    xp = xp_of(pieces[0])
    if kind is None:
        return pieces[0]
    if kind in ("vocab", "rows"):
        return xp.concatenate(pieces, axis=0)
    if kind == "cols":
        return xp.concatenate(pieces, axis=-1)
    lead, n = pieces[0].shape[:-1], pieces[0].shape[-1] // 3
    blocks = [p.reshape(lead + (3, n)) for p in pieces]
    return xp.concatenate(blocks, axis=-1).reshape(lead + (3 * n * len(pieces),))


def shard_param(name, full, rank, tp):
    """`shard` of the GPT parameter `name` (its split_kind). Local."""
    return shard(split_kind(name), full, rank, tp)


def unshard_param(name, pieces):
    """`unshard` of the GPT parameter `name` (its split_kind). Local."""
    return unshard(split_kind(name), pieces)


def local_layout(specs, tp):
    """(name, local shape, decay) for each full ParamSpec of a GPT, in the same order: the layout
    of one tp rank's flat buffers. Local."""
    return [(s.name, local_shape(split_kind(s.name), s.shape, tp), s.decay) for s in specs]


def is_replicated(name):
    """True for a GPT parameter every tp rank holds whole."""
    return split_kind(name) is None


def norm_ranges(params, tp_rank, start=0, stop=None, replicated=None):
    """The parts of [start, stop) of a tp rank's local flat vector that this rank counts in the
    whole model's gradient norm (and non-finite check): every tensor-split parameter, and the
    replicated ones (`is_replicated`: LayerNorms, wpe, row-parallel biases) on tp rank 0 only,
    as the other tp ranks hold copies. Summed over tp, each element of the one-process model is
    then counted once (Megatron-LM's clip_grad_norm counts tp-duplicated parameters on tp rank 0).

    params: Param-likes (.name, .offset, .size: elements in the flat vector). stop: None for the
    end of the last parameter. replicated: one bool per parameter (a TensorParallelModel's
    `replicated`), or None to judge GPT names (`is_replicated`). Returns [(lo, hi)] relative to
    `start`, one per parameter that overlaps [start, stop), in parameter order (not merged, so a
    sum over them adds each parameter's part separately). Local."""
    if stop is None:
        stop = max((p.offset + p.size for p in params), default=start)
    if replicated is None:
        replicated = [is_replicated(p.name) for p in params]
    out = []
    for p, whole in zip(params, replicated):
        lo, hi = max(p.offset, start), min(p.offset + p.size, stop)
        if hi > lo and (tp_rank == 0 or not whole):
            out.append((lo - start, hi - start))
    return out


__all__ = ["sum_partial", "vocab_embedding_forward", "vocab_embedding_backward",
           "vocab_crossentropy_forward", "vocab_crossentropy_backward", "gather_sequence",
           "reduce_scatter_sequence", "vocab_range", "split_kind", "local_shape", "shard", "unshard",
           "shard_param", "unshard_param", "local_layout", "is_replicated", "norm_ranges",
           "split_size"]
