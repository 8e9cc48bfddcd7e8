"""The one notebook executor: build notebooks/NN_*.ipynb from notebooks/src/NN_*.py, run, store.

Source format (percent cells, as jupytext writes them):
    # %% [markdown]
    # # Title
    # text ...
    # %%
    code ...

Usage (``make notebooks [NB=02]`` and ``make course`` call it):
    python tools/build_notebooks.py [SELECT ...] [--force] [--wait S] [--max-load L] [--out DIR]
    python tools/build_notebooks.py [SELECT ...] --sources-only | --no-execute
    python tools/build_notebooks.py --ledger
SELECT is a name prefix (``02``, ``02_ddp``) or a path (``notebooks/02_ddp.ipynb``); none, or a
directory, selects every notebook.

One notebook at a time, each on a quiet machine: before each one the executor waits (up to
``--wait`` s) for the 1-minute load to fall to ``--max-load`` (default 0.25 per core) and for no
other pytest / nbval / ipykernel / build / Ray process to be alive, then refuses, naming the load
and the processes (``--force`` builds anyway and records ``forced: true``). Cells run one by one
in one kernel, working directory notebooks/; then one more cell, not stored, reports the
``course_lib`` modules the kernel loaded. The notebook's metadata ``course_lib`` records the
provenance (tools/nb_provenance.py): commit, load before and after, cores, runtime, versions and
the sha256 of the source, of every ``course_lib`` module it may run and of the data it reads.
The opener's ``**Stored build:**`` line (if the source has one) is rewritten with the measured
runtime, in the source and in the notebook; the hash leaves that line out. After a build into
notebooks/, docs/runtimes.md's table is regenerated (``--ledger`` does only that).

``--out DIR`` stores the executed copies in DIR and touches neither sources nor ledger
(``make course``: run the course headless and print each runtime). ``--sources-only`` writes each
code cell's new source into the stored notebook and keeps its outputs (for renames that cannot
change an output; strict nbval then proves they did not; the provenance then reads stale until the
next build). It refuses when the cell structure (count or kinds) changed: such a notebook must be
executed. ``--no-execute`` stores the cells without outputs or provenance.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nb_provenance as prov  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SRC, OUT = ROOT / "notebooks" / "src", ROOT / "notebooks"
LEDGER = ROOT / "docs" / "runtimes.md"


def _tags(header: str) -> list[str]:
    """A cell header's tags, as jupytext writes them: ``# %% tags=["nbval-ignore-output"]``.

    Tags keep test markers out of the learner's view: nbval reads ``nbval-ignore-output`` (a cell
    whose output is a measurement) from the cell's metadata, not from a comment in its code."""
    if "tags=" not in header:
        return []
    value = json.loads(header.split("tags=", 1)[1].strip())
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise SystemExit(f"cell header {header!r}: tags= must be a JSON list of strings")
    return value


def parse(text: str) -> nbformat.NotebookNode:
    cells, kind, buf = [], None, []

    def flush():
        if kind is None:
            return
        body = "\n".join(buf).strip("\n")
        tags = _tags(header)
        if kind == "markdown":
            body = "\n".join(
                ln[2:] if ln.startswith("# ") else ln.lstrip("#") for ln in body.splitlines()
            )
            cells.append(nbformat.v4.new_markdown_cell(body))
        elif body:
            cell = nbformat.v4.new_code_cell(body)
            if tags:
                cell.metadata["tags"] = tags
            cells.append(cell)

    header = ""
    for line in text.splitlines():
        if line.startswith("# %%"):
            flush()
            kind, buf, header = ("markdown" if "[markdown]" in line else "code"), [], line
        else:
            buf.append(line)
    flush()
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def build(src: Path, text: str | None = None) -> nbformat.NotebookNode:
    """The notebook ``src`` (or ``text``) builds, without outputs, with stable ids (clean diffs)."""
    nb = parse(src.read_text(encoding="utf-8") if text is None else text)
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{src.stem[:2]}-{i:03d}"
    return nb


def update_sources(src: Path) -> None:
    """Replace the stored notebook's cell sources by its source file's, keeping every output."""
    target = OUT / (src.stem + ".ipynb")
    new, old = parse(src.read_text(encoding="utf-8")), nbformat.read(target, as_version=4)
    kinds_new, kinds_old = [c.cell_type for c in new.cells], [c.cell_type for c in old.cells]
    if kinds_new != kinds_old:
        raise SystemExit(
            f"{target.name}: the cells changed ({len(kinds_old)} stored, {len(kinds_new)} in the "
            f"source, or their kinds): execute it instead of --sources-only"
        )
    changed = 0
    for cell, fresh in zip(old.cells, new.cells, strict=True):
        tags = fresh.metadata.get("tags", [])
        if cell.source != fresh.source or cell.metadata.get("tags", []) != tags:
            cell.source, changed = fresh.source, changed + 1
            cell.metadata.pop("tags", None)
            if tags:
                cell.metadata["tags"] = tags
    nbformat.write(old, target)
    print(f"{target.name:<40} {changed} cell source(s) updated, outputs kept", flush=True)


