"""The design card, held by tests: the core a learner reads reaches the engine beside it only through
the seams the package docstring names (nanofp8/__init__.py). Its size is measured, not held here:
`python bench.py design` reports lines and the functions on a step's path beside their budgets."""

import ast
import os

import nanofp8

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ("nanofp8/fp8.py", "nanofp8/optim.py", "nanofp8/dist.py", "nanofp8/model.py", "train.py")
CORE_MODULES = {os.path.splitext(os.path.basename(f))[0] for f in CORE}

# Every name the library's core imports from the engine (a project module outside the core), by
# file; train.py, the script that wires the run, by module. The package docstring writes the same
# lists out for readers (checked below).
SEAMS = {
    "nanofp8/fp8.py": {("device", "gemm"), ("device", "cast"), ("mx", "mx_scale"), ("o2_compile", "kept_operands")},
    "nanofp8/optim.py": {("optim_foreach", "optim_foreach"), ("optim_fused", "optim_fused"),
                         ("o2_compile", "O2CompileParts")},
    "nanofp8/dist.py": {("overlap", "InOrder"), ("overlap", "Pending"), ("overlap", "plan_buckets"),
                        ("counter", "COMM"), ("counter", "comm_stats"), ("emulate", "fp8_to_float")},
    "nanofp8/model.py": {("attention", "fp8_attention")},
}
TRAIN_MODULES = {"configurator", "data", "layout", "run", "stats", "zero", "ckptfile", "o2_compile"}


def _lines(path):
    with open(os.path.join(ROOT, path)) as f:
        return sum(1 for _ in f)


def test_the_design_measures_are_reported():
    """The core's size and the functions on a step's path are the design card's measures, reported
    by `python bench.py design` beside their budgets, not enforced here: a fork is free to grow a
    file. The command measures the files this test names."""
    import bench

    assert bench.CORE == CORE
    assert {f: _lines(f) for f in CORE}  # (every core file is there to measure)


def _engine_imports(path):
    """{(module, name)} a file imports from project modules outside the core, at any depth."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = (node.module or "").removeprefix("nanofp8.").removeprefix("nanofp8")
            if node.level == 0 and not (node.module or "").startswith("nanofp8") and node.module != "kernels":
                continue
            for alias in node.names:
                target = mod or alias.name  # `from . import x` / `from nanofp8 import x`
                if target.split(".")[0] not in CORE_MODULES:
                    found.add((target, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nanofp8.") and alias.name.split(".")[1] not in CORE_MODULES:
                    found.add((alias.name.removeprefix("nanofp8."), "*"))
                if alias.name == "kernels":
                    found.add(("kernels", "*"))
    return found


def test_core_reaches_the_engine_only_through_its_seams():
    for path, seams in SEAMS.items():
        assert _engine_imports(path) == seams, path
    assert {module for module, _ in _engine_imports("train.py")} == TRAIN_MODULES


def test_the_seams_are_documented():
    doc = " ".join(nanofp8.__doc__.split("The seams:")[1].split())  # (lines joined)
    for path, seams in SEAMS.items():
        line = doc.split(os.path.basename(path), 1)[1]
        for module, name in seams:
            assert (module if module == name else f"{module}.{name}") in line, (path, module, name)
    assert all(module in doc.split("train.py")[1] for module in TRAIN_MODULES)


def _module_imports(path):
    """The project modules a file imports when it is loaded (module level, `if`/`try` included;
    imports inside functions run later, and are how a file reaches one that imports it)."""
    found = set()
    for node in ast.parse(open(os.path.join(ROOT, path)).read()).body:
        for n in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("nanofp8")):
                mod = (n.module or "").removeprefix("nanofp8").lstrip(".")
                found |= {mod.split(".")[0]} if mod else {a.name for a in n.names}
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                names = [n.module] if isinstance(n, ast.ImportFrom) else [a.name for a in n.names]
                found |= {m.split(".")[1] for m in names if m.startswith("nanofp8.")} | ({"kernels"} & set(names))
    return found


def _cycle(graph):
    """One import cycle of graph {module: {modules it imports}} as a list, or None."""
    done, path = set(), []

    def visit(m):
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return None
        path.append(m)
        found = next((c for c in map(visit, sorted(graph.get(m, ()))) if c), None)
        path.pop()
        done.add(m)
        return found

    return next((c for c in map(visit, sorted(graph)) if c), None)


def test_no_module_imports_itself_back():
    """No import cycles among the project's files as they load: a reader can take the files in
    an order where each one stands on those before it (a later need goes through an import inside
    a function, as optim.py reaches its foreach twin). Every file is read, none listed."""
    files = [f for f in os.listdir(os.path.join(ROOT, "nanofp8")) if f.endswith(".py") and f != "__init__.py"]
    graph = {f[:-3]: _module_imports(os.path.join("nanofp8", f)) for f in files}
    graph.update({f[:-3]: _module_imports(f) for f in os.listdir(ROOT) if f.endswith(".py")})
    assert len(graph) > 30 and graph["optim"] and _cycle(graph) is None, _cycle(graph)
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # (the search finds one)
