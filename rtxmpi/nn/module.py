"""The module protocol: a model as an ordered list of units over one flat parameter buffer.

A `Module` declares its parameters (`param_specs()`: ParamDecl name, shape, decay, tensor-parallel
split, init) and is a forward/backward pair over arrays it does not own:

    y, cache = module.forward(params, x)          # params: one array per declaration, in order
    dx = module.backward(params, grads, cache, dy)  # ADDS into the arrays of `grads`; dx or None

The cache never holds a parameter: backward gets `params` again (that is what lets a provider free
them between the passes, ZeRO-3). `Sequential` chains modules. A `Model` is an ordered list of units
(each a module, usually a Sequential) over one flat data buffer and one flat gradient buffer, laid
out from the declarations in unit order; its last module is a head with a loss:

    loss, cache = head.loss_forward(y, targets);  dy = head.loss_backward(scale, cache)

Units are what the engines schedule and what a parameter provider hands out (rtxmpi.nn.gpt's module
docstring gives the provider calls and their order). A parameter declared with `tied_to` (the full
name of a parameter of an earlier unit) has no storage of its own: the unit is handed the owner's
array and gradient, and the owner's gradient is final once the owner's unit has run backward.
A Model may recompute units (`Model.recompute`): forward keeps such a unit's input instead of its
cache, and backward reruns its forward just before its backward (docs/model.md).
"""
import math
from dataclasses import dataclass

import numpy as np

from rtxmpi.backend import xp_of
from rtxmpi.errors import ConfigError
from rtxmpi.nn.params import bind, layout
from rtxmpi.observe.trace import span

# How tensor parallelism splits a parameter over a tp group (a declaration; engines read it later):
# "column": the output dim (the last of a (C_in, C_out) weight, and its bias); "row": the input
# dim (the first; the bias stays whole); "vocab": the rows of a (V, C) table; "replicated": whole.
SPLITS = ("column", "row", "vocab", "replicated")


@dataclass(frozen=True)
class ParamDecl:
    """One parameter a module declares.

    name: local name, dotted by containers ("attn.w_qkv"); shape: tuple of ints; decay: weight
    decay applies; split: one of SPLITS; init: "zeros", "ones" or a float, the std of a normal
    draw; tied_to: None, or the full name of an earlier unit's parameter this one is (no storage
    of its own; shape must match). Raises ConfigError on a bad split, init or shape.
    """

    name: str
    shape: tuple
    decay: bool
    split: str = "replicated"
    init: object = "zeros"
    tied_to: str = None

    def __post_init__(self):
        shape = tuple(self.shape)
        if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0
                   for d in shape):
            raise ConfigError(f"parameter {self.name!r}: shape {self.shape} must be non-negative ints")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        if self.split not in SPLITS:
            raise ConfigError(f"parameter {self.name!r}: split {self.split!r} is not one of {SPLITS}")
        if self.init not in ("zeros", "ones") and not (
                isinstance(self.init, (float, int)) and not isinstance(self.init, bool)
                and math.isfinite(self.init) and self.init >= 0):
            raise ConfigError(f"parameter {self.name!r}: init {self.init!r} must be 'zeros', "
                              f"'ones' or a finite std >= 0")


class Module:
    """Base of a forward/backward pair over declared parameters (see the module docstring).

    Subclasses define `param_specs()`, `forward(params, x) -> (y, cache)` and
    `backward(params, grads, cache, dy) -> dx`; a head also `loss_forward(y, targets) ->
    (loss, cache)` (loss a 0-d array) and `loss_backward(scale, cache) -> dy`.
    Class attributes: `backward_needs_params` (False: backward reads no parameter, and the model
    passes params=None, fetching nothing); `reports_ready` (True: backward takes `ready=` and calls
    ready(j) once per declared parameter j as soon as its gradient is final; otherwise the caller
    reports them all, last first, after backward returns); `defers_weight_grads` (True: backward
    takes `defer=`, None or a list: with a list it computes dx now and appends callables that add
    some weight gradients later, bitwise the same sums once they ran; such gradients are not
    reported to `ready`).
    """

    backward_needs_params = True
    reports_ready = False
    defers_weight_grads = False

    def param_specs(self):
        """list[ParamDecl], in the order forward and backward take `params` / `grads`."""
        return []

    def forward(self, params, x):
        raise NotImplementedError(f"{type(self).__name__}.forward")

    def backward(self, params, grads, cache, dy):
        raise NotImplementedError(f"{type(self).__name__}.backward")