# --------------------------------------------------------------------------- executing

# Run after the last cell in the same kernel, never stored: what the kernel imported from here.
PROBE = """\
import json as _json, sys as _sys
print("COURSE_LIB_PROBE " + _json.dumps({
    "modules": {m: getattr(_sys.modules[m], "__file__", None) for m in sorted(_sys.modules)
                if m.split(".")[0] in ("course_lib", "exercises", "solutions")},
    "python": _sys.version.split()[0],
    "torch": str(getattr(_sys.modules.get("torch"), "__version__", None) or "") or None,
}))"""


def execute(nb: nbformat.NotebookNode, cwd: Path, timeout: int = 900) -> tuple[float, dict]:
    """Run every cell of ``nb`` in place; return the cells' runtime (s) and the probe's report."""
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(cwd)}},
    )
    client.reset_execution_trackers()
    with client.setup_kernel():
        info = client.wait_for_reply(client.kc.kernel_info())
        nb.metadata["language_info"] = info["content"]["language_info"]
        t0 = time.perf_counter()
        for i, cell in enumerate(nb.cells):
            client.execute_cell(cell, i, execution_count=client.code_cells_executed + 1)
        runtime = time.perf_counter() - t0
        client.set_widgets_metadata()
        probe = nbformat.v4.new_code_cell(PROBE)
        nb.cells.append(probe)  # nbclient writes a cell back by index: removed right after
        try:
            client.execute_cell(probe, len(nb.cells) - 1, store_history=False)
        finally:
            nb.cells.pop()
    text = "".join(o.get("text", "") for o in probe.outputs if o.get("name") == "stdout")
    line = next(ln for ln in text.splitlines() if ln.startswith("COURSE_LIB_PROBE "))
    return runtime, json.loads(line.split(" ", 1)[1])


def run_one(
    src: Path,
    target: Path,
    *,
    force: bool = False,
    max_load: float | None = None,
    wait_s: float = 300,
    patterns=prov.BUSY_PATTERNS,
    timeout: int = 900,
    write_source: bool = True,
    cwd: Path | None = None,
    root: Path = prov.ROOT,
    check_load: bool = True,
) -> dict:
    """Execute the notebook ``src`` builds on a quiet machine, store it at ``target``; its record.

    Raises :class:`nb_provenance.Busy` when the machine stays busy (unless ``force``)."""
    max_load = prov.default_max_load() if max_load is None else max_load
    if force:
        load_before = os.getloadavg()[0]
    else:
        load_before = prov.wait_until_quiet(max_load, wait_s, patterns, check_load=check_load)
    cpu_before = prov.cpu_use()  # the share of the cores others used just before the run
    commit, dirty = prov.git_commit(root), prov.git_dirty(root)
    text, files = src.read_text(encoding="utf-8"), prov.snapshot(root)
    nb = build(src, text)
    target.parent.mkdir(parents=True, exist_ok=True)
    runtime, probe = execute(nb, cwd or target.parent, timeout)
    load_after = os.getloadavg()[0]

    for name, file in probe["modules"].items():
        want = prov.module_file(name, root)
        if file and (want is None or Path(file).resolve() != want.resolve()):
            raise RuntimeError(
                f"{src.stem}: the kernel imported {name} from {file}, not from this checkout "
                f"({root}): install it with pip install -e ."
            )
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    modules = prov.module_closure(set(probe["modules"]) | prov.source_imports(code, root), root)
    data = prov.data_files(modules, prov.chapter_topic(src.stem), root)
    cores = os.cpu_count() or 1
    record = {
        "commit": commit,
        "dirty": dirty,
        "load_before": round(load_before, 2),
        "load_after": round(load_after, 2),
        "cpu_before": round(cpu_before, 3),
        "cores": cores,
        "runtime_s": round(runtime, 1),
        "clock": None,
        "forced": force,
        "python": probe["python"],
        "torch": probe["torch"],
        "hashes": prov.hashes(text, modules, data, root, files),
    }
    if prov.hashes(text, modules, data, root) != record["hashes"]:
        raise RuntimeError(
            f"{src.stem}: course_lib or its data changed during the run: run it again"
        )
    # The 1-minute load lags (a build's previous notebook still shows in it): the line quotes the
    # CPU others used in the 2 s before this notebook started; the record keeps both.
    words = (
        f"{runtime:.0f} s on {cores} cores ({cpu_before:.0%} of them busy just before it started)"
    )
    new_text = prov.with_runtime_line(
        text, words + ("; forced on a busy machine." if force else ".")
    )
    if new_text != text:
        # one comment line of the opener changed: the same cells
        for cell, fresh in zip(nb.cells, parse(new_text).cells, strict=True):
            if cell.cell_type == "markdown":
                cell.source = fresh.source
        if write_source:
            src.write_text(new_text, encoding="utf-8")
    nb.metadata["course_lib"] = record
    nbformat.write(nb, target)
    return record


