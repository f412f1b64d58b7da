"""The rooms' layering (docs/design.md §1), read from every module's imports (also the ones
inside functions): the model is mesh-free, the ledger pure arithmetic, the executors apart,
no import circle on the training path, and the training path never loads a tool."""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jaxtrain"

# room -> the jaxtrain modules (prefixes) its modules may import
ALLOWED = {
    "jaxtrain.config": ("jaxtrain.config",),
    "jaxtrain.compat": (),
    "jaxtrain.model": ("jaxtrain.config", "jaxtrain.compat", "jaxtrain.model"),
    # the ledger (the schedules it simulates included) and the data point down only: never
    # up to parallel/ or the executors
    "jaxtrain.ledger": ("jaxtrain.config", "jaxtrain.ledger"),
    "jaxtrain.data": ("jaxtrain.config", "jaxtrain.data"),
    "jaxtrain.parallel": ("jaxtrain.config", "jaxtrain.compat", "jaxtrain.model",
                          "jaxtrain.ledger", "jaxtrain.parallel", "jaxtrain.data.context"),
    "jaxtrain.executors": ("jaxtrain.config", "jaxtrain.compat", "jaxtrain.model",
                           "jaxtrain.ledger", "jaxtrain.parallel", "jaxtrain.executors",
                           "jaxtrain.config_check", "jaxtrain.optim", "jaxtrain.weights",
                           "jaxtrain.checkpoint", "jaxtrain.train_state"),
}
# what the ledger may import from outside: no jax
PURE = ("jaxtrain.ledger",)
PURE_THIRD_PARTY = {"numpy"}
TRAINING_PATH = ("jaxtrain.trainer", "jaxtrain.step", "jaxtrain.executors",
                 "jaxtrain.train_state", "jaxtrain.checkpoint", "jaxtrain.metrics",
                 "jaxtrain.optim", "jaxtrain.preemption", "jaxtrain.weights",
                 "jaxtrain.run_report", "jaxtrain.checkpoint_vocab", "jaxtrain.checkpoint_logs",
                 "jaxtrain.checkpoint_integrity")
EXECUTORS = ("jaxtrain.executors.replica", "jaxtrain.executors.pipeline")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> tuple[set, set]:
    """(jaxtrain modules, third-party top-level packages) that `path` imports anywhere."""
    ours, theirs = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "jaxtrain" or node.module.startswith("jaxtrain."):
                names += [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "jaxtrain":
                ours.add(name)
            elif name != "__future__":
                theirs.add(name.split(".")[0])
    return ours, theirs


MODULES = {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def _known(name: str) -> str | None:
    """The module `name` refers to (`from jaxtrain.x import f` names x.f: x is meant)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _room(module: str) -> str | None:
    return next((r for r in ALLOWED if module == r or module.startswith(r + ".")), None)


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_a_room_imports_only_what_sits_below_it(room):
    wrong = {}
    for module, (ours, _) in MODULES.items():
        if _room(module) != room:
            continue
        bad = {n for n in map(_known, ours) if n and n != "jaxtrain"
               and not any(n == a or n.startswith(a + ".") for a in ALLOWED[room])}
        if bad:
            wrong[module] = sorted(bad)
    assert not wrong, wrong


def test_the_ledger_needs_no_jax():
    heavy = {m: sorted(t - PURE_THIRD_PARTY) for m, (_, t) in MODULES.items()
             if m.startswith(PURE) and t - PURE_THIRD_PARTY - {"dataclasses", "functools", "math",
                                                             "typing", "itertools", "collections"}}
    assert not heavy, heavy


def _training_path() -> set:
    """Every module the training path loads (its packages' modules included)."""
    seen = set()
    todo = [m for m in MODULES if any(m == p or m.startswith(p + ".") for p in TRAINING_PATH)]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo += [n for n in map(_known, MODULES[module][0]) if n and n not in seen]
    return seen


def test_the_training_path_never_loads_a_tool():
    seen = _training_path()
    assert not {m for m in seen if m.startswith("jaxtrain.tools")}, sorted(seen)


def test_neither_executor_imports_the_other():
    """The replica and pipeline executors share setup.py and contract.py, which import
    neither; only step.py picks one."""
    for module, (ours, _) in MODULES.items():
        if module.startswith("jaxtrain.executors"):
            reached = {n for n in map(_known, ours) if n in EXECUTORS and n != module}
            assert not reached, (module, reached)
    assert {m for m, (ours, _) in MODULES.items()
            if set(map(_known, ours)) & set(EXECUTORS)} == {"jaxtrain.step"}


def _runtime_edges(path: pathlib.Path) -> set:
    """The jaxtrain modules `path` imports when it runs (function-level imports included,
    `if TYPE_CHECKING:` blocks not); `from pkg import mod` is an arrow to mod, not to pkg."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
               and getattr(block.test, "id", None) == "TYPE_CHECKING"
               for stmt in block.body for n in ast.walk(stmt)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "jaxtrain"}
        elif (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
              and node.module.split(".")[0] == "jaxtrain"):
            subs = [f"{node.module}.{a.name}" for a in node.names]
            out |= {s for s in subs if s in MODULES}
            if any(s not in MODULES for s in subs):
                out.add(node.module)
    return {n for n in map(_known, out) if n and n != "jaxtrain"}


def test_no_import_circle_on_the_training_path():
    """Depth-first over the training path's runtime imports: no module reaches itself (step.py
    and pipeline_model.py did, through a function-level import)."""
    path = _training_path()
    graph = {m: _runtime_edges(PACKAGE.parent / (m.replace(".", "/") + ".py"))
             if (PACKAGE.parent / (m.replace(".", "/") + ".py")).exists()
             else _runtime_edges(PACKAGE.parent / m.replace(".", "/") / "__init__.py")
             for m in path}
    done, stack = set(), []

    def visit(module):
        if module in stack:
            raise AssertionError("import circle: " + " -> ".join(
                stack[stack.index(module):] + [module]))
        if module in done:
            return
        stack.append(module)
        for n in sorted(graph.get(module, ()) - {module}):
            visit(n)
        stack.pop()
        done.add(module)
    for module in sorted(path):
        visit(module)


def test_the_rules_are_about_modules_that_exist():
    """A renamed room or module makes this fail instead of making the rules vacuous."""
    for prefix in ({p for allowed in ALLOWED.values() for p in allowed} | set(TRAINING_PATH)
                   | set(EXECUTORS)):
        assert any(m == prefix or m.startswith(prefix + ".") for m in MODULES), prefix
    assert sum(1 for m in MODULES if _room(m) == "jaxtrain.model") >= 4
