"""`DeviceMesh(dp, tp, pp, sp)`: the parallel degrees, validated once, and their named groups.

The world's ranks form a 4-D grid with axes, outermost to innermost, pp, dp, sp, tp:

    rank = ((pp_rank * dp + dp_rank) * sp + sp_rank) * tp + tp_rank

so tensor-parallel peers (the chattiest: collectives inside every layer) are consecutive ranks and
share a node whenever tp divides the ranks per node, and pipeline stages (point-to-point only) are
the farthest apart (the Megatron-LM / torchtitan ordering).

Axes and what they split:
    dp  data parallel: the global batch's samples (`batch_axes`). Parameters are replicated.
    sp  sequence parallel (Ulysses): each sample's positions. Parameters are replicated.
    tp  tensor parallel (Megatron): weight matrices and attention heads; every tp rank sees the
        same tokens.
    pp  pipeline parallel: layers (stages); activations move between stages.
Ranks that differ in dp or sp hold different tokens of the same global batch (`token_axes`): the
loss is the average over `mesh.group("dp", "sp")`, and so is the gradient of every parameter
replicated over those axes (all of a layer's parameters are).

Groups: `mesh.group(*axes)` for any non-empty set of axes (e.g. "tp", or "dp", "sp" together) is
the ProcessGroup of the ranks that share this rank's coordinates on every OTHER axis; its group
ranks follow the mesh order (for one axis: group rank == that axis's coordinate). All of them are
created in the constructor, in one fixed order, so creating a mesh is the only collective here.
"""
import warnings
from collections import namedtuple
from itertools import combinations

from rtxmpi.errors import ConfigError


