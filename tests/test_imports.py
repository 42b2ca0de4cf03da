"""The package's import layering: no import circles, and no import from a lower layer up to a higher one.

Every `import` and `from ... import` statement of every module under specmoe/ is read from the source (module
level and inside functions alike; relative imports resolved), so a lazy import inside a function counts the
same as one at the top. `LAYERS` below is the one table of the layering (docs/design.md draws it): a module
may import modules of its own layer or of a lower one. Within a layer, the units (a subpackage or a top-level
module) and, within a unit, its modules must not import each other in a circle. The training pipeline
(`specmoe_train`, a package of its own) imports specmoe; no module of specmoe imports it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "specmoe"

# Low to high. Each layer lists its units by module prefix: a module belongs to the unit of the longest prefix
# that matches it (the module itself or a module inside that package).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("specmoe", "specmoe.stats", "specmoe.files", "specmoe.arguments", "specmoe.assets", "specmoe.geometry")),
    ("routing", ("specmoe.routing",)),
    ("records", ("specmoe.records",)),
    ("verifiers", ("specmoe.verifiers",)),
    ("speculation", ("specmoe.speculation",)),
    ("kernels", ("specmoe.kernels",)),
    ("models", ("specmoe.models",)),
    ("offload", ("specmoe.offload",)),
    ("harness", ("specmoe.harness",)),
    ("drafters", ("specmoe.drafters",)),
    ("engines", ("specmoe.engines",)),
    ("replay", ("specmoe.replay",)),
    ("evaluation", ("specmoe.evaluation",)),
    ("experiments", ("specmoe.experiments",)),
    ("cli", ("specmoe.cli", "specmoe.__main__")),
]
TRAINING = "specmoe_train"  # the training pipeline of the shipped family: it imports specmoe, never the reverse


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def unit_of(module: str) -> str | None:
    """The unit (longest matching prefix of `LAYERS`) of a module name; None if no layer lists it."""
    matches = [p for _, prefixes in LAYERS for p in prefixes if _within(module, p)]
    return max(matches, key=len) if matches else None


def layer_of(unit: str) -> int:
    return next(i for i, (_, prefixes) in enumerate(LAYERS) if unit in prefixes)


def modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Every module of the package: name -> (file, whether it is a package's __init__)."""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def imports(name: str, path: Path, is_package: bool, top: str = PACKAGE) -> list[tuple[str, int]]:
    """(imported module of the package `top`, line) for every import statement of one module, relative ones resolved;
    for `from X import Y` both X and X.Y (Y may be a submodule) are listed."""
    package = name.split(".") if is_package else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [source] + [f"{source}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [(t, node.lineno) for t in targets if _within(t, top)]
    return found


def resolve(target: str, known: dict) -> str | None:
    """The module an imported name lives in (X.Y -> X when Y is a name in module X)."""
    while target not in known and "." in target:
        target = target.rsplit(".", 1)[0]
    return target if target in known else None


def graph(root: Path = ROOT):
    """(module edges {module: {imported module: first line}}, the modules)."""
    known = modules(root)
    edges: dict[str, dict[str, int]] = defaultdict(dict)
    for name, (path, is_package) in known.items():
        for target, line in imports(name, path, is_package):
            module = resolve(target, known)
            if module is not None and module != name:
                edges[name].setdefault(module, line)
    return edges, known


def cycles(edges: dict[str, set]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each as a closed path through it."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_path(sorted(component), edges))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _path(component: list[str], edges) -> list[str]:
    """A circle through the component's first node (breadth-first back to it), for the failure message."""
    members, start = set(component), component[0]
    previous, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, ())):
                if w == start:
                    path = [v]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    return path[::-1] + [start]
                if w in members and w not in previous:
                    previous[w] = v
                    nxt.append(w)
        frontier = nxt
    return component


def _where(edges, known, source, target) -> str:
    path = known[source][0].relative_to(ROOT)
    return f"{path}:{edges[source][target]}"


def test_every_module_belongs_to_a_layer():
    _, known = graph()
    missing = [m for m in known if unit_of(m) is None]
    assert not missing, f"modules outside the layer table LAYERS of {__file__}: {missing}"


