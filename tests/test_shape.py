"""Tests that keep the shape honest: notebooks = their sources, exercises mirror solutions, arrows run one way.

* every ``notebooks/NN_*.ipynb`` holds exactly the cells ``tools/build_notebooks.py`` builds from
  ``notebooks/src/NN_*.py`` (nothing is executed: only the parser is reused), and nbval's sanitizer
  masks the repository's path wherever the clone lives;
* ``exercises/`` and ``solutions/`` expose the same public names with the same signatures, and every
  ``EXERCISES`` entry has a checker (in ``course_lib/checks/``, mirroring the exercise file), an
  exercise and a solution;
* the structure of ``course_lib/`` (there is no line limit: a file is as long as its one job needs):
  no import cycle, no import of another module's private ``_name``, and the layer arrows —
  notebooks → learner / view → experiments / checks → techniques → foundation;
* every single-program training loop in experiments and checkers steps through ``train.train_step``
  (the exceptions are listed below, each with its reason);
* the repository stands alone: no file refers to the course's design folder outside it.
"""

import ast
import difflib
import importlib.util
import inspect
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "course_lib"


def _load_file(path: Path, name: str):
    """Import ``path`` as module ``name`` without touching ``sys.modules``' real packages."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- notebooks == their sources


SOURCES = sorted((ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py"))


def test_every_notebook_has_a_source_and_every_source_a_notebook():
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert notebooks == [p.stem for p in SOURCES]


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_notebook_cells_are_what_build_notebooks_makes_of_its_source(src):
    build = _load_file(ROOT / "tools" / "build_notebooks.py", "_shape_build_notebooks")
    want = [(c.cell_type, c.source) for c in build.parse(src.read_text(encoding="utf-8")).cells]
    nb = nbformat.read(ROOT / "notebooks" / f"{src.stem}.ipynb", as_version=4)
    got = [(c.cell_type, c.source) for c in nb.cells]
    assert len(got) == len(want), (
        f"{src.stem}.ipynb has {len(got)} cells, its source builds {len(want)}: "
        f"run python tools/build_notebooks.py {src.stem[:2]}"
    )
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        diff = "\n".join(
            difflib.unified_diff(
                w[1].splitlines(), g[1].splitlines(), "source", "notebook", n=0, lineterm=""
            )
        )
        if g != w:
            pytest.fail(
                f"{src.stem}.ipynb cell {i} ({w[0]}) differs from notebooks/src/{src.name} (run python "
                f"tools/build_notebooks.py {src.stem[:2]}):\n{diff}",
                pytrace=False,
            )


# --------------------------------------------------------------------------- exercises mirror solutions


EXERCISE_FILES = sorted(p.stem for p in (ROOT / "exercises").glob("*.py") if p.stem != "__init__")


def _public_api(module) -> dict:
    """``{name: signature}`` of what the module defines (not imports); a class adds its public methods."""
    api = {}
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            api[name] = str(inspect.signature(obj))
            for meth, fn in vars(obj).items():
                if not meth.startswith("_") and callable(fn):
                    api[f"{name}.{meth}"] = str(inspect.signature(fn))
        elif callable(obj):
            api[name] = str(inspect.signature(obj))
    return api


def test_exercise_and_solution_files_mirror_each_other():
    assert EXERCISE_FILES == sorted(
        p.stem for p in (ROOT / "solutions").glob("*.py") if p.stem != "__init__"
    )


@pytest.mark.parametrize("module", EXERCISE_FILES)
def test_exercises_and_solutions_expose_the_same_names_and_signatures(module):
    ex = _public_api(_load_file(ROOT / "exercises" / f"{module}.py", f"_shape_exercises_{module}"))
    sol = _public_api(_load_file(ROOT / "solutions" / f"{module}.py", f"_shape_solutions_{module}"))
    assert ex == sol


def test_every_exercise_has_a_checker_an_exercise_and_a_solution():
    from course_lib.check import EXERCISES

    for name, ex in EXERCISES.items():
        assert callable(ex.runner), name
        assert ex.runner.__module__ == f"course_lib.checks.{ex.module}", (
            f"{name}: checker {ex.runner.__module__}.{ex.runner.__name__} is not in course_lib/checks/{ex.module}.py"
        )
        for package in ("exercises", "solutions"):
            module = _load_file(ROOT / package / f"{ex.module}.py", f"_shape_{package}_{ex.module}")
            assert callable(getattr(module, ex.function, None)), (
                f"{name}: {package}/{ex.module}.py has no {ex.function}"
            )


# --------------------------------------------------------------------------- nbval's sanitizer


def _sanitize(text: str) -> str:
    """Apply ``notebooks/sanitize.cfg`` the way nbval does: every (regex, replace) pair in file order."""
    cfg = (ROOT / "notebooks" / "sanitize.cfg").read_text(encoding="utf-8")
    for regex, replace in re.findall(r"^regex: (.*)$\n^replace: (.*)$", cfg, flags=re.MULTILINE):
        text = re.sub(regex, replace, text)
    return text


@pytest.mark.parametrize("root", ["/work/main", "/tmp/ci-clone-1234", "/home/learner/course"])
def test_sanitizer_masks_the_repository_path_wherever_the_clone_lives(root):
    frame = f'  File "{root}/course_lib/experiments/ray_train.py", line 212, in ddp_loop\n'
    assert (
        _sanitize(frame)
        == '  File "COURSE/course_lib/experiments/ray_train.py", line N, in ddp_loop\n'
    )


def test_sanitizer_still_masks_temporary_paths_and_times():
    assert _sanitize("saved to /tmp/abc_1/ckpt in 1.25 s \n") == "saved to TMPPATH in TIME \n"


def test_sanitizer_masks_rounding_noise_but_not_counts_or_names():
    """max |Δ| values are fp32 rounding noise that differs between CPUs (AVX2 / AVX-512 kernels)."""
    row = "sgd, 5 steps     1.118e-08  one device  ≤ 1e-06 (SGD)  PASS  v1.2e3x 12,345 B"
    assert (
        _sanitize(row) == "sgd, 5 steps     SCI  one device  ≤ 1e-06 (SGD)  PASS  v1.2e3x 12,345 B"
    )


# --------------------------------------------------------------------------- structure of course_lib/

# Each module's layer; a module may import only from its own layer or those below it.
LAYERS = {
    "foundation": {
        "launch",
        "comm",
        "memory",
        "formulas",
        "models",
        "data",
        "configs",
        "results",
        "train",
        "chapters",
        "clock",
        "timing",  # the one timing helper: interleaved rounds, median [min–max], verdicts
        "step_time",  # the cost model: α–β + FLOPs / rate + an exposure rule per technique
    },
    "techniques": {
        "ddp",
        "grad_buckets",
        "sharding",
        "zero",
        "zero3",
        "zero3_shards",
        "fsdp",
        "pipeline",
        "pipeline_schedules",
        "tensor_parallel",
        "context_parallel",  # ring attention, all-gather CP, Ulysses
        "moe",  # the one-device mixture-of-experts layer
        "expert_parallel",  # the MoE layer over an expert-parallel group (all-to-all dispatch/combine)
        "ray_train",
        "ray_data",
        "plan",
    },
    "instruments": {
        "fsdp_meters",
        "profiling",  # torch.profiler traces of a step, read back, classified and drawn
    },  # meters and timelines that attach to a technique from outside
    "experiments": {"experiments", "checks"},
    "learner": {"check", "quiz", "viz", "show"},
    "entry points": {"cli", "bench"},
}
ORDER = list(LAYERS)


def _modules() -> list[Path]:
    return sorted(p for p in LIB.rglob("*.py") if "__pycache__" not in p.parts)


def _dotted(path: Path) -> str:
    parts = ["course_lib", *path.relative_to(LIB).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, str, int]]:
    """``(module, name, line)`` for every ``course_lib`` import in ``path`` (any depth, lazy ones too).

    ``name`` is what ``from module import name`` takes ("" for ``import module``)."""
    package = _dotted(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, "", node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + (node.module.split(".") if node.module else []))
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                is_module = (LIB.parent / (sub.replace(".", "/") + ".py")).exists() or (
                    LIB.parent / sub.replace(".", "/")
                ).is_dir()
                found.append(
                    (sub, "", node.lineno) if is_module else (module, alias.name, node.lineno)
                )
    return [f for f in found if f[0] == "course_lib" or f[0].startswith("course_lib.")]


def _top(module: str) -> str:
    """The first component under ``course_lib`` (the unit the layers are drawn in)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(top: str) -> str | None:
    return next((name for name, tops in LAYERS.items() if top in tops), None)


