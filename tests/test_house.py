"""The house's floors (DESIGN.md, README "Files"): a file imports only the project's files on floors below it, or on
its own floor before it, at the top of the file; no circle; no import of a project file inside a function
(tools/bench.py and tools/gpu_check.py may import lazily: a GPU box may lack vLLM). Read from the source with `ast`,
nothing is imported."""
import ast
import os

from conftest import ROOT

# Ground up. Inside a floor, a file may use the ones listed before it.
FLOORS = [
    ("the math and the plain parts", ["grpo", "ranks", "judge", "reward", "job"]),
    ("families and loading; samples, images and videos", ["model", "data"]),
    ("what is built on them", ["toolbox", "tiny", "flags", "vllm_cpu"]),
    ("the planner, memory, the vLLM engine, checkpoints, logs", ["planner", "memory", "rollout", "checkpoint", "logs"]),
    ("the top: a launch's set-up, the update phase, the step; beside them the benchmark and the GPU check",
     ["startup", "learner", "train", "bench", "gpu_check"]),
]
ORDER = {name: (floor, i) for floor, (_, names) in enumerate(FLOORS) for i, name in enumerate(names)}
IN_TOOLS = {"bench", "gpu_check"}   # on the top floor, but in tools/
LAZY_OK = {"bench", "gpu_check"}


def path(name):
    return os.path.join(ROOT, "tools" if name in IN_TOOLS else "", name + ".py")


def project_files():
    """The root's .py files and the two in tools/ that import the project."""
    root = [f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")]
    return sorted(root + [name for name in IN_TOOLS if os.path.exists(path(name))])


def imports(name):
    """[(imported project module, line, inside a function)] of the file `name` (path(name))."""
    tree = ast.parse(open(path(name)).read())
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if n is not f}
    found = []
    for node in ast.walk(tree):
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        found += [(m.split(".")[0], node.lineno, id(node) in inside) for m in mods if m.split(".")[0] in ORDER]
    return found


def test_every_file_has_a_floor():
    assert sorted(ORDER) == project_files(), "a new top-level file gets its floor in FLOORS (and in DESIGN.md)"


def test_imports_go_down_the_floors():
    up = [f"{name}.py:{line} imports {mod} (floor {ORDER[mod][0] + 1}) from floor {ORDER[name][0] + 1}"
          for name in ORDER for mod, line, _ in imports(name) if mod != name and ORDER[mod] >= ORDER[name]]
    assert not up, "\n".join(up)


def test_no_project_import_inside_a_function():
    lazy = [f"{name}.py:{line} imports {mod} inside a function" for name in ORDER if name not in LAZY_OK
            for mod, line, inside in imports(name) if inside]
    assert not lazy, "\n".join(lazy)


def test_no_circle():
    graph = {name: {mod for mod, _, _ in imports(name) if mod != name} for name in ORDER}
    seen, stack = set(), []

    def visit(n):
        assert n not in stack, "a circle: " + " -> ".join(stack[stack.index(n):] + [n])
        if n in seen:
            return
        stack.append(n)
        for m in sorted(graph[n]):
            visit(m)
        stack.pop()
        seen.add(n)
    for n in graph:
        visit(n)
