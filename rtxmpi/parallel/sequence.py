"""Sequence parallelism over the mesh's sp axis (DeepSpeed-Ulysses), as forward/backward pairs.

Source: Jacobs et al., "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme
Long Sequence Transformer Models" (2023).

Each sp rank holds T/sp consecutive positions of every sample; everything except the attention
core works position by position and needs no communication. For attention, one all-to-all turns
the sequence-sharded q, k, v of all (local) heads into the full sequence of H/sp heads;
attention runs on those heads; a second all-to-all turns the output back into the sequence shard
of all heads. Backward is the same two all-to-alls in reverse. Per layer and rank, each all-to-all
moves a (sp-1)/sp share of the activation, independent of sp, so the sequence length scales with
sp at constant communication per rank.

Shape legend: B batch, Ts = T/sp positions on this rank, T = Ts * sp, H heads (the heads this
rank's tensor-parallel slice owns), Hs = H/sp, hs head size.

The attention itself is the model's own: the `core` module of its MultiHeadAttention
(rtxmpi.nn.modules.AttentionCore), run here on (B, Hs, T, hs) heads of the full sequence.
"""
from rtxmpi.backend import xp_of
from rtxmpi.errors import ConfigError


def check_heads(n_head, sp):
    """ConfigError unless sp divides the (per tensor-parallel rank) head count. (The sequence
    length's divisibility is checked by DeviceMesh.seq_slice.)"""
    if n_head % sp:
        raise ConfigError(f"sequence parallelism: {n_head} attention heads (per tensor-parallel "
                          f"rank) are not divisible by sp({sp}); the all-to-all gives each sp rank "
                          f"whole heads, so use n_head divisible by tp * sp")


# -------------------------------------------------------------------------- Ulysses all-to-all
def _all_to_all(x, group):
    """all_to_all of a (sp, ...) array: chunk j goes to sp rank j; returns (sp, ...) whose chunk i
    came from sp rank i."""
    xp = xp_of(x)
    sp = x.shape[0]
    flat = xp.ascontiguousarray(x).reshape((sp * x.shape[1],) + x.shape[2:])
    return group.all_to_all(flat).reshape(x.shape)


def ulysses_attention_forward(qkv, n_head, group, core):
    """Attention of the full sequence from sequence-sharded q, k, v.

    qkv: (B, Ts, 3 * H * hs), columns [q | k | v] with heads contiguous inside each (the output
    of the qkv projection on this rank's positions); n_head: H; group: the sp ProcessGroup (size
    sp dividing H; None: sp = 1); core: the attention core module (AttentionCore: causal or
    bidirectional), run on (q, k, v) of shape (B, H/sp, T, hs). Returns y: (B, Ts, H * hs) for
    this rank's positions, heads in order, cache. Collective on `group` (two all-to-alls; none
    when sp = 1).
    """
    B, Ts, C3 = qkv.shape
    sp, hs = 1 if group is None else group.world_size, C3 // (3 * n_head)
    Hs = n_head // sp
    if sp == 1:
        q, k, v = qkv.reshape(B, Ts, 3, n_head, hs).transpose(2, 0, 3, 1, 4)
        y, c_core = core.forward(None, (q, k, v))
        return (y.transpose(0, 2, 1, 3).reshape(B, Ts, n_head * hs),
                (c_core, n_head, 1, core))
    # chunk j = heads [j*Hs, (j+1)*Hs) of my positions -> sp rank j
    send = qkv.reshape(B, Ts, 3, sp, Hs, hs).transpose(3, 0, 1, 2, 4, 5)
    recv = _all_to_all(send, group)  # chunk i = my heads at rank i's positions
    T = sp * Ts
    full = recv.transpose(1, 0, 2, 3, 4, 5).reshape(B, T, 3, Hs, hs)
    q, k, v = full.transpose(2, 0, 3, 1, 4)  # (B, Hs, T, hs)
    y, c_core = core.forward(None, (q, k, v))
    # chunk i = my heads at rank i's positions -> sp rank i
    back = _all_to_all(y.reshape(B, Hs, sp, Ts, hs).transpose(2, 0, 3, 1, 4), group)
    # chunk j = heads of rank j at my positions: (sp, B, Ts, Hs, hs) -> (B, Ts, H * hs)
    return back.transpose(1, 2, 0, 3, 4).reshape(B, Ts, n_head * hs), (c_core, n_head, sp, core)


def ulysses_attention_backward(dy, cache, group):
    """Gradient of `ulysses_attention_forward`: dy (B, Ts, H * hs) -> dqkv (B, Ts, 3 * H * hs).
    Collective on `group` (two all-to-alls; none when sp = 1)."""
    c_core, n_head, sp, core = cache
    xp = xp_of(dy)
    B, Ts, C = dy.shape
    hs, Hs = C // n_head, n_head // sp
    if sp == 1:
        dq, dk, dv = core.backward(None, None, c_core,
                                   dy.reshape(B, Ts, n_head, hs).transpose(0, 2, 1, 3))
        dqkv = xp.stack([dq, dk, dv], axis=2)  # (B, H, 3, T, hs)
        return xp.ascontiguousarray(dqkv.transpose(0, 3, 2, 1, 4)).reshape(B, Ts, 3 * C)
    # the reverse of the output all-to-all: heads of rank j at my positions -> rank j
    send = dy.reshape(B, Ts, sp, Hs, hs).transpose(2, 0, 1, 3, 4)
    recv = _all_to_all(send, group)  # chunk i = my heads at rank i's positions
    T = sp * Ts
    dyh = recv.transpose(1, 3, 0, 2, 4).reshape(B, Hs, T, hs)
    dq, dk, dv = core.backward(None, None, c_core, dyh)
    dfull = xp.stack([dq, dk, dv], axis=0)  # (3, B, Hs, T, hs)
    # chunk i = rank i's positions of my heads -> rank i
    send = dfull.reshape(3, B, Hs, sp, Ts, hs).transpose(3, 1, 4, 0, 2, 5)  # (sp, B, Ts, 3, Hs, hs)
    back = _all_to_all(send, group)  # chunk j = heads of rank j at my positions
    return back.transpose(1, 2, 3, 0, 4, 5).reshape(B, Ts, 3 * C)