def test_every_module_has_a_layer():
    tops = {_top(_dotted(p)) for p in _modules()} - {""}
    assert sorted(t for t in tops if _layer(t) is None) == [], (
        "add new modules to LAYERS in tests/test_shape.py"
    )


@pytest.mark.parametrize(
    "path",
    [p for p in _modules() if p != LIB / "__init__.py"],
    ids=lambda p: str(p.relative_to(LIB)),
)
def test_imports_run_down_the_layers(path):
    me = _layer(_top(_dotted(path)))
    assert me is not None, f"{path.relative_to(ROOT)} has no layer: add it to LAYERS"
    up = [
        f"line {line}: {mod}"
        for mod, _, line in _imports(path)
        if _layer(_top(mod)) is not None and ORDER.index(_layer(_top(mod))) > ORDER.index(me)
    ]
    assert up == [], f"{path.relative_to(ROOT)} ({me}) imports from a higher layer"


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in _modules():
        graph[_dotted(path)] = {mod for mod, _, _ in _imports(path) if mod != _dotted(path)}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_course_lib():
    graph = _graph()
    # A package's __init__ re-exporting its own modules is not a cycle between responsibilities.
    for pkg in [m for m in graph if (LIB.parent / m.replace(".", "/")).is_dir()]:
        graph[pkg] = {m for m in graph[pkg] if not m.startswith(pkg + ".")}
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_another_modules_private_names():
    private = []
    for path in _modules():
        for mod, name, line in _imports(path):
            if name.startswith("_") and not name.startswith("__") and mod != _dotted(path):
                private.append(f"{path.relative_to(ROOT)}:{line}: from {mod} import {name}")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = {
            a.asname or a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom)
            for a in n.names
            if (LIB / (a.name + ".py")).exists() or (LIB / a.name).is_dir()
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                private.append(
                    f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}"
                )
    assert private == []


