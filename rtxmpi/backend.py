"""Array modules, dtypes, device selection and the host allocator under numpy.

Everything above this layer is array-module agnostic: it asks `xp_of(x)` for the module of an array
(numpy or cupy) and uses only what both provide. cupy is optional; it is imported lazily so that a
CPU-only install never pays for it.
"""
import ctypes
import os
import socket

import numpy as np

from .errors import ConfigError

try:  # bfloat16 for numpy comes from ml_dtypes (a dependency of jax/tensorflow), when installed
    import ml_dtypes

    bfloat16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    bfloat16 = None

_cupy = None
_cupy_checked = False


def cupy_module():
    """Return the cupy module, or None when cupy is not installed."""
    global _cupy, _cupy_checked
    if not _cupy_checked:
        _cupy_checked = True
        try:
            import cupy

            _cupy = cupy
        except Exception:
            _cupy = None
    return _cupy


def xp_of(x):
    """The array module (numpy or cupy) that owns array `x`."""
    if isinstance(x, np.ndarray) or np.isscalar(x):
        return np
    cp = cupy_module()
    if cp is not None and isinstance(x, cp.ndarray):
        return cp
    raise TypeError(f"expected a numpy or cupy array, got {type(x).__name__}")


def is_device_array(x):
    """True when `x` lives on a GPU (a cupy array)."""
    return xp_of(x) is not np


def gpu_count():
    """Number of CUDA devices visible to this process (0 without cupy or a driver)."""
    cp = cupy_module()
    if cp is None:
        return 0
    try:
        return cp.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def array_module(device):
    """The array module for a --device value: numpy for "cpu", cupy for "cuda".

    Raises ConfigError when device is neither, or "cuda" without cupy or a visible GPU."""
    if device == "cpu":
        return np
    if device != "cuda":
        raise ConfigError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if cupy_module() is None:
        raise ConfigError("device 'cuda' needs cupy: pip install -e '.[cuda12]'")
    if gpu_count() == 0:
        raise ConfigError("device 'cuda': cupy sees no CUDA device (driver, CUDA_VISIBLE_DEVICES)")
    return cupy_module()


def to_host(x):
    """`x` as a host value: a cupy array copied to numpy (synchronizing its stream); numpy
    arrays and scalars unchanged."""
    return x.get() if is_device_array(x) else x


def host_empty(shape, dtype, pinned=False):
    """An uninitialized numpy array; in page-locked (pinned) host memory when `pinned` and a GPU
    is usable, so device<->host copies run at full link speed (the documented cupy idiom:
    numpy.frombuffer over cupy.cuda.alloc_pinned_memory). Pageable memory otherwise."""
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    count = int(np.prod(shape, dtype=np.int64))
    if pinned and gpu_count() > 0:
        memory = cupy_module().cuda.alloc_pinned_memory(max(1, count * np.dtype(dtype).itemsize))
        return np.frombuffer(memory, dtype, count).reshape(shape)
    return np.empty(shape, dtype)


def copy_to_host(x, out):
    """Copy array `x` (numpy or cupy) into the numpy array `out` of the same shape: straight
    from the device into `out` when dtypes match (no temporary), else through a host copy."""
    if is_device_array(x) and x.dtype == out.dtype and out.flags.c_contiguous:
        x.get(out=out)
    else:
        out[...] = to_host(x)


def device_identity(local_rank):
    """(host name, PCI bus id) of the GPU select_device(local_rank) binds, or None without a
    GPU: ranks with equal identities share one GPU (CUDA_VISIBLE_DEVICES taken into account).
    Local."""
    n = gpu_count()
    if n == 0:
        return None
    index = local_rank % n
    try:
        bus = cupy_module().cuda.Device(index).pci_bus_id
    except Exception:  # no bus id from this cupy or driver: the index among the visible devices
        bus = f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')}:{index}"
    return (socket.gethostname(), bus)


