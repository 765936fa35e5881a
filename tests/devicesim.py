"""A stand-in for cupy whose arrays are NOT numpy arrays, for proving code xp-agnostic on a CPU.

`install(monkeypatch)` makes `rtxmpi.backend.cupy_module()` return this module, so `xp_of(x)` of
a `SimArray` is this module, `is_device_array` is True, and every layer takes its "cupy" path.
The arrays keep their values in host memory (a private numpy array), and behave like cupy's:

- numpy refuses them: `np.asarray`, `np.ascontiguousarray`, `np.concatenate`, `np.add.at`,
  h5py writes and mpi4py buffers raise TypeError (no `__array__`, no buffer protocol, and
  `__array_ufunc__ = None`), as cupy refuses implicit device-to-host conversion. So a stray
  numpy call on a "device" array fails loudly instead of silently computing on the host.
- mixing them with a numpy array (`sim + np_array`, `xp.concatenate([sim, np_array])`) raises
  TypeError, as cupy does; numpy scalars and Python numbers are fine. `xp.asarray(np_array)`,
  `sim[:] = np_array` (cupy copies a numpy value into a whole `[:]` only) and `sim.set(np_array)`
  are the host-to-device copies, `.get()` and `xp.asnumpy` the device-to-host ones.
- reductions and scalar indexing give 0-d arrays (not numpy scalars), as in cupy.
- only names cupy has exist: `xp.<function>` and `SimArray.<method>` are whitelisted
  (`tobytes`, `tostring`, `resize`, ... raise AttributeError, as on cupy).
- `RawModule` emulates rtxmpi's CUDA kernels (kernels/*.cu) with the numpy references of
  `rtxmpi.kernels`, after checking each launch against the kernel's C signature parsed from its
  source (pointer arguments must be device arrays, float* ones float32; `long long`, `int` and
  `float` arguments must be numpy int64, int32, float32) and counts (n, C) against the arrays.
  `launches` counts launches by kernel name.

What it does not model: streams are no-ops (everything is synchronous; events time the host
clock), memory is host memory, and kernels are their references (so a sim run is bit for bit the
numpy run). NCCL is absent (`rtxmpi.comm.nccl.nccl_module()` stays None).
"""
import ctypes
import re
import time
import types

import numpy as np

import rtxmpi.backend as backend
from rtxmpi import kernels as _kernels

# ------------------------------------------------------------------------- what cupy has
FUNCTIONS = frozenset("""
abs absolute add all allclose amax amin any arange arccos arcsin arctan arctan2 argmax argmin
argsort argwhere around array array_equal array_split asarray ascontiguousarray
atleast_1d atleast_2d average bincount broadcast_arrays broadcast_to ceil clip concatenate copy
copyto cos cosh count_nonzero cumprod cumsum diag diagonal diff divide dot einsum empty
empty_like equal exp expand_dims expm1 eye flatnonzero flip floor floor_divide full full_like
greater greater_equal hstack identity isclose isfinite isinf isnan less less_equal linspace log
log1p log2 logical_and logical_not logical_or matmul max maximum mean min minimum mod moveaxis
multiply nan_to_num negative nonzero not_equal ones ones_like outer pad power prod ptp put
ravel reciprocal remainder repeat reshape result_type rint round searchsorted sign sin sinh
sort split sqrt square squeeze stack std subtract sum swapaxes take tanh tensordot tile
transpose tri tril triu true_divide unique var vstack where zeros zeros_like
""".split())
UFUNCS = frozenset("""
abs absolute add arccos arcsin arctan arctan2 ceil cos cosh divide equal exp expm1 floor
floor_divide greater greater_equal isfinite isinf isnan less less_equal log log1p log2
logical_and logical_not logical_or maximum minimum mod multiply negative not_equal power
reciprocal remainder rint sign sin sinh sqrt square subtract tanh true_divide
""".split())
METHODS = frozenset("""
all any argmax argmin argpartition argsort astype choose clip compress conj conjugate copy
cumprod cumsum diagonal dot fill flatten get item max mean min nonzero partition prod ptp put
ravel repeat reshape round searchsorted set sort squeeze std sum swapaxes take tolist trace
transpose var view
""".split())
ATTRIBUTES = frozenset("T base dtype flags imag itemsize nbytes ndim real shape size strides".split())
CONSTANTS = {name: getattr(np, name) for name in (
    "float16 float32 float64 int8 int16 int32 int64 uint8 uint16 uint32 uint64 bool_ "
    "complex64 complex128 inf nan pi e newaxis dtype integer floating number generic".split())}