def run_backward(module, params, grads, cache, dy, ready=None, defer=None):
    """module.backward, reporting ready(j) for each of its parameters j (see Module); defer: None
    or a list handed to a module that defers_weight_grads (ignored by the others)."""
    more = {"defer": defer} if defer is not None and module.defers_weight_grads else {}
    if ready is None:
        return module.backward(params, grads, cache, dy, **more)
    if module.reports_ready:
        return module.backward(params, grads, cache, dy, ready=ready, **more)
    dx = module.backward(params, grads, cache, dy, **more)
    for j in range(len(grads) - 1, -1, -1):
        ready(j)
    return dx


def _named(child):
    """(prefix or None, module) from a module or a (name, module) pair."""
    if isinstance(child, Module):
        return None, child
    if (isinstance(child, tuple) and len(child) == 2 and isinstance(child[0], str)
            and isinstance(child[1], Module)):
        return child
    raise ConfigError(f"expected a Module or a (name, Module) pair, got {child!r}")


def _prefixed(prefix, decls):
    if not prefix:
        return list(decls)
    return [ParamDecl(f"{prefix}.{d.name}", d.shape, d.decay, d.split, d.init, d.tied_to)
            for d in decls]


class Sequential(Module):
    """Modules applied in order: y = m_k(...m_1(x)). children: Modules or (name, Module) pairs;
    a name prefixes the child's parameter names ("ln1" -> "ln1.g"). A head (loss_forward), if
    any, must be the last child; the Sequential then is a head too."""

    reports_ready = True

    def __init__(self, *children):
        named = [_named(c) for c in children]
        self.children = [m for _, m in named]
        self._decls = [d for prefix, m in named for d in _prefixed(prefix, m.param_specs())]
        sizes = [len(m.param_specs()) for m in self.children]
        self._bounds = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]
        self.backward_needs_params = any(m.backward_needs_params for m in self.children)
        self.defers_weight_grads = any(m.defers_weight_grads for m in self.children)
        if any(hasattr(m, "loss_forward") for m in self.children[:-1]):
            raise ConfigError("a head (a module with loss_forward) must be the last of a Sequential")
        if self.children and hasattr(self.children[-1], "loss_forward"):
            self.loss_forward = self.children[-1].loss_forward
            self.loss_backward = self.children[-1].loss_backward

    def param_specs(self):
        return list(self._decls)

    def forward(self, params, x):
        caches = []
        for m, (a, b) in zip(self.children, self._bounds):
            x, cache = m.forward(params[a:b], x)
            caches.append(cache)
        return x, caches

    def backward(self, params, grads, cache, dy, ready=None, defer=None):
        for m, (a, b), c in zip(reversed(self.children), reversed(self._bounds), reversed(cache)):
            child_ready = None if ready is None else (lambda j, a=a: ready(a + j))
            dy = run_backward(m, None if params is None else params[a:b], grads[a:b], c, dy,
                              child_ready, defer)
        return dy


def init_flat(decls, specs, seed):
    """The initial flat parameter vector, float64 on the host: for each declaration in order
    (tied ones excluded) and its ParamSpec, "ones" fills 1, "zeros" 0, and a std draws
    standard_normal(size) * std from one numpy.random.default_rng(seed) (nothing is drawn for
    zeros and ones), so the values depend only on the declarations and the seed."""
    rng = np.random.default_rng(seed)
    flat = np.zeros(specs[-1].stop if specs else 0, dtype=np.float64)
    for decl, spec in zip(decls, specs):
        view = flat[spec.offset:spec.stop]
        if decl.init == "ones":
            view[:] = 1.0
        elif decl.init != "zeros":
            view[:] = rng.standard_normal(spec.size) * decl.init
    return flat


def declarations(units):
    """Full-name ParamDecls of each unit: list (one per unit) of lists. units: Modules or
    (name, Module) pairs."""
    return [_prefixed(prefix, m.param_specs()) for prefix, m in map(_named, units)]


def own_layout(units):
    """(own declarations, list[ParamSpec]) of a model's units, tied declarations left out: the flat
    layout in unit order, without allocating it. Raises ConfigError on a duplicate name."""
    own = [d for decls in declarations(units) for d in decls if d.tied_to is None]
    return own, layout((d.name, d.shape, d.decay) for d in own)


