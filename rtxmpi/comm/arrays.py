"""Arrays of other frameworks (PyTorch, JAX, ...) in the collectives, through DLPack, no copy.

    grad = model.weight.grad                       # a torch.Tensor, CPU or CUDA
    world.all_reduce(grad, op="avg")               # reduced in place in the tensor's own memory
    parts = world.all_gather(grad)                 # a new torch.Tensor

Every collective of ProcessGroup (and DeviceGroup) takes, besides numpy and cupy arrays, any
object with `__dlpack__` and `__dlpack_device__`: a CPU one is viewed as a numpy array
(`numpy.from_dlpack`), a CUDA one as a cupy array (`cupy.from_dlpack`), sharing its memory, so an
in-place collective (all_reduce, broadcast, recv) writes into the caller's object and returns it.
A new result (all_gather, reduce_scatter, all_to_all) goes back to the caller's kind through the
`from_dlpack` of the object's own framework (found from its type's module, already imported by
the caller: `torch.from_dlpack`, `jax.numpy.from_dlpack`), again without a copy; for a framework
with none, the numpy/cupy array is returned. Nothing here imports a framework: rtxmpi imports
neither torch nor jax.
"""
import functools
import sys

import numpy as np

from ..backend import cupy_module
from .work import Work

_CPU, _CUDA, _CUDA_MANAGED = 1, 2, 13  # DLPack device types (dlpack.h DLDeviceType)
# a framework whose top-level module has no from_dlpack: where its importer lives
_IMPORTERS = {"jaxlib": "jax.numpy", "jax": "jax.numpy"}


def is_foreign(x):
    """True for an object the collectives view through DLPack (not numpy, not cupy)."""
    if isinstance(x, np.ndarray) or not (hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__")):
        return False
    cp = cupy_module()
    return cp is None or not isinstance(x, cp.ndarray)


def as_array(x, op):
    """The numpy (CPU) or cupy (CUDA) array sharing `x`'s memory. Raises TypeError naming `op`
    when `x` cannot be viewed (a device without an importer here, a dtype numpy has no DLPack
    code for such as bfloat16, a tensor that requires grad: pass `t.grad` or `t.detach()`)."""
    device = int(x.__dlpack_device__()[0])
    what = f"{op}: a {type(x).__module__}.{type(x).__name__}"
    if device == _CPU:
        importer = np.from_dlpack
    elif device in (_CUDA, _CUDA_MANAGED):
        cp = cupy_module()
        if cp is None:
            raise TypeError(f"{what} on a CUDA device needs cupy to be viewed without a copy "
                            f"(pip install -e '.[cuda12]')")
        importer = cp.from_dlpack
    else:
        raise TypeError(f"{what} on DLPack device type {device} cannot be used: the collectives "
                        f"take CPU (numpy) and CUDA (cupy) memory")
    try:
        return importer(x)
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        raise TypeError(f"{what} cannot be viewed as an array through DLPack: {exc}") from None


def _framework_importer(x):
    """`from_dlpack` of the framework `x` comes from (looked up in sys.modules), or None."""
    root = type(x).__module__.split(".")[0]
    module = sys.modules.get(_IMPORTERS.get(root, root))
    return getattr(module, "from_dlpack", None)


def to_kind(result, like, array):
    """`result` of a collective given `array` (the view of `like`) as `like`'s kind: `like`
    itself when the result is the view (in place), a new object of its framework otherwise
    (None stays None)."""
    if result is array:
        return like
    if result is None:
        return None
    importer = _framework_importer(like)
    return result if importer is None else importer(result)


def accepts_dlpack(method):
    """Decorate a collective `method(self, x, ...)`: a foreign `x` is viewed as an array
    (as_array), and the result (or the Work's, at its completion) converted back (to_kind)."""

    @functools.wraps(method)
    def wrapper(self, x, *args, **kwargs):
        if type(x) is np.ndarray or not is_foreign(x):  # the common case first: one type check
            return method(self, x, *args, **kwargs)
        array = as_array(x, method.__name__.lstrip("_"))
        result = method(self, array, *args, **kwargs)
        if isinstance(result, Work):
            return result.then(lambda value: to_kind(value, x, array))
        return to_kind(result, x, array)

    return wrapper