class HostDeviceMix(TypeError):
    """A numpy array handed where the stand-in (as cupy) takes only device arrays."""


def _refuse_host(value, where):
    if isinstance(value, np.ndarray) and value.ndim > 0:
        raise HostDeviceMix(f"{where}: got a numpy.ndarray {value.shape} where cupy needs a cupy "
                            "array (move it with xp.asarray)")


def _unwrap(value, where):
    """A SimArray's numpy array; lists/tuples unwrapped inside; numpy arrays refused."""
    if isinstance(value, SimArray):
        return value._a
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v, where) for v in value)
    _refuse_host(value, where)
    return value


def _wrap(value):
    """numpy results as SimArrays (scalars as 0-d arrays, as cupy returns); tuples elementwise."""
    if isinstance(value, np.ndarray):
        return SimArray(value)
    if isinstance(value, np.generic):
        return SimArray(np.asarray(value))
    if isinstance(value, tuple):
        return tuple(_wrap(v) for v in value)
    if isinstance(value, list):
        return [_wrap(v) for v in value]
    return value


def _call(fn, where, args, kwargs):
    out = kwargs.get("out")
    args = [_unwrap(a, where) for a in args]
    kwargs = {k: _unwrap(v, where) for k, v in kwargs.items()}
    result = fn(*args, **kwargs)
    if out is not None and isinstance(result, np.ndarray) and result is kwargs["out"]:
        return out  # the caller's SimArray, as cupy returns `out`
    return _wrap(result)


class _Flags:
    def __init__(self, a):
        self.c_contiguous = a.flags.c_contiguous
        self.f_contiguous = a.flags.f_contiguous
        self.owndata = a.flags.owndata

    def __getitem__(self, key):
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous,
                "OWNDATA": self.owndata}[key]


class _Memory:
    def __init__(self, a):
        self.ptr = a.__array_interface__["data"][0] if a.size else 0


def _binary(name, reflected=False):
    def op(self, other):
        _refuse_host(other, f"cupy.ndarray.{name}")
        other = other._a if isinstance(other, SimArray) else other
        fn = getattr(self._a, name)
        result = fn(other)
        if result is NotImplemented:
            return result
        if name.startswith("__i"):
            return self
        return _wrap(result)
    op.__name__ = name
    return op