def test_no_import_goes_up_a_layer():
    edges, known = graph()
    names = [name for name, _ in LAYERS]
    upward = []
    for source, targets in edges.items():
        s = layer_of(unit_of(source))
        for target in targets:
            t = layer_of(unit_of(target))
            if t > s:
                upward.append(f"{_where(edges, known, source, target)}: {source} ({names[s]}) imports {target} "
                              f"({names[t]}, a higher layer)")
    assert not upward, ("imports from a lower layer up to a higher one (move the function to the layer it "
                        "belongs to; the layers are LAYERS in tests/test_imports.py, drawn in docs/design.md):\n"
                        + "\n".join(sorted(upward)))


def test_no_import_circles_between_units():
    edges, known = graph()
    units: dict[str, set] = defaultdict(set)
    first: dict[tuple[str, str], str] = {}
    for source, targets in edges.items():
        for target in targets:
            a, b = unit_of(source), unit_of(target)
            if a != b:
                units[a].add(b)
                first.setdefault((a, b), _where(edges, known, source, target))
    found = cycles(units)
    message = []
    for circle in found:
        steps = [f"{a} -> {b} ({first[a, b]})" for a, b in zip(circle, circle[1:])]
        message.append("circle: " + "; ".join(steps))
    assert not found, "import circles between subpackages / top-level modules:\n" + "\n".join(message)


def test_no_import_circles_between_modules():
    """Within a unit: modules that import each other in a circle (a package's __init__, which re-exports its
    modules, is left out: importing a name from the package is importing its defining module)."""
    edges, known = graph()
    plain = {s: {t for t in targets if not known[t][1]} for s, targets in edges.items() if not known[s][1]}
    found = cycles(plain)
    message = ["circle: " + "; ".join(f"{m} -> {n} ({_where(edges, known, m, n)})" for m, n in zip(c, c[1:]))
               for c in found]
    assert not found, "import circles between modules:\n" + "\n".join(message)


def test_the_package_never_imports_the_training_pipeline():
    found = [f"{path.relative_to(ROOT)}:{line}: {name} imports {target}"
             for name, (path, is_package) in modules().items()
             for target, line in imports(name, path, is_package, TRAINING)]
    assert not found, f"the runtime imports the training pipeline {TRAINING}:\n" + "\n".join(found)


def test_the_walker_sees_imports():
    """Not vacuous: known imports are found, a function-level one and a relative one included."""
    edges, known = graph()
    assert len(known) > 50 and sum(map(len, edges.values())) > 100
    assert "specmoe.verifiers" in edges["specmoe.speculation"]  # from specmoe.verifiers import ...
    assert "specmoe.drafters.base" in edges["specmoe.drafters.synthetic"]  # from .base import ... (relative)
    assert "specmoe.harness" in edges["specmoe.drafters.build"]  # inside a builder
    assert "specmoe.speculation" in edges["specmoe.engines.engine"]
    assert "specmoe.records" in edges["specmoe.replay.rollback"]
    assert imports("specmoe_train.family", ROOT / TRAINING / "family.py", False, TRAINING)  # the other package's own
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert unit_of("specmoe.routing.cache") == "specmoe.routing" and unit_of("specmoe.cli") == "specmoe.cli"
    assert unit_of("specmoe.kernels.tuning") == "specmoe.kernels" and unit_of("specmoe.assets") == "specmoe.assets"
    assert unit_of("specmoe") == "specmoe" and unit_of("elsewhere") is None


def test_specmoe_imports_without_lm_eval():
    """`import specmoe` and `specmoe compare` need no lm-eval; the adapter names the extra to install."""
    code = textwrap.dedent("""
        import sys
        sys.modules["lm_eval"] = None  # as if not installed
        import specmoe, specmoe.cli, specmoe.stats, specmoe.evaluation, specmoe.evaluation.compare
        specmoe.cli.build_parser()
        try:
            import specmoe.evaluation.lm_eval_model
        except ImportError as exc:
            print(exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "install the `eval` extra" in out.stdout and "specmoe[eval]" in out.stdout