def test_import_parser_sees_relative_absolute_and_lazy_imports(tmp_path):
    got = {(m, n) for m, n, _ in _imports(LIB / "experiments" / "common.py")}
    assert ("course_lib.results", "Result") in got and ("course_lib.launch", "device") in got
    assert _top("course_lib.experiments.ddp") == "experiments" and _layer("ddp") == "techniques"


# --------------------------------------------------------------------------- every loop through train_step

# (module, function) -> why that loop calls backward itself instead of stepping through train.train_step.
BACKWARD_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("experiments/collectives", "step"): "the same toy step, inside the scaling race",
    ("experiments/expert_parallel", "balanced_all_to_all"): (
        "one forward and backward of an MoE layer, metered: the all-to-all bytes, no training step"
    ),
    ("checks/ddp", "check_overlapped_ddp"): (
        "counts the all-reduces launched during backward() and after it (the overlap check), "
        "so it stands between backward and finish_gradient_synchronization"
    ),
    (
        "experiments/ddp",
        "accumulation_with_no_sync",
    ): "several backwards (all but the last under no_sync) per optimizer step",
    (
        "checks/ddp",
        "_reference_grads",
    ): "checks gradients after backward: no optimizer step in the exercise",
    (
        "checks/ddp",
        "check_allreduce_gradients",
    ): "checks the learner's gradients after backward, before any step",
    (
        "checks/ddp",
        "check_bucketed_reducer",
    ): "checks the learner's reducer's gradients after backward",
    (
        "experiments/fsdp_features",
        "accumulation_without_sync",
    ): "M backwards per optimizer step, gradient sync switched off and on per micro-batch",
    (
        "experiments/fsdp_practice",
        "activation_checkpointing",
    ): "memory tracked over forward and backward only: a step inside the tracker changes the peaks",
    (
        "experiments/horovod",
        "_horovod_train",
    ): "a Horovod worker: DistributedOptimizer's zero_grad takes no set_to_none",
    (
        "experiments/zero",
        "zero_stage_profile",
    ): "samples memory and counts collectives per phase (forward, "
    "backward, step) of the measured step",
    (
        "experiments/zero_libraries",
        "deepspeed_zero",
    ): "DeepSpeed's engine owns backward: engine.backward(loss)",
    (
        "checks/zero",
        "check_zero1_step",
    ): "the learner's Zero1Step is not a torch optimizer (zero_grad takes no arguments)",
    (
        "checks/zero",
        "check_sharded_linear",
    ): "one layer, no optimizer: forward and backward collectives counted apart",
    (
        "experiments/tensor_parallel",
        "linear_layers",
    ): "one layer with a fixed output gradient, no model or optimizer",
    (
        "experiments/tensor_parallel",
        "tp_step",
    ): "collectives counted per phase, activations metered during forward only",
    (
        "experiments/tensor_parallel",
        "dtensor_step",
    ): "collectives counted per phase under loss_parallel()",
    (
        "experiments/tensor_parallel",
        "_blocks_sum_of_squares",
    ): "blocks only, loss Σout² on a sequence shard: no model(x, y)",
    (
        "experiments/tensor_parallel",
        "fsdp_tp_step",
    ): "one forward + backward whose gradients are the result",
    (
        "checks/tensor_parallel",
        "_check",
    ): "the learner's autograd.Function run with a fixed output gradient",
}


