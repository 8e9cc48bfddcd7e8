"""Build notebooks/NN_*.ipynb from their sources notebooks/src/NN_*.py, then execute them in place.

Source format (percent cells, as jupytext writes them):
    # %% [markdown]
    # # Title
    # text ...
    # %%
    code ...
Usage: python tools/build_notebooks.py [NAME_PREFIX ...] [--no-execute | --sources-only]
``--sources-only`` writes each code cell's new source into the stored notebook and keeps its outputs
(for renames that cannot change an output; strict nbval then proves they did not). It refuses when the
cell structure (count or kinds) changed: such a notebook must be executed.
Each notebook is executed with its working directory in notebooks/ and stored with outputs,
which strict nbval (`make test`) then compares on every run.
"""

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
SRC, OUT = ROOT / "notebooks" / "src", ROOT / "notebooks"


def parse(text: str) -> nbformat.NotebookNode:
    cells, kind, buf = [], None, []

    def flush():
        if kind is None:
            return
        body = "\n".join(buf).strip("\n")
        if kind == "markdown":
            body = "\n".join(
                ln[2:] if ln.startswith("# ") else ln.lstrip("#") for ln in body.splitlines()
            )
            cells.append(nbformat.v4.new_markdown_cell(body))
        elif body:
            cells.append(nbformat.v4.new_code_cell(body))

    for line in text.splitlines():
        if line.startswith("# %%"):
            flush()
            kind, buf = ("markdown" if "[markdown]" in line else "code"), []
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
    for cell, fresh in zip(old.cells, new.cells):
        if cell.source != fresh.source:
            cell.source, changed = fresh.source, changed + 1
    nbformat.write(old, target)
    print(f"{target.name:<40} {changed} cell source(s) updated, outputs kept", flush=True)


def main(argv):
    if "--sources-only" in argv:
        for src in sorted(SRC.glob("[0-9][0-9]_*.py")):
            if not [a for a in argv if not a.startswith("--")] or any(
                src.name.startswith(a) for a in argv
            ):
                update_sources(src)
        return
    execute = "--no-execute" not in argv
    prefixes = [a for a in argv if not a.startswith("--")]
    for src in sorted(SRC.glob("[0-9][0-9]_*.py")):
        if prefixes and not any(src.name.startswith(p) for p in prefixes):
            continue
        nb = parse(src.read_text(encoding="utf-8"))
        for i, cell in enumerate(nb.cells):
            cell["id"] = f"{src.stem[:2]}-{i:03d}"  # stable ids: clean diffs
        t0 = time.perf_counter()
        if execute:
            NotebookClient(
                nb,
                timeout=900,
                kernel_name="python3",
                record_timing=False,
                resources={"metadata": {"path": str(OUT)}},
            ).execute()
        target = OUT / (src.stem + ".ipynb")
        nbformat.write(nb, target)
        print(f"{target.name:<40} {time.perf_counter() - t0:6.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
