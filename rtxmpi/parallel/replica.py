"""What one rank holds of the one-process model, as pieces of its flat vectors: the input of an
elastic recovery that rebuilds full replicas from the survivors of a hybrid layout.

Under tensor (tp) and pipeline (pp) parallelism no rank holds the whole model; under data (dp)
and sequence (sp) parallelism ranks hold identical copies of their part. So the ranks that share
one (pp_rank, tp_rank) coordinate — the rank's *shard key* — hold the same parameters and AdamW
state at the same step, and one survivor of every key is enough to rebuild the one-process
model's flat vectors (the checkpoint layout, rtxmpi.checkpoint), which load at any new layout.

`replica_pieces(engine)` describes this rank's share without communicating: its shard key at
once, and, built on the first read of `.tensors` (only the survivors that broadcast read it,
rtxmpi.elastic.shrink.exchange_pieces), for "params",
"adam.m", "adam.v" the global position of every local element in the one-process flat layout
(model.full_specs) — a contiguous run (an int offset) where the layouts coincide, else
an int64 index array (a tp shard of a matrix is strided in the full layout) — and "adam.step".
Positions come from the model's `shard` (tensor.shard) applied to the element numbers, so they
follow exactly the slicing the tensor-parallel model uses. A pipeline's tied wte copy (last
stage) is left out: stage 0 holds the same values. Parameters replicated over tp (LayerNorm, biases of row-parallel
layers) appear in every tp rank's pieces; assemble the keys in descending order so that tp rank 0
writes last, as `TensorParallelModel.gather_full` and hence the checkpoint do.
"""
import numpy as np

from ..backend import to_host
from ..errors import ConfigError
from .hybrid import HybridParallel
from .pipeline import ChunkedStage, PipelineParallel, TensorParallelStage

class ReplicaPieces:
    """This rank's share of the one-process model.

    key: this rank's shard key in range(keys) (pp_rank * tp + tp_rank); keys: how many distinct
    keys make a complete model (pp * tp); tensors: {name: (where, values, global_size)} with
    where an int (values fill [where, where + len)) or an int64 array (the global position of
    each value), values a 1-D host array (copies). `tensors` may be given as a callable
    returning that dict: it is then built on the first read of `.tensors` (the engine's state
    at that moment: read it before the next update) and kept; `built` tells whether it was.
    Local: no communication.
    """

    __slots__ = ("key", "keys", "_tensors", "_build")

    def __init__(self, key, keys, tensors):
        self.key, self.keys = int(key), int(keys)
        self._build, self._tensors = (tensors, None) if callable(tensors) else (None, tensors)

    @property
    def built(self):
        return self._tensors is not None

    @property
    def tensors(self):
        if self._tensors is None:
            self._tensors, self._build = self._build(), None
        return self._tensors


def full_index(model):
    """int64 array (model.num_params,): for each element of a TensorParallelModel's local flat
    vector, its position in the one-process model's flat layout. Local (pure)."""
    out = np.empty(model.num_params, np.int64)
    for i, (p, full) in enumerate(zip(model.params, model.full_specs)):
        ids = np.arange(full.offset, full.stop, dtype=np.int64).reshape(full.shape)
        out[p.offset:p.offset + p.size] = model.shard(i, ids).reshape(-1)
    return out


def _pieces(where, flat, state, n_full, own=None):
    own = slice(None) if own is None else own
    tensors = {name: (where, np.array(to_host(values[own])).reshape(-1), n_full)
               for name, values in (("params", flat), ("adam.m", state["m"]),
                                    ("adam.v", state["v"]))}
    tensors["adam.step"] = (0, np.array([state["step"]], np.int64), 1)
    return tensors


def replica_pieces(engine):
    """This rank's ReplicaPieces of a HybridParallel or PipelineParallel engine. Its key and keys
    are set now; its tensors (the engine's state: read them after the last applied update and
    before the next) are copied on the first read of `.tensors`, so a rank that only needs the
    key pays nothing. Local: no communication; the values are copies.
    Raises ConfigError for another engine (data parallelism hands over full tensors itself) and
    for one whose optimizer state is sharded over dp (ZeRO: a lost rank's shard has no copy)."""
    if getattr(engine, "zero", None) is not None or getattr(engine, "zero_stage", 0):
        raise ConfigError(f"replica_pieces: {type(engine).__name__} shards its state over dp "
                          "(ZeRO); recover from the last committed checkpoint")
    if isinstance(engine, HybridParallel):
        model = engine.model
        return ReplicaPieces(model.tp_rank, model.tp, lambda: _pieces(
            full_index(model), model.flat_data, engine.optimizer.state_dict(),
            model.full_num_params))
    if isinstance(engine, PipelineParallel):
        st = engine.stage

        def build():
            own = slice(0, st.own_size)  # the wte copy (last stage, tied) is stage 0's wte
            if isinstance(st, TensorParallelStage):
                where = full_index(st.model)[st.flat_start:st.flat_stop]
            elif isinstance(st, ChunkedStage):  # interleaved: one range of the full layout a chunk
                where = np.concatenate([np.arange(ch.flat_start, ch.flat_stop, dtype=np.int64)
                                        for ch in st.chunks])
            else:
                where = int(st.full_start)
            return _pieces(where, st.flat_data, engine.optimizer.state_dict(), engine.num_params,
                           own)
        return ReplicaPieces(st.stage * st.tp + st.tp_rank, st.stages * st.tp, build)
    raise ConfigError(f"replica_pieces: {type(engine).__name__} is not a hybrid or pipeline engine")


__all__ = ["ReplicaPieces", "replica_pieces", "full_index"]
