"""Tests that keep the shape honest: notebooks = their sources, exercises mirror solutions, arrows run one way.

* every ``notebooks/NN_*.ipynb`` holds exactly the cells ``tools/build_notebooks.py`` builds from
  ``notebooks/src/NN_*.py`` (nothing is executed: only the parser is reused);
* ``exercises/`` and ``solutions/`` expose the same public names with the same signatures, and every
  ``EXERCISES`` entry has a checker (in ``course_lib/checks/``, mirroring the exercise file), an
  exercise and a solution;
* the layout of ``course_lib/``: modules stay short, and imports run one way —
  notebooks → experiments / checks → techniques → foundation.
"""
import ast
import difflib
import importlib.util
import inspect
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "course_lib"

FOUNDATION = {"launch", "comm", "memory", "formulas", "models", "data"}
TECHNIQUES = {"ddp", "grad_buckets", "sharding", "zero", "zero3", "zero3_shards", "fsdp", "pipeline",
              "pipeline_schedules", "tensor_parallel", "ray_train", "ray_data", "plan"}
ABOVE_TECHNIQUES = {"experiments", "checks", "check", "bench", "cli"}  # what a technique must never import
MAX_LINES, LONG_ALLOWED = 450, {"quiz.py"}


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
    assert len(got) == len(want), f"{src.stem}.ipynb has {len(got)} cells, its source builds {len(want)}: " \
                                  f"run python tools/build_notebooks.py {src.stem[:2]}"
    for i, (g, w) in enumerate(zip(got, want)):
        diff = "\n".join(difflib.unified_diff(w[1].splitlines(), g[1].splitlines(), "source", "notebook", n=0,
                                               lineterm=""))
        if g != w:
            pytest.fail(f"{src.stem}.ipynb cell {i} ({w[0]}) differs from notebooks/src/{src.name} (run python "
                        f"tools/build_notebooks.py {src.stem[:2]}):\n{diff}", pytrace=False)


# --------------------------------------------------------------------------- exercises mirror solutions


EXERCISE_FILES = sorted(p.stem for p in (ROOT / "exercises").glob("ch*.py"))


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
    assert EXERCISE_FILES == sorted(p.stem for p in (ROOT / "solutions").glob("ch*.py"))


@pytest.mark.parametrize("module", EXERCISE_FILES)
def test_exercises_and_solutions_expose_the_same_names_and_signatures(module):
    ex = _public_api(_load_file(ROOT / "exercises" / f"{module}.py", f"_shape_exercises_{module}"))
    sol = _public_api(_load_file(ROOT / "solutions" / f"{module}.py", f"_shape_solutions_{module}"))
    assert ex == sol


def test_every_exercise_has_a_checker_an_exercise_and_a_solution():
    from course_lib.check import EXERCISES

    for name, ex in EXERCISES.items():
        assert callable(ex.runner), name
        assert ex.runner.__module__ == f"course_lib.checks.{ex.module}", \
            f"{name}: checker {ex.runner.__module__}.{ex.runner.__name__} is not in course_lib/checks/{ex.module}.py"
        for package in ("exercises", "solutions"):
            module = _load_file(ROOT / package / f"{ex.module}.py", f"_shape_{package}_{ex.module}")
            assert callable(getattr(module, ex.function, None)), f"{name}: {package}/{ex.module}.py has no " \
                                                                 f"{ex.function}"


# --------------------------------------------------------------------------- layout of course_lib/


def _modules() -> list[Path]:
    return sorted(p for p in LIB.rglob("*.py") if "__pycache__" not in p.parts)


def _course_lib_imports(path: Path) -> set[str]:
    """The ``course_lib`` modules ``path`` imports (at any depth, lazy imports too), as their first component."""
    return _imports_in(path.read_text(encoding="utf-8"), ["course_lib", *path.relative_to(LIB).parent.parts])


def _imports_in(source: str, package: list[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = base + (node.module.split(".") if node.module else [])
            targets = [mod + [alias.name] for alias in node.names] if not node.module else [mod]
        else:
            continue
        for parts in targets:
            if len(parts) >= 2 and parts[0] == "course_lib":
                found.add(parts[1])
    return found


def test_no_module_is_longer_than_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules() if p.name not in LONG_ALLOWED
            and (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"over {MAX_LINES} lines: split them"


def test_no_gc_get_objects_in_course_lib():
    users = [str(p.relative_to(ROOT)) for p in _modules() if "gc.get_objects" in p.read_text(encoding="utf-8")]
    assert users == []


@pytest.mark.parametrize("name", sorted(n for n in FOUNDATION if (LIB / f"{n}.py").exists()))
def test_foundation_imports_only_foundation(name):
    assert _course_lib_imports(LIB / f"{name}.py") - FOUNDATION == set()


@pytest.mark.parametrize("name", sorted(n for n in TECHNIQUES if (LIB / f"{n}.py").exists()))
def test_techniques_import_no_experiment_or_checker(name):
    assert _course_lib_imports(LIB / f"{name}.py") & ABOVE_TECHNIQUES == set()


def test_import_parser_sees_relative_absolute_and_lazy_imports():
    source = ("from ..memory import x\nfrom . import common\nfrom .. import zero\nimport course_lib.ddp\n"
              "import torch\nfrom torch import nn\n"
              "def f():\n    from course_lib.checks import collectives\n")
    assert _imports_in(source, ["course_lib", "experiments"]) == {"memory", "experiments", "zero", "ddp", "checks"}
    assert _imports_in("from .launch import device\n", ["course_lib"]) == {"launch"}
