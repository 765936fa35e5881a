"""Every kernels/*.cu compiles: with nvcc for sm_80 and sm_90 (cubin) whenever nvcc is on PATH,
and with NVRTC — the compiler cupy.RawModule uses at run time — on exactly the source
rtxmpi.kernels hands it, whenever a libnvrtc is found. Neither needs a GPU."""
import ctypes
import ctypes.util
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

from rtxmpi import kernels

SOURCES = sorted(glob.glob(os.path.join(kernels.kernel_dir(), "*.cu")))
NVCC = shutil.which("nvcc")


def test_every_kernel_file_is_known_to_rtxmpi_kernels():
    names = sorted(os.path.basename(p)[:-3] for p in SOURCES)
    assert names == sorted(kernels.KERNEL_FILES)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", SOURCES, ids=os.path.basename)
def test_kernel_compiles_with_nvcc(source, arch, tmp_path):
    out = tmp_path / (os.path.basename(source) + f".{arch}.cubin")
    result = subprocess.run([NVCC, f"-arch={arch}", "-cubin", "-Werror", "all-warnings",
                             "-I", kernels.kernel_dir(), "-o", str(out), source],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 0


def _find_nvrtc():
    """libnvrtc from CUDA_HOME, the CUDA toolkit next to nvcc, pip's nvidia-* wheels, or ldconfig."""
    candidates = []
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    if NVCC:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(NVCC))))
        with open(os.path.realpath(NVCC), "rb") as f:  # a wrapper script names the real nvcc
            head = f.read(400)
        if head.startswith(b"#!"):
            for word in head.split():
                if word.endswith(b"/bin/nvcc"):
                    roots.append(os.path.dirname(os.path.dirname(word.decode())))
    for root in filter(None, roots):
        candidates += sorted(glob.glob(os.path.join(root, "lib*", "libnvrtc.so*")))
    for site in sys.path:
        candidates += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libnvrtc.so*")))
    name = ctypes.util.find_library("nvrtc")
    if name:
        candidates.append(name)
    for path in candidates:
        if "builtins" in path or "alt" in os.path.basename(path):
            continue
        try:  # NVRTC dlopens libnvrtc-builtins by name: load the one beside it first
            for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path),
                                                          "libnvrtc-builtins.so*"))):
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


NVRTC = _find_nvrtc()


def _nvrtc_compile(lib, source, name, arch):
    """Compile `source` to PTX with NVRTC; returns (ok, log, ptx)."""
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
    assert rc == 0, f"nvrtcCreateProgram failed: {rc}"
    options = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
    array = (ctypes.c_char_p * len(options))(*options)
    rc = lib.nvrtcCompileProgram(prog, len(options), array)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    ptx = b""
    if rc == 0:
        ptx_size = ctypes.c_size_t()
        lib.nvrtcGetPTXSize(prog, ctypes.byref(ptx_size))
        buffer = ctypes.create_string_buffer(ptx_size.value)
        lib.nvrtcGetPTX(prog, buffer)
        ptx = buffer.value
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc == 0, log.value.decode(errors="replace"), ptx.decode(errors="replace")


@pytest.mark.skipif(NVRTC is None, reason="no libnvrtc found")
@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
@pytest.mark.parametrize("name", kernels.KERNEL_FILES)
def test_kernel_compiles_with_nvrtc_as_rawmodule_gets_it(name, arch):
    ok, log, ptx = _nvrtc_compile(NVRTC, kernels.kernel_source(name), name + ".cu", arch)
    assert ok, log
    for function in kernels.KERNEL_FUNCTIONS[name]:  # every name rtxmpi launches is an entry
        assert re.search(rf"\.entry\s+{function}\s*\(", ptx), f"no kernel {function} in the PTX"
    lines = kernels.kernel_source(name).splitlines()
    assert not [line for line in lines if line.lstrip().startswith("#include")]  # no include path


def test_kernel_source_names_the_directory_when_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("RTXMPI_KERNEL_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="RTXMPI_KERNEL_DIR"):
        kernels.kernel_source("adamw")
