"""The package's import graph: no cycles and no import against the layering, counting every import statement
(module level and inside functions), read from the source with `ast`; and nothing but the package face and
entry modules at the root of `glm5_jax/`."""
import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("glm5_jax", "pallas_kernels")

# Lowest first: a module may import its own package and the packages listed before it, never one after it.
LAYERS = (
    "glm5_jax.platforms",   # which JAX platforms a command starts (no TPU runtime without a TPU)
    "glm5_jax.storage",     # paths: local or object storage (gs://)
    "glm5_jax.telemetry",   # step profiler traces, metrics logs: what train, serve and rl all report
    "pallas_kernels",
    "glm5_jax.quant",
    "glm5_jax.data",
    "glm5_jax.parallel",
    "glm5_jax.model",
    "glm5_jax.checkpoint",
    "glm5_jax.hf",
    "glm5_jax.cost",
    "glm5_jax.convert",
    "glm5_jax.generate",
    "glm5_jax.train",
    "glm5_jax.serve",
    "glm5_jax.rl",
    "glm5_jax",            # the package face
)


def _modules():
    mods = {}
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(REPO, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    name = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                    mods[name.removesuffix(".__init__")] = path
    return mods


def import_graph():
    """{module: {imported project modules}}; ``from pkg import name`` counts pkg.name when that is a module,
    else pkg itself (a name its __init__ defines)."""
    mods = _modules()

    def resolve(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        targets = set()
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = mod.split(".")[: len(mod.split(".")) - (0 if is_pkg else 1) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            targets |= {r for r in map(resolve, names) if r and r != mod}
        graph[mod] = targets
    return graph


def _layer(mod):
    """Index of the most specific layer holding ``mod``."""
    holders = [layer for layer in LAYERS if mod == layer or mod.startswith(layer + ".")]
    return LAYERS.index(max(holders, key=len))


def _cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_sees_function_level_imports_and_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _layer("glm5_jax.model.moe.layer") == LAYERS.index("glm5_jax.model")
    assert _layer("glm5_jax") == LAYERS.index("glm5_jax")
    g = import_graph()
    # learner.main imports absl flags and our modules inside the function: those edges are counted
    assert "glm5_jax.rl.logs" in g["glm5_jax.rl.learner"]
    assert "glm5_jax.model.transformer" in g["glm5_jax"]


def test_no_import_cycles():
    assert _cycles(import_graph()) == []


def test_imports_follow_the_layering():
    wrong = [f"{m} -> {t}" for m, targets in import_graph().items() for t in sorted(targets) if _layer(t) > _layer(m)]
    assert wrong == []


def test_package_root_holds_only_the_face_and_entry_modules():
    root = os.path.join(REPO, "glm5_jax")
    modules = sorted(f for f in os.listdir(root) if f.endswith(".py"))
    assert modules == ["__init__.py"]
    packages = sorted(d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "__init__.py")))
    assert packages == sorted(layer.split(".")[1] for layer in LAYERS if layer.startswith("glm5_jax."))