class SimArray:
    """A "device" array (see the module docstring). Construct through the module's functions."""

    __array_ufunc__ = None  # numpy ufuncs and numpy-scalar operators refuse (or defer to us)
    __hash__ = None

    def __init__(self, a):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"SimArray wraps a numpy array, got {type(a).__name__}")
        self._a = a

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` "
                        "to construct a NumPy array explicitly. (rtxmpi device stand-in)")

    def __getattr__(self, name):
        if name in ATTRIBUTES:
            value = getattr(self._a, name)
            if name == "base":
                return None if value is None else self
            return _wrap(value) if name in ("T", "real", "imag") else value
        if name in METHODS:
            return getattr(self, "_m_" + name, None) or (
                lambda *a, **k: _call(getattr(self._a, name), f"cupy.ndarray.{name}", a, k))
        raise AttributeError(f"'cupy.ndarray' object has no attribute {name!r} (device stand-in)")

    @property
    def flags(self):
        return _Flags(self._a)

    @property
    def data(self):
        return _Memory(self._a)

    @property
    def device(self):
        return Device(0)

    # ---- cupy's own methods (differ from numpy's)
    def _m_get(self, stream=None, order="C", out=None):
        if out is not None:
            if not isinstance(out, np.ndarray):
                raise TypeError("cupy.ndarray.get: out must be a numpy.ndarray")
            if out.shape != self._a.shape or out.dtype != self._a.dtype:
                raise ValueError("cupy.ndarray.get: out has another shape or dtype")
            out[...] = self._a
            return out
        return np.array(self._a, order=order)

    def _m_set(self, arr, stream=None):
        if not isinstance(arr, np.ndarray):
            raise TypeError("cupy.ndarray.set: arr must be a numpy.ndarray")
        if arr.shape != self._a.shape or arr.dtype != self._a.dtype:
            raise ValueError(f"cupy.ndarray.set: shape/dtype {arr.shape} {arr.dtype} != "
                             f"{self._a.shape} {self._a.dtype}")
        if not (self._a.flags.c_contiguous or self._a.flags.f_contiguous):
            raise RuntimeError("cupy.ndarray.set: the array must be contiguous")
        self._a[...] = arr

    def _m_view(self, dtype=None):
        return SimArray(self._a.view(dtype) if dtype is not None else self._a.view())

    def _m_astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        return SimArray(self._a.astype(dtype, order=order, copy=copy))

    def _m_tolist(self):
        return self._a.tolist()

    def _m_item(self):
        return self._a.item()

    # ---- indexing, conversions, iteration
    def __getitem__(self, key):
        return _wrap(self._a[_unwrap_index(key)])

    def __setitem__(self, key, value):
        if isinstance(value, SimArray):
            value = value._a
        elif isinstance(value, np.ndarray) and value.ndim > 0 and not (
                isinstance(key, slice) and key == slice(None)):
            # cupy copies a numpy value only into `x[:]` (cupy#2079); elsewhere it raises
            raise HostDeviceMix(f"cupy.ndarray.__setitem__[{key!r}]: a non-scalar numpy.ndarray "
                                "value is only copied into x[:]; move it with xp.asarray")
        self._a[_unwrap_index(key)] = value

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        for row in self._a:
            yield _wrap(row)

    def __bool__(self):
        return bool(self._a)

    def __float__(self):
        return float(self._a)

    def __int__(self):
        return int(self._a)

    def __complex__(self):
        return complex(self._a)

    def __neg__(self):
        return SimArray(-self._a)

    def __pos__(self):
        return SimArray(+self._a)

    def __abs__(self):
        return SimArray(abs(self._a))

    def __invert__(self):
        return SimArray(~self._a)

    def __repr__(self):
        return f"sim.array({self._a!r})"

    def __reduce__(self):
        raise TypeError("device arrays are not pickled (device stand-in)")


def _unwrap_index(key):
    if isinstance(key, SimArray):
        return key._a
    if isinstance(key, tuple):
        return tuple(k._a if isinstance(k, SimArray) else k for k in key)
    return key


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
              "xor", "lshift", "rshift"):
    for _form in ("__{}__", "__r{}__", "__i{}__"):
        setattr(SimArray, _form.format(_name), _binary(_form.format(_name)))
for _name in ("lt", "le", "eq", "ne", "gt", "ge"):
    setattr(SimArray, f"__{_name}__", _binary(f"__{_name}__"))


# --------------------------------------------------------------------------- the module
class _Ufunc:
    def __init__(self, name):
        self._u, self.__name__ = getattr(np, name), name

    def __call__(self, *args, **kwargs):
        return _call(self._u, f"cupy.{self.__name__}", args, kwargs)

    def __getattr__(self, method):
        if method in ("reduce", "accumulate", "reduceat", "outer", "at"):
            return lambda *a, **k: _call(getattr(self._u, method),
                                         f"cupy.{self.__name__}.{method}", a, k)
        return getattr(self._u, method)


ndarray = SimArray


def asarray(a, dtype=None, order=None):
    """An explicit host-to-device copy (numpy input) or a (maybe cast) view of a device array."""
    if isinstance(a, SimArray):
        return a if dtype is None or a._a.dtype == np.dtype(dtype) else SimArray(a._a.astype(dtype))
    return SimArray(np.array(a, dtype=dtype, order=order or "K"))


def array(a, dtype=None, copy=True, order="K"):
    if isinstance(a, SimArray):
        return SimArray(np.array(a._a, dtype=dtype, copy=copy, order=order))
    return SimArray(np.array(a, dtype=dtype, order=order))


def asnumpy(a, stream=None, order="C", out=None):
    """Device to host (numpy input passes through, as in cupy)."""
    if isinstance(a, SimArray):
        return a.get(order=order, out=out)
    return np.asarray(a, order=order)


def get_array_module(*args):
    return SimModule if any(isinstance(a, SimArray) for a in args) else np


# ---- cuda: streams and events are synchronous no-ops
class Stream:
    null = None

    def __init__(self, null=False, non_blocking=False, ptds=False):
        self.ptr = id(self)

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record(self, event=None):
        return event or Event()

    def use(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.done, self.time_s = False, None

    def record(self, stream=None):
        self.done, self.time_s = True, time.perf_counter()

    def synchronize(self):
        pass


def _elapsed_ms(start, stop):
    """cupy.cuda.get_elapsed_time: milliseconds between two recorded events (host clock here)."""
    if start.time_s is None or stop.time_s is None:
        raise RuntimeError("get_elapsed_time: both events must be recorded")
    return (stop.time_s - start.time_s) * 1e3


def _memcpy(dst, src, nbytes, kind, stream=0):
    ctypes.memmove(dst, src, nbytes)


class Device:
    def __init__(self, device=None):
        self.id = 0 if device is None else int(device)
        self.attributes = {"MultiProcessorCount": 4}

    def use(self):
        pass

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _PinnedMemory(bytearray):
    """Page-locked host memory's stand-in: a writable buffer numpy.frombuffer can view."""


_CURRENT_STREAM = Stream()
cuda = types.SimpleNamespace(
    Stream=Stream, Event=Event, Device=Device, get_current_stream=lambda: _CURRENT_STREAM,
    alloc_pinned_memory=lambda nbytes: _PinnedMemory(int(nbytes)), get_elapsed_time=_elapsed_ms,
    runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, deviceSynchronize=lambda: None,
                                  memcpyAsync=_memcpy, memcpyDeviceToDevice=3,
                                  getDeviceProperties=lambda i: {"name": b"device stand-in"}))


class _Generator:
    """cupy.random.default_rng(seed): float32/float64 draws as device arrays."""

    def __init__(self, seed=None):
        self._rng = np.random.default_rng(seed)

    def standard_normal(self, size=None, dtype=np.float64):
        return SimArray(np.asarray(self._rng.standard_normal(size, dtype=dtype)))

    def random(self, size=None, dtype=np.float64):
        return SimArray(np.asarray(self._rng.random(size, dtype=dtype)))


random = types.SimpleNamespace(default_rng=_Generator)


# ---- kernels: rtxmpi's CUDA sources, emulated by their numpy references
_SIGNATURE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)', re.S)
_SCALARS = {"long long": np.int64, "int": np.int32, "float": np.float32}
launches = {}  # kernel function name -> number of launches


def kernel_signatures(source):
    """{function: [(C type, is_pointer), ...]} of the extern "C" __global__ functions in source."""
    table = {}
    for name, params in _SIGNATURE.findall(source):
        parsed = []
        for param in params.split(","):
            words = param.replace("__restrict__", "").replace("const", "").replace("*", " * ")
            words = words.split()[:-1]  # drop the parameter name
            pointer = "*" in words
            parsed.append((" ".join(w for w in words if w != "*"), pointer))
        table[name] = parsed
    return table


class RawModule:
    """cupy.RawModule(code=...): functions checked against their signatures, then emulated."""

    def __init__(self, code=None, options=(), **kwargs):
        self.signatures = kernel_signatures(code)
        if not self.signatures:
            raise ValueError("RawModule: no extern \"C\" __global__ function in the source")

    def get_function(self, name):
        if name not in self.signatures:
            raise AttributeError(f"RawModule has no function {name!r} (cuModuleGetFunction)")
        return _Kernel(name, self.signatures[name])


class _Kernel:
    def __init__(self, name, signature):
        self.name, self.signature = name, signature

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        if len(args) != len(self.signature):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.signature)} "
                            "parameters")
        for i, (arg, (ctype, pointer)) in enumerate(zip(args, self.signature)):
            if pointer:
                if not isinstance(arg, SimArray):
                    raise TypeError(f"{self.name} argument {i} ({ctype}*): expected a device "
                                    f"array, got {type(arg).__name__}")
                if ctype == "float" and arg.dtype != np.float32:
                    raise TypeError(f"{self.name} argument {i} (float*): dtype {arg.dtype}")
                if ctype == "float" and not arg._a.flags.c_contiguous:
                    raise TypeError(f"{self.name} argument {i} (float*): not C-contiguous")
            elif type(arg) is not _SCALARS[ctype]:
                raise TypeError(f"{self.name} argument {i} ({ctype}): pass numpy "
                                f"{_SCALARS[ctype].__name__}, got {type(arg).__name__}")
        if not (isinstance(grid, tuple) and isinstance(block, tuple) and grid[0] >= 1
                and 1 <= block[0] <= 1024):
            raise ValueError(f"{self.name}: bad launch configuration grid={grid} block={block}")
        launches[self.name] = launches.get(self.name, 0) + 1
        _EMULATIONS[self.name.replace("_f32x4", "_f32")](*[
            a._a if isinstance(a, SimArray) else a for a in args])


def _check_count(name, n, *arrays):
    for a in arrays:
        if a.size != n:
            raise ValueError(f"{name}: n={n} but an array argument has {a.size} elements")


def _emulate_grad_epilogue(g, out, flag, n, scale, kind):
    _check_count("grad_epilogue", n, g)
    g *= scale
    bad = not bool(np.isfinite(g).all())
    if kind:
        _check_count("grad_epilogue (out)", n, out)
        if kind == 1:
            with np.errstate(over="ignore"):
                out.view(np.uint16)[...] = g.astype(np.float16).view(np.uint16).reshape(out.shape)
            bad = bad or not bool(np.isfinite(out.view(np.float16)).all())
        else:
            bits, cast_bad = _kernels._cast_on_device(np, g, "bfloat16")
            out[...] = bits.reshape(out.shape)
            bad = bad or cast_bad
    if bad:
        flag[...] = 1


def _emulate_adamw(p, g, m, v, mask, n, b1, b2, decay, lr_wd, eps_term, step_size, mode):
    _check_count("adamw", n, p, g, m, v)
    m -= g
    m *= b1
    m += g
    gg = g * g
    v -= gg
    v *= b2
    v += gg
    if mode == 1:
        p *= decay
    elif mode == 2:
        _check_count("adamw (mask)", n, mask)
        p -= (mask * p) * lr_wd
    with np.errstate(invalid="ignore"):  # sqrtf of a negative v is NaN, silently
        t = np.sqrt(v)
    t += eps_term
    t = m / t
    t *= step_size
    p -= t


def _emulate_bias_gelu_forward(h, b, u_out, y, n, C, kc, k):
    _check_count("bias_gelu_forward", n, h, u_out, y)
    _check_count("bias_gelu_forward (bias)", C, b)
    u, out = _kernels.bias_gelu_forward(h, b)
    u_out[...], y[...] = u, out


def _emulate_bias_gelu_backward(dy, u, du, n, kc, k, kc6, k2):
    _check_count("bias_gelu_backward", n, dy, u, du)
    du[...] = _kernels.bias_gelu_backward(dy, u)[0]


def _emulate_residual_layernorm(x, r, g, b, s, y, mean, rstd, C, eps):
    _check_count("residual_layernorm_forward", C, g, b)
    _check_count("residual_layernorm_forward", x.size, r, s, y)
    _check_count("residual_layernorm_forward (rows)", x.size // C, mean, rstd)
    s_, y_, mean_, rstd_ = _kernels.residual_layernorm_forward(x, r, g, b, float(eps))
    s[...], y[...], mean[...], rstd[...] = s_, y_, mean_, rstd_


def _emulate_softmax_forward(att, rows, T, Tq, causal):
    _check_count("softmax_forward", rows * T, att)
    att[...] = _kernels.softmax_forward(att.reshape(-1, Tq, T).copy(), bool(causal)).reshape(att.shape)


def _emulate_softmax_backward(datt, att, rows, T):
    _check_count("softmax_backward", rows * T, datt, att)
    datt[...] = _kernels.softmax_backward(datt.copy(), att)


def _emulate_layernorm_backward_dx(dy, xhat, rstd, g, dx, C):
    _check_count("layernorm_backward_dx", C, g)
    _check_count("layernorm_backward_dx", dy.size, xhat, dx)
    _check_count("layernorm_backward_dx (rows)", dy.size // C, rstd)
    dx[...] = _kernels.layernorm_backward(dy.reshape(-1, C), xhat.reshape(-1, C),
                                          rstd.reshape(-1, 1), g)[0].reshape(dx.shape)


def _emulate_column_sums(a, b, partial, rows, C, per, with_product):
    _check_count("column_sums", rows * C, a, b)
    chunks = -(-rows // per)
    _check_count("column_sums (partial)", (2 if with_product else 1) * chunks * C, partial)
    a2, b2, out = a.reshape(rows, C), b.reshape(rows, C), partial.reshape(-1, C)
    for i in range(chunks):
        out[i] = a2[i * per:(i + 1) * per].sum(axis=0)
        if with_product:
            out[chunks + i] = (a2[i * per:(i + 1) * per] * b2[i * per:(i + 1) * per]).sum(axis=0)


_EMULATIONS = {"grad_epilogue_f32": _emulate_grad_epilogue, "adamw_f32": _emulate_adamw,
               "bias_gelu_forward_f32": _emulate_bias_gelu_forward,
               "bias_gelu_backward_f32": _emulate_bias_gelu_backward,
               "residual_layernorm_forward_f32": _emulate_residual_layernorm,
               "softmax_forward_f32": _emulate_softmax_forward,
               "softmax_backward_f32": _emulate_softmax_backward,
               "layernorm_backward_dx_f32": _emulate_layernorm_backward_dx,
               "column_sums_f32": _emulate_column_sums}


# ---- the module object
class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name in CONSTANTS:
            return CONSTANTS[name]
        if name in UFUNCS:
            return _Ufunc(name)
        if name in FUNCTIONS:
            fn = getattr(np, name)
            return lambda *a, **k: _call(fn, f"cupy.{name}", a, k)
        raise AttributeError(f"module 'cupy' has no attribute {name!r} (device stand-in)")


SimModule = _Module("cupy_sim", __doc__)
for _name, _value in {"ndarray": ndarray, "asarray": asarray, "array": array, "asnumpy": asnumpy,
                      "get_array_module": get_array_module, "cuda": cuda, "random": random,
                      "__version__": "stand-in",
                      "RawModule": RawModule, "launches": launches, "SimArray": SimArray,
                      "HostDeviceMix": HostDeviceMix}.items():
    setattr(SimModule, _name, _value)


def install(monkeypatch):
    """Make rtxmpi see this stand-in as cupy (and one GPU) until the monkeypatch is undone;
    compiled kernel modules are cleared before and after. Returns the stand-in module."""
    monkeypatch.setattr(backend, "_cupy", SimModule)
    monkeypatch.setattr(backend, "_cupy_checked", True)
    monkeypatch.setattr(_kernels, "_modules", {})
    launches.clear()
    return SimModule


def to_device(a):
    """A numpy array as a stand-in device array (a copy)."""
    return SimModule.asarray(a)