class FlatParams:
    """The default parameter provider: each unit's arrays are the Param views into the model's
    flat_data / flat_grad; fetch and release cost nothing and nothing is ever freed."""

    transient = False

    def __init__(self, model):
        self._data = [[p.data for p in model.params[a:b]] for a, b in model.units]
        self._grad = [[p.grad for p in model.params[a:b]] for a, b in model.units]

    def fetch(self, unit, then=None):
        return self._data[unit]

    def release(self, unit):
        pass

    def grads(self, unit):
        return self._grad[unit]

    def grads_ready(self, unit):
        pass


RECOMPUTE = ("none", "blocks")


class ModelCache:
    """What `Model.forward` keeps for `Model.backward`: per unit its cache, or None where the
    unit is recomputed (then `inputs[u]` holds the input its forward reruns on); the loss's;
    and the forward's recompute plan (which units rerun, which backward fetches, their hints)."""

    __slots__ = ("units", "inputs", "loss", "plan")

    def __init__(self, units, inputs, loss, plan):
        self.units, self.inputs, self.loss, self.plan = units, inputs, loss, plan


class Model:
    """An ordered list of units over one flat parameter buffer and one flat gradient buffer.

    units: Modules or (name, Module) pairs (a name prefixes the unit's parameter names); the last
    module is a head with loss_forward. seed: int, initialization is a function of the
    declarations and seed only (init_flat; any dtype is a cast of the float64 draw); xp: numpy or
    cupy; dtype: float dtype of parameters, gradients and activations; grad_alloc:
    callable(n, dtype) returning a zeroed 1-D C-contiguous array of n elements for flat_grad
    (default xp.zeros; e.g. rtxmpi.shared_zeros); recompute: the activation recomputation policy
    (the `recompute` attribute). Raises ConfigError for a bad dtype, grad_alloc result, duplicate
    name, unknown or later tie target, a last unit without a head, or a bad recompute.

    Attributes: xp, dtype, modules (the unit modules), params (list[Param] in index order = unit
    order), flat_data, flat_grad (1-D contiguous, length num_params), num_params, units (list of
    (first, stop) parameter-index ranges, one per unit), provider (FlatParams(self) unless
    use_provider()), recompute (settable between steps): "none"; "blocks", every unit between
    the first and the last (a transformer's blocks); or a list of unit indices (not the last,
    the head). Forward keeps only a recomputed unit's input and backward reruns its forward,
    with the same parameters, just before its backward: the same bits, one extra forward of
    those units, activations of one unit at a time instead of all of them.
    """

    def __init__(self, units, seed=0, xp=np, dtype=np.float32, grad_alloc=None, recompute="none"):
        dtype = np.dtype(dtype)
        if dtype.kind != "f":
            raise ConfigError(f"{type(self).__name__} dtype must be a floating type, got {dtype.name}")
        self.xp, self.dtype = xp, dtype
        units = list(units)
        self.modules = [m for _, m in map(_named, units)]
        if not self.modules or not hasattr(self.modules[-1], "loss_forward"):
            raise ConfigError("a Model's last unit must end in a head (a module with loss_forward)")
        own, specs = own_layout(units)
        self.num_params = specs[-1].stop if specs else 0
        self.flat_data = xp.asarray(init_flat(own, specs, seed).astype(dtype))
        self.flat_grad = (grad_alloc or xp.zeros)(self.num_params, dtype=dtype)
        grad = self.flat_grad
        if (getattr(grad, "shape", None) != (self.num_params,) or grad.dtype != dtype
                or not grad.flags.c_contiguous or type(grad) is not type(self.flat_data)):
            raise ConfigError(f"grad_alloc returned {type(grad).__name__} "
                              f"{getattr(grad, 'shape', None)} {getattr(grad, 'dtype', None)}; "
                              f"expected a C-contiguous {type(self.flat_data).__name__} "
                              f"({self.num_params},) {dtype}")
        self.params = bind(specs, self.flat_data, self.flat_grad)
        self._by_name = {p.name: p for p in self.params}
        self._plan(declarations(units))
        self.provider = FlatParams(self)
        self.recompute = recompute

    def _plan(self, unit_decls):
        """units, and per unit: where each declared array comes from ((unit, position among that
        unit's own arrays) pairs), its parameter index (None where tied), the units it borrows
        tied arrays from (in first-use order)."""
        self.units, self._sources, self._index, self._owners = [], [], [], []
        where, first = {}, 0  # where: full name -> (unit, position)
        for u, decls in enumerate(unit_decls):
            sources, index, owners, k = [], [], [], 0
            for d in decls:
                if d.tied_to is None:
                    where[d.name] = (u, k)
                    sources.append((u, k))
                    index.append(first + k)
                    k += 1
                    continue
                if d.tied_to not in where:
                    raise ConfigError(f"parameter {d.name!r} is tied to {d.tied_to!r}, which is not "
                                      f"a parameter of an earlier unit")
                o, j = where[d.tied_to]
                target = self.params[self.units[o][0] + j]
                if target.shape != d.shape:
                    raise ConfigError(f"parameter {d.name!r} {d.shape} is tied to {d.tied_to!r} "
                                      f"{target.shape}: the shapes must match")
                sources.append((o, j))
                index.append(None)
                if o not in owners:
                    owners.append(o)
            self.units.append((first, first + k))
            self._sources.append(sources)
            self._index.append(index)
            self._owners.append(owners)
            first += k

    @property
    def recompute(self):
        """"none", "blocks" or the sorted list of recomputed unit indices (see the class)."""
        return self._recompute

    @recompute.setter
    def recompute(self, policy):
        n = len(self.modules)
        if isinstance(policy, str):
            if policy not in RECOMPUTE:
                raise ConfigError(f"recompute {policy!r} must be one of {RECOMPUTE} or a list of "
                                  f"unit indices")
            chosen = set(range(1, n - 1)) if policy == "blocks" else set()
        else:
            try:
                chosen = set(policy)
            except TypeError:
                raise ConfigError(f"recompute {policy!r} must be one of {RECOMPUTE} or a list of "
                                  f"unit indices") from None
            if not all(isinstance(u, (int, np.integer)) and not isinstance(u, bool)
                       and 0 <= u < n - 1 for u in chosen):
                raise ConfigError(f"recompute {sorted(chosen, key=str)}: unit indices must be ints "
                                  f"in [0, {n - 1}) (the last unit, the head, is never recomputed)")
            policy = sorted(int(u) for u in chosen)
        self._recompute = policy
        again = [u in chosen for u in range(n)]
        # backward fetches a unit whose backward reads parameters or whose forward reruns; its
        # prefetch hint is the previous unit that fetches
        fetches = [m.backward_needs_params or a for m, a in zip(self.modules, again)]
        hints = [next((v for v in range(u - 1, -1, -1) if fetches[v]), None) for u in range(n)]
        self._recompute_plan = (again, fetches, hints)

    @property
    def recompute_units(self):
        """The unit indices (sorted) whose forward reruns in backward under `recompute`."""
        return [u for u, again in enumerate(self._recompute_plan[0]) if again]

    def use_provider(self, provider, drop_flat=False):
        """Take parameters and gradients from `provider` (rtxmpi.nn.gpt's module docstring) from
        now on. drop_flat: also let go of flat_data, flat_grad and the Param views (they become
        None), so that only the provider holds parameter memory (ZeRO-3); load_flat then raises
        ConfigError and zero_grad does nothing. Local."""
        self.provider = provider
        if drop_flat:
            self.flat_data = self.flat_grad = None
            for p in self.params:
                p.data = p.grad = None

    def unit_params(self, u):
        """Parameter indices of unit u's declarations, in declaration order: its own, and for a
        tied declaration the owner's index (a parameter of an earlier unit)."""
        return [self.units[o][0] + j for o, j in self._sources[u]]

    def param(self, name):
        """The Param called `name`. Raises ConfigError if unknown."""
        try:
            return self._by_name[name]
        except KeyError:
            raise ConfigError(f"no parameter named {name!r}; see [p.name for p in model.params]")

    def zero_grad(self):
        """Set every gradient to zero (the whole flat_grad buffer; nothing once dropped)."""
        if self.flat_grad is not None:
            self.flat_grad.fill(0)

    def load_flat(self, array):
        """Copy a flat parameter vector (numpy or cupy, any float dtype, length num_params) into
        flat_data (cast to the model dtype). Raises ConfigError on a wrong size."""
        if self.flat_data is None:
            raise ConfigError("this model's parameters are held by its provider (ZeRO-3): load "
                              "them through it, e.g. ZeroDataParallel.load_shards")
        shape = getattr(array, "shape", None)
        if shape != (self.num_params,):
            raise ConfigError(f"load_flat expects a 1-D array of {self.num_params} elements "
                              f"(model.num_params), got shape {shape}")
        if self.xp is np and xp_of(array) is not np:
            array = array.get()  # a cupy array into a numpy model: copy to the host first
        self.flat_data[...] = self.xp.asarray(array, dtype=self.dtype)

    # ------------------------------------------------------------------ provider traffic
    def _take(self, u, then, get):
        """Unit u's arrays in declaration order: fetch (get=True; `then` is the hint after the
        tied owners) or grads; owners' arrays for tied declarations."""
        P, owners = self.provider, self._owners[u]
        if get:
            hints = owners + [then]
            arrays = {u: P.fetch(u, then=hints[0])}
            for i, o in enumerate(owners):
                arrays[o] = P.fetch(o, then=hints[i + 1])
        else:
            arrays = {o: P.grads(o) for o in [u] + owners}
        return [arrays[o][j] for o, j in self._sources[u]]

    def _release(self, u):
        for o in self._owners[u]:
            self.provider.release(o)
        self.provider.release(u)

    # ------------------------------------------------------------------ passes
    def _run(self, x, keep=True):
        """All units forward: (y, unit caches, unit inputs). keep=False: no cache or input kept;
        otherwise a recomputed unit keeps its input instead of its cache."""
        caches, inputs, n = [], [], len(self.modules)
        for u, m in enumerate(self.modules):
            params = self._take(u, u + 1 if u + 1 < n else None, get=True)
            again = keep and self._recompute_plan[0][u]
            inputs.append(x if again else None)
            with span(f"unit {u} forward", "compute", unit=u):
                x, cache = m.forward(params, x)
            caches.append(cache if keep and not again else None)
            self._release(u)
        return x, caches, inputs

    def forward(self, x, targets):
        """Loss and cache for one (micro-)batch: x and targets as the first unit and the head
        take them (not validated here). Returns (loss, cache): loss a Python float; cache for
        `backward`."""
        y, caches, inputs = self._run(x)
        loss, loss_cache = self.modules[-1].loss_forward(y, targets)
        return float(loss), ModelCache(caches, inputs, loss_cache, self._recompute_plan)

    def predict(self, x):
        """The last unit's output (e.g. logits) without the loss; no cache kept."""
        return self._run(x, keep=False)[0]

    def backward(self, cache, scale=1.0, grad_ready=None):
        """Add the gradient of `scale * loss` into the gradients (flat_grad, or wherever
        provider.grads() points); never overwrites, so calls accumulate.

        cache: from `forward` (not consumed). grad_ready: optional callable(i), called once per
        parameter index i as soon as its gradient is final: units last to first, inside a unit
        as its modules report (last declared first by default); a tied parameter with its owner.
        A recomputed unit (`recompute`) reruns its forward on the kept input first, with the
        parameters it fetches for its backward; `cache` is not modified.
        """
        P, (again, fetches, hints) = self.provider, cache.plan
        dy = self.modules[-1].loss_backward(scale, cache.loss)
        for u in range(len(self.modules) - 1, -1, -1):
            m, fetch, unit_cache = self.modules[u], fetches[u], cache.units[u]
            params = self._take(u, hints[u], get=True) if fetch else None
            if again[u]:  # the forward kept the unit's input instead of its cache
                with span(f"unit {u} recompute", "compute", unit=u):
                    unit_cache = m.forward(params, cache.inputs[u])[1]
            ready = None if grad_ready is None else self._reporter(u, grad_ready)
            with span(f"unit {u} backward", "compute", unit=u):
                dy = run_backward(m, params if m.backward_needs_params else None,
                                  self._take(u, None, get=False), unit_cache, dy, ready)
            if fetch:
                self._release(u)
            P.grads_ready(u)

    def _reporter(self, u, grad_ready):
        """ready(j) for unit u's declaration j -> grad_ready(parameter index); silent where tied
        (the owner's unit reports it)."""
        index = self._index[u]

        def ready(j):
            if index[j] is not None:
                grad_ready(index[j])
        return ready
