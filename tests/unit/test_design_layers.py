"""The layer order of docs/design.md holds on the imports: every module under rtxmpi/ imports only
from its own layer or the layers below it, as that page's table lists them."""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rtxmpi"


def design_layers():
    """[(layer name, [path prefix, ...])] bottom up, from docs/design.md's table."""
    text = (ROOT / "docs" / "design.md").read_text()
    table = text.split("<!-- layers begin -->")[1].split("<!-- layers end -->")[0]
    layers = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] in ("layer", "") or set(cells[0]) <= set("-"):
            continue
        layers.append((cells[0], re.findall(r"`([^`]+)`", cells[1])))
    return layers


def layer_of(path, layers):
    """Index in `layers` of the most specific prefix that names `path` (relative to ROOT), or None."""
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            names = path == prefix or (prefix.endswith("/") and path.startswith(prefix))
            if names and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def module_path(dotted):
    """rtxmpi.a.b -> the file it names (relative to ROOT), or None for a name inside a module."""
    base = ROOT / dotted.replace(".", "/")
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.relative_to(ROOT).as_posix()
    return None


def imported_modules(rel, source):
    """(line, file relative to ROOT) of each rtxmpi module that the source of `rel` imports."""
    package = list(pathlib.PurePosixPath(rel).parent.parts)
    found = []
    for node in ast.walk(ast.parse(source, rel)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1])
                module = base + ("." + node.module if node.module else "")
            else:
                module = node.module or ""
            # `from pkg import name`: the submodule `name` when there is one, nothing for a compiled
            # extension (its C source beside), else pkg itself
            targets = [f"{module}.{a.name}" if module_path(f"{module}.{a.name}") else module
                       for a in node.names
                       if not (ROOT / (module + "." + a.name).replace(".", "/")).with_suffix(".c").is_file()]
        else:
            continue
        for target in targets:
            if target == "rtxmpi" or target.startswith("rtxmpi."):
                while module_path(target) is None and "." in target:
                    target = target.rsplit(".", 1)[0]
                found.append((node.lineno, module_path(target)))
    return found


def test_the_table_names_every_module_and_only_existing_ones():
    layers = design_layers()
    assert [name for name, _ in layers][:3] == ["errors", "trace", "arrays"]
    for _, prefixes in layers:
        for prefix in prefixes:
            assert (ROOT / prefix).exists(), f"docs/design.md names {prefix}, which does not exist"
    unplaced = [p.relative_to(ROOT).as_posix() for p in sorted(PACKAGE.rglob("*.py"))
                if layer_of(p.relative_to(ROOT).as_posix(), layers) is None]
    assert unplaced == [], f"modules in no layer of docs/design.md: {unplaced}"


def upward_imports(files, layers):
    """'file:line (layer) imports file (layer)' for each import of a higher layer in `files`
    ([(path relative to ROOT, source)])."""
    upward = []
    for rel, source in files:
        own = layer_of(rel, layers)
        for line, target in imported_modules(rel, source):
            theirs = layer_of(target, layers)
            if own is not None and theirs is not None and theirs > own:
                upward.append(f"{rel}:{line} ({layers[own][0]}) imports {target} ({layers[theirs][0]})")
    return upward


def test_every_import_goes_to_the_same_layer_or_below():
    files = [(p.relative_to(ROOT).as_posix(), p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))]
    assert upward_imports(files, design_layers()) == []


def test_the_check_sees_an_upward_import():
    layers = design_layers()
    source = "from ..train import loop\nfrom .. import errors\nimport rtxmpi.observe.trace\n"
    assert [t for _, t in imported_modules("rtxmpi/comm/group.py", source)] == [
        "rtxmpi/train/loop.py", "rtxmpi/errors.py", "rtxmpi/observe/trace.py"]
    assert upward_imports([("rtxmpi/comm/group.py", source)], layers) == [
        "rtxmpi/comm/group.py:1 (comm) imports rtxmpi/train/loop.py (train)"]


def mpi4py_importers(files):
    """The files of `files` ([(path relative to ROOT, source)]) that import mpi4py."""
    found = []
    for rel, source in files:
        for node in ast.walk(ast.parse(source, rel)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n == "mpi4py" or n.startswith("mpi4py.") for n in names):
                found.append(rel)
                break
    return found


def test_only_comm_and_the_cli_import_mpi4py():
    files = [(p.relative_to(ROOT).as_posix(), p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))]
    others = [rel for rel in mpi4py_importers(files)
              if not rel.startswith("rtxmpi/comm/") and rel != "rtxmpi/cli.py"]
    assert others == []
    assert mpi4py_importers([("rtxmpi/x.py", "def f():\n    from mpi4py import MPI\n"),
                             ("rtxmpi/y.py", "import mpi4py.MPI as M\n"),
                             ("rtxmpi/z.py", "import numpy\n")]) == ["rtxmpi/x.py", "rtxmpi/y.py"]