def select_device(local_rank):
    """Bind this process to GPU `local_rank % gpu_count()`; returns "cuda:i" or "cpu"."""
    n = gpu_count()
    if n == 0:
        return "cpu"
    index = local_rank % n
    cupy_module().cuda.Device(index).use()
    return f"cuda:{index}"


# Collective accumulation: these dtypes are reduced in float32 and cast back.
LOW_PRECISION = {np.dtype(np.float16)} | ({bfloat16} if bfloat16 is not None else set())

SUPPORTED_DTYPES = [np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int8, np.int32,
                                          np.int64, np.uint8, np.bool_)]
if bfloat16 is not None:
    SUPPORTED_DTYPES.append(bfloat16)


def dtype_name(dtype):
    """Short, stable name of a dtype ("float32", "bfloat16", ...)."""
    return np.dtype(dtype).name


def env_flag(name, default=False, environ=None):
    """The boolean environment variable `name` (of os.environ, or the mapping `environ`): True
    for 1/true/yes/on, False for 0/false/no/off (any case, spaces stripped), `default` when unset
    or empty. Raises ConfigError naming the variable and its value for anything else: a typo such
    as RTXMPI_CHECK=2 must not silently pick a side. Local."""
    environ = os.environ if environ is None else environ
    text = environ.get(name, "").strip().lower()
    if not text:
        return default
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={environ[name]!r}: use 1 (on{', default' if default else ''}) or 0 "
                      f"(off{'' if default else ', default'}); true/yes/on and false/no/off are "
                      f"accepted too")


# -- the host allocator under numpy ------------------------------------------------------------
# glibc's malloc serves blocks from 128 KiB up (its M_MMAP_THRESHOLD, raised on the fly to at most
# 32 MiB) with a fresh mmap and unmaps them when freed, and gives the free top of its heap back
# above M_TRIM_THRESHOLD. Every large numpy temporary of a layer's forward or backward then
# page-faults once per 4 KiB page when first written: one forward + backward of the "small" GPT at
# 8 x 128 tokens took about 16,000 minor faults, and ran 30-40% faster without them (4 ranks on
# 2 cores: 150 -> 100 ms alone, 300 -> 210 ms with every rank computing; bench/RESULTS.md,
# "Planner", 2026-12-02 (8428030)). So blocks up to HOST_MMAP_THRESHOLD (glibc's own ceiling,
# the most that glibc before 2.27 accepts) come from the heap, and up to HOST_TRIM_THRESHOLD of
# free heap top stays with the process for the next step, as a caching allocator keeps it.
HOST_MMAP_THRESHOLD = 32 << 20
HOST_TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
_USER_MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def tune_host_allocator(environ=None):
    """Keep numpy's large temporaries in the process (glibc mallopt: HOST_MMAP_THRESHOLD,
    HOST_TRIM_THRESHOLD) instead of mapping and unmapping them every step. Local; called by
    rtxmpi.init() on every rank. Does nothing (returns False) with RTXMPI_HOST_MALLOC=0 (or
    false, no, off), when the user set glibc's own malloc variables (MALLOC_MMAP_THRESHOLD_,
    MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_, or a glibc.malloc tunable in GLIBC_TUNABLES), or off
    glibc; True when both settings took. Cost: freed blocks below HOST_MMAP_THRESHOLD stay
    resident (the process's peak, as with a caching allocator; glibc returns only the free top
    of the heap, beyond HOST_TRIM_THRESHOLD), also in processes forked from this one. Raises
    ConfigError when RTXMPI_HOST_MALLOC is not a boolean (env_flag)."""
    environ = os.environ if environ is None else environ
    if (not env_flag("RTXMPI_HOST_MALLOC", True, environ)
            or any(name in environ for name in _USER_MALLOC_SETTINGS)
            or "glibc.malloc" in environ.get("GLIBC_TUNABLES", "")):
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return False
    except (AttributeError, ValueError, OSError):  # no confstr, or not this name: not glibc
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap_ok = mallopt(_M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD) == 1
    trim_ok = mallopt(_M_TRIM_THRESHOLD, HOST_TRIM_THRESHOLD) == 1
    return mmap_ok and trim_ok