def _backward_calls(path: Path) -> list[tuple[str, int]]:
    """``(enclosing function, line)`` of every ``<x>.backward(...)`` call in ``path``."""
    calls = []

    def walk(node, fn):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Attribute)
                and child.func.attr == "backward"
            ):
                calls.append((fn, child.lineno))
            walk(child, name)

    walk(ast.parse(path.read_text(encoding="utf-8")), "<module>")
    return calls


def test_every_single_program_loop_steps_through_train_step():
    loose = []
    for path in sorted((LIB / "experiments").glob("*.py")) + sorted((LIB / "checks").glob("*.py")):
        module = f"{path.parent.name}/{path.stem}"
        loose += [
            f"{module}.py:{line} in {fn}()"
            for fn, line in _backward_calls(path)
            if (module, fn) not in BACKWARD_EXCEPTIONS
        ]
    assert loose == [], (
        "step through course_lib.train.train_step, or list the loop in BACKWARD_EXCEPTIONS"
    )


def test_backward_exceptions_are_still_there():
    """An exception whose loop is gone is stale: remove it."""
    for (module, fn), why in BACKWARD_EXCEPTIONS.items():
        assert why, (module, fn)
        assert fn in {f for f, _ in _backward_calls(LIB / f"{module}.py")}, (
            f"{module}.{fn} no longer calls backward"
        )


# --------------------------------------------------------------------------- the repository stands alone


def test_no_file_refers_to_the_design_folder_outside_the_repository():
    import subprocess

    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    # Spelled in pieces, so that this file does not name what it looks for (and needs no exemption).
    folder = "shared"
    needles = (f"../{folder}", f"{folder}/seeds", "COURSE" + "_DESIGN", f'parents[2] / "{folder}"')
    hits = []
    for name in files:
        path = ROOT / name
        if path.suffix in {".png", ".whl"} or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        hits += [f"{name}: {n}" for n in needles if n in text]
    assert hits == []
