"""rtxmpi/parallel composes the modules of rtxmpi.nn and never the layer functions under them:
no module there imports rtxmpi.nn.layers (or a name from it)."""
import ast
import pathlib

PARALLEL = pathlib.Path(__file__).resolve().parents[2] / "rtxmpi" / "parallel"


def layer_imports(path):
    """(line, statement) of each import of rtxmpi.nn.layers or of a name from it in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.endswith("nn.layers")]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = ([a.name for a in node.names] if module.endswith("nn.layers") else
                     [a.name for a in node.names if module.endswith("nn") and a.name == "layers"])
        else:
            continue
        if names:
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_module_under_rtxmpi_parallel_imports_the_layer_functions():
    offenders = {p.name: layer_imports(p) for p in sorted(PARALLEL.glob("*.py"))}
    assert {name: hits for name, hits in offenders.items() if hits} == {}
