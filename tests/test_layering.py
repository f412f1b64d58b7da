"""The rooms' layering (docs/design.md §1), read from every module's imports (also the ones
inside functions): the model is mesh-free, the ledger pure arithmetic, and the training path
never loads a tool."""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jaxtrain"

# room -> the jaxtrain modules (prefixes) its modules may import
ALLOWED = {
    "jaxtrain.config": ("jaxtrain.config",),
    "jaxtrain.compat": (),
    "jaxtrain.model": ("jaxtrain.config", "jaxtrain.compat", "jaxtrain.model"),
    "jaxtrain.ledger": ("jaxtrain.config", "jaxtrain.ledger", "jaxtrain.parallel.pipeline_schedule"),
    "jaxtrain.data": ("jaxtrain.config", "jaxtrain.data", "jaxtrain.ledger"),
    "jaxtrain.parallel": ("jaxtrain.config", "jaxtrain.compat", "jaxtrain.model",
                          "jaxtrain.ledger", "jaxtrain.parallel", "jaxtrain.data.context"),
}
# what the ledger (and the numpy schedules it simulates) may import from outside: no jax
PURE = ("jaxtrain.ledger", "jaxtrain.parallel.pipeline_schedule")
PURE_THIRD_PARTY = {"numpy"}
TRAINING_PATH = ("jaxtrain.trainer", "jaxtrain.step", "jaxtrain.checkpoint", "jaxtrain.metrics",
                 "jaxtrain.optim", "jaxtrain.preemption", "jaxtrain.weights",
                 "jaxtrain.run_report", "jaxtrain.checkpoint_vocab", "jaxtrain.checkpoint_logs")


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


def test_the_ledger_and_its_schedules_need_no_jax():
    heavy = {m: sorted(t - PURE_THIRD_PARTY) for m, (_, t) in MODULES.items()
             if m.startswith(PURE) and t - PURE_THIRD_PARTY - {"dataclasses", "functools", "math",
                                                             "typing", "itertools", "collections"}}
    assert not heavy, heavy


def test_the_training_path_never_loads_a_tool():
    seen, todo = set(), list(TRAINING_PATH)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo += [n for n in map(_known, MODULES[module][0]) if n and n not in seen]
    assert not {m for m in seen if m.startswith("jaxtrain.tools")}, sorted(seen)


def test_the_rules_are_about_modules_that_exist():
    """A renamed room or module makes this fail instead of making the rules vacuous."""
    for prefix in {p for allowed in ALLOWED.values() for p in allowed} | set(TRAINING_PATH):
        assert any(m == prefix or m.startswith(prefix + ".") for m in MODULES), prefix
    assert sum(1 for m in MODULES if _room(m) == "jaxtrain.model") >= 4