def is_degree(value):
    """An int >= 1 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def degree_problems(world_size, dp, tp, pp, sp):
    """(dp or None, [problem texts]) for the degrees against the world size."""
    bad = [f"{name} must be an integer >= 1, got {value!r}" for name, value in
           (("dp", dp), ("tp", tp), ("pp", pp), ("sp", sp)) if not (value is None and name == "dp")
           and not is_degree(value)]
    if bad:
        return None, bad
    n, model = world_size, tp * pp * sp
    if dp is None:
        if n % model:
            return None, [f"world_size({n}) is not divisible by tp({tp}) * pp({pp}) * sp({sp}) = "
                          f"{model}, so no dp fits; use a multiple of {model} ranks or smaller "
                          f"degrees"]
        dp = n // model
    product = dp * model
    if product != n:
        hint = f"set dp={n // model} or use {product} ranks" if n % model == 0 else \
            f"use {product} ranks"
        return dp, [f"dp({dp}) * tp({tp}) * pp({pp}) * sp({sp}) = {product} != world_size({n}); "
                    f"{hint}"]
    return dp, []


def resolve_degrees(world_size, dp=None, tp=1, pp=1, sp=1, what="DeviceMesh"):
    """The degrees against a world size, nothing created (pure, local). dp=None means
    world_size // (tp * pp * sp). Returns (dp, tp, pp, sp). Raises ConfigError when a degree is
    not an integer >= 1 or dp * tp * pp * sp != world_size; the message names every factor, e.g.
    "dp(2) * tp(2) * pp(1) * sp(1) = 4 != world_size(8); set dp=4 or use 4 ranks"."""
    dp, problems = degree_problems(world_size, dp, tp, pp, sp)
    if problems:
        raise ConfigError(f"{what}: " + "; ".join(problems))
    return dp, tp, pp, sp


AXES = ("pp", "dp", "sp", "tp")  # outermost to innermost
MeshCoord = namedtuple("MeshCoord", AXES)


class DeviceMesh:
    """The (pp, dp, sp, tp) grid of the world's ranks and one ProcessGroup per set of axes.

    dp, tp, pp, sp: parallel degrees (ints >= 1). dp=None means world_size // (tp * pp * sp).
    group: the ProcessGroup to lay out (default: rtxmpi.comm.world()).
    topology: optional rtxmpi.topology.Topology of `group` (`discover(group)`): `placement` then
    lists the tp blocks that leave an NVLink island (GPU) or a host (CPU), and on GPU hosts a
    RuntimeWarning names them (every layer's tp collectives would cross PCIe or the network).
    Raises ConfigError, on every rank alike (the check depends only on arguments and the world
    size), when a degree is not a positive integer or dp * tp * pp * sp != world_size; the
    message names every factor, e.g. "dp(2) * tp(2) * pp(1) * sp(1) = 4 != world_size(8)".
    Collective: every rank of `group` must construct it, with the same degrees.

    Attributes: dp, tp, pp, sp (degrees), shape (dict axis -> degree, in AXES order), world (the
    group laid out), rank / world_size (in it), coord (MeshCoord(pp, dp, sp, tp) of this rank),
    pp_rank, dp_rank, sp_rank, tp_rank (this rank's coordinate on each axis).
    """

    batch_axes = ("dp",)        # split the global batch's samples
    token_axes = ("dp", "sp")   # hold different tokens: average the loss (and replicated grads)

    def __init__(self, dp=None, tp=1, pp=1, sp=1, *, group=None, topology=None):
        if group is None:
            from rtxmpi.comm import world
            group = world()
        n = group.world_size
        dp, tp, pp, sp = resolve_degrees(n, dp=dp, tp=tp, pp=pp, sp=sp)
        self.dp, self.tp, self.pp, self.sp = dp, tp, pp, sp
        self.shape = {"pp": pp, "dp": dp, "sp": sp, "tp": tp}
        self.world, self.rank, self.world_size = group, group.rank, n
        self.coord = self.coord_of(group.rank)
        self.pp_rank, self.dp_rank, self.sp_rank, self.tp_rank = self.coord
        self.placement = []  # problems of the tp placement (rtxmpi.topology.advise_tp)
        if topology is not None:
            from rtxmpi.topology import advise_tp

            self.placement = advise_tp(topology, tp)
            if self.placement and topology.has_gpu:
                warnings.warn("DeviceMesh: " + "; ".join(self.placement), RuntimeWarning,
                              stacklevel=2)
        self._groups = {}
        for k in range(1, len(AXES) + 1):
            for axes in combinations(AXES, k):  # fixed order: the same splits on every rank
                self._groups[axes] = group.split(self._index(AXES, exclude=axes),
                                                 key=self._index(axes))

    # -- coordinates -----------------------------------------------------------------------------
    def coord_of(self, rank):
        """MeshCoord(pp, dp, sp, tp) of a rank of the laid-out group. Local."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside [0, {self.world_size})")
        out = []
        for axis in reversed(AXES):
            out.append(rank % self.shape[axis])
            rank //= self.shape[axis]
        return MeshCoord(*reversed(out))

    def rank_of(self, pp=None, dp=None, sp=None, tp=None):
        """The rank (in the laid-out group) at the given coordinates; an axis left None takes
        this rank's coordinate (so `mesh.rank_of(pp=s)` is this rank's peer on stage s). Local."""
        given = {"pp": pp, "dp": dp, "sp": sp, "tp": tp}
        rank = 0
        for axis in AXES:
            c = getattr(self.coord, axis) if given[axis] is None else given[axis]
            if not 0 <= c < self.shape[axis]:
                raise ConfigError(f"{axis} coordinate {c} is outside [0, {self.shape[axis]})")
            rank = rank * self.shape[axis] + c
        return rank

    def _index(self, axes, exclude=()):
        """Linear index of this rank's coordinates on `axes` (minus `exclude`), mesh order."""
        index = 0
        for axis in AXES:
            if axis in axes and axis not in exclude:
                index = index * self.shape[axis] + getattr(self.coord, axis)
        return index

    # -- groups ----------------------------------------------------------------------------------
    def group(self, *axes):
        """The ProcessGroup spanning `axes` through this rank (e.g. group("tp"), group("dp",
        "sp")): its size is the product of their degrees. Local (created with the mesh).
        Raises ConfigError for an unknown or repeated axis."""
        unknown = [a for a in axes if a not in AXES]
        if not axes or unknown or len(set(axes)) != len(axes):
            raise ConfigError(f"DeviceMesh.group: axes must be distinct names from {AXES}, "
                              f"got {axes}")
        return self._groups[tuple(a for a in AXES if a in axes)]

    def size(self, *axes):
        """Product of the degrees of `axes` (1 for none)."""
        n = 1
        for axis in axes:
            n *= self.shape[axis]
        return n

    @property
    def loss_group(self):
        """group("dp", "sp"): average the loss and replicated parameters' gradients over it."""
        return self.group(*self.token_axes)

    # -- what this rank reads ----------------------------------------------------------------------
    def local_batch(self, global_batch):
        """Samples per step on this rank: global_batch // dp. Raises ConfigError when dp does not
        divide global_batch."""
        if global_batch % self.dp:
            raise ConfigError(f"global batch {global_batch} is not divisible by dp({self.dp}); "
                              f"use a multiple of {self.dp}")
        return global_batch // self.dp

    def batch_slice(self, global_batch):
        """This rank's rows of a global batch: slice(dp_rank * b, (dp_rank + 1) * b),
        b = local_batch(global_batch). The same on every rank of group("tp", "sp", "pp")."""
        b = self.local_batch(global_batch)
        return slice(self.dp_rank * b, (self.dp_rank + 1) * b)

    def seq_slice(self, seq_len):
        """This rank's positions of each sample: slice(sp_rank * t, (sp_rank + 1) * t),
        t = seq_len // sp. Raises ConfigError when sp does not divide seq_len."""
        if seq_len % self.sp:
            raise ConfigError(f"sequence length {seq_len} is not divisible by sp({self.sp}); use "
                              f"a multiple of {self.sp}")
        t = seq_len // self.sp
        return slice(self.sp_rank * t, (self.sp_rank + 1) * t)

    def __repr__(self):
        return (f"DeviceMesh(dp={self.dp}, tp={self.tp}, pp={self.pp}, sp={self.sp}; rank "
                f"{self.rank} at pp={self.pp_rank} dp={self.dp_rank} sp={self.sp_rank} "
                f"tp={self.tp_rank})")