# --------------------------------------------------------------------------- the ledger


def records(notebooks: Path = OUT) -> dict[str, dict | None]:
    """Each stored notebook's provenance (None where it has none)."""
    return {
        p.stem: nbformat.read(p, as_version=4).metadata.get("course_lib")
        for p in sorted(notebooks.glob("[0-9][0-9]_*.ipynb"))
    }


def write_ledger(path: Path = LEDGER, notebooks: Path = OUT) -> None:
    text = path.read_text(encoding="utf-8")
    path.write_text(prov.replace_ledger(text, prov.ledger(records(notebooks))), encoding="utf-8")
    print(f"{path.relative_to(ROOT)} rewritten from the notebooks' metadata", flush=True)


# --------------------------------------------------------------------------- command line


def select(selectors: list[str]) -> list[Path]:
    """The sources named by prefixes or paths (none, or a directory: all)."""
    sources = sorted(SRC.glob("[0-9][0-9]_*.py"))
    names = [Path(s).name.removesuffix(".ipynb").removesuffix(".py") for s in selectors]
    if not selectors or any(Path(s).is_dir() for s in selectors):
        return sources
    chosen = [src for src in sources if any(src.stem.startswith(n) for n in names)]
    if not chosen:
        raise SystemExit(f"no notebook source in {SRC.relative_to(ROOT)} matches {selectors}")
    return chosen


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="build_notebooks.py", description=__doc__.split("\n")[0])
    ap.add_argument("select", nargs="*", help="name prefixes (02, 02_ddp) or paths; none: all")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--sources-only", action="store_true", help="new cell sources, outputs kept")
    mode.add_argument("--no-execute", action="store_true", help="store cells without outputs")
    mode.add_argument("--ledger", action="store_true", help="only rewrite docs/runtimes.md")
    ap.add_argument("--force", action="store_true", help="skip the busy check (forced: true)")
    ap.add_argument("--wait", type=float, default=300, help="seconds to wait for quiet (300)")
    ap.add_argument(
        "--max-load",
        type=float,
        default=prov.default_max_load(),
        help=f"1-minute load counted as quiet (default {prov.LOAD_PER_CORE} x cores)",
    )
    ap.add_argument("--out", type=Path, help="store executed copies here; sources, ledger kept")
    ap.add_argument("--timeout", type=int, default=900, help="per-cell timeout (s)")
    ns = ap.parse_args(argv)

    if ns.ledger:
        return write_ledger()
    sources = select(ns.select)
    if ns.sources_only:
        for src in sources:
            update_sources(src)
        return
    if ns.no_execute:
        for src in sources:
            (ns.out or OUT).mkdir(parents=True, exist_ok=True)
            nbformat.write(build(src), (ns.out or OUT) / (src.stem + ".ipynb"))
            print(f"{src.stem + '.ipynb':<40} built, not executed", flush=True)
        return
    total = 0.0
    for i, src in enumerate(sources):
        target = (ns.out or OUT) / (src.stem + ".ipynb")
        try:
            rec = run_one(
                src,
                target,
                force=ns.force,
                max_load=ns.max_load,
                wait_s=ns.wait,
                timeout=ns.timeout,
                write_source=ns.out is None,
                cwd=OUT,
                check_load=i == 0,  # later: the load average holds our own previous notebook
            )
        except prov.Busy as exc:
            raise SystemExit(f"refusing to run {src.stem}: {exc}") from None
        total += rec["runtime_s"]
        over = rec["runtime_s"] > prov.runtime_limit(src.stem)
        print(
            f"{target.name:<40} {rec['runtime_s']:6.1f} s  load {rec['load_before']:.2f} -> "
            f"{rec['load_after']:.2f}"
            + ("  FORCED" if ns.force else "")
            + (f"  OVER its {prov.runtime_limit(src.stem)} s budget" if over else ""),
            flush=True,
        )
    print(f"{'all notebooks':<40} {total:6.1f} s", flush=True)
    if ns.out is None:
        write_ledger()


if __name__ == "__main__":
    main(sys.argv[1:])
