"""The stored notebooks are fresh: built by the one executor from today's code, within the budget.

Nothing is executed. Each ``notebooks/NN_*.ipynb`` carries the provenance ``tools/build_notebooks.py``
writes (metadata ``course_lib``); its recorded sha256 of the source, of every ``course_lib`` module
it may run and of the data it reads equal today's files; its code cells are its source's; its
stored runtime is within its limit (120 s, Ray chapters 180 s) and the course within 900 s; and
``docs/runtimes.md``'s table is what the metadata says. A stale notebook is rebuilt with
``make notebooks NB=NN`` on a quiet machine.
"""

import importlib.util
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _load_build():
    """tools/build_notebooks.py as a module (it puts tools/ on sys.path for nb_provenance)."""
    spec = importlib.util.spec_from_file_location(
        "_fresh_build_notebooks", ROOT / "tools" / "build_notebooks.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_build()
prov = build.prov
RECORDS = build.records()


def test_every_stored_notebook_carries_provenance_and_is_fresh():
    assert NOTEBOOKS, "no stored notebooks found"
    problems = []
    for path in NOTEBOOKS:
        src = ROOT / "notebooks" / "src" / f"{path.stem}.py"
        record = RECORDS[path.stem]
        if not src.is_file():
            problems.append(f"{path.stem}: no source {src.relative_to(ROOT)}")
            continue
        if record is None:
            problems.append(f"{path.stem}: no provenance (not built by tools/build_notebooks.py)")
            continue
        reasons = prov.stale_reasons(record, src)
        stored = [
            (c.source, c.metadata.get("tags", []))
            for c in nbformat.read(path, as_version=4).cells
            if c.cell_type == "code"
        ]
        cells = build.parse(src.read_text(encoding="utf-8")).cells
        fresh = [(c.source, c.metadata.get("tags", [])) for c in cells if c.cell_type == "code"]
        if stored != fresh:
            # the shorter list's cells, compared in order (the lengths are reported below)
            pairs = zip(stored, fresh, strict=False)
            differ = [i for i, (a, b) in enumerate(pairs) if a != b]
            reasons.append(
                f"its code cells (source, tags) are not its source's ({len(stored)} stored, {len(fresh)} in the "
                f"source; differing code cells {differ})"
            )
        if reasons:
            problems.append(f"{path.stem}: " + "; ".join(reasons))
    if problems:
        pytest.fail(
            f"{len(problems)} of {len(NOTEBOOKS)} stored notebooks are stale; rebuild each on a "
            "quiet machine with `make notebooks NB=NN`:\n  " + "\n  ".join(problems),
            pytrace=False,
        )


def test_stored_runtimes_are_within_the_budget():
    built = {stem: rec for stem, rec in RECORDS.items() if rec is not None}
    over = [
        f"{stem}: {rec['runtime_s']:.1f} s > {prov.runtime_limit(stem)} s"
        for stem, rec in built.items()
        if rec["runtime_s"] > prov.runtime_limit(stem)
    ]
    total = sum(rec["runtime_s"] for rec in built.values())
    if total > prov.COURSE_LIMIT_S:
        over.append(f"the course ({len(built)} notebooks): {total:.1f} s > {prov.COURSE_LIMIT_S} s")
    if over:
        pytest.fail(
            "stored runtimes over their limits (docs/runtimes.md):\n  " + "\n  ".join(over),
            pytrace=False,
        )


def test_the_runtime_ledger_is_what_the_metadata_says():
    stored = prov.stored_ledger((ROOT / "docs" / "runtimes.md").read_text(encoding="utf-8"))
    assert stored == prov.ledger(RECORDS), (
        "docs/runtimes.md's table differs from the notebooks' metadata: "
        "run python tools/build_notebooks.py --ledger"
    )
