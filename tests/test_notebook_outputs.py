"""The stored notebooks' outputs are what a learner should read: no logs, no warnings, no stderr.

Ray's raylet and core-worker lines ("(raylet) WARNING: N PYTHON worker processes…", "core_worker.cc:…"),
Python warnings and any stderr stream reach cells asynchronously unless they are silenced at their source
(course_lib.ray_train.start's logging settings, warnings filters); this test reads every stored output.
A traceback a cell is *meant* to show is an ``error`` output of a cell tagged ``raises-exception``.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

LOG_LINE = re.compile(
    r"\((raylet|gcs_server|dashboard|pid=\d+|RayTrainWorker|TrainController)[^)]*\)"  # Ray's prefixes
    r"|core_worker\.cc|\.cc:\d+:"  # Ray's C++ log lines
    r"|^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"  # a timestamped log record
    r"|\b\w*Warning: |\bWARNING\b"  # Python warnings and WARNING-level records
)


def _lines(path: Path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream":
                for line in "".join(out["text"]).splitlines():
                    yield i, out["name"], line
            elif out["output_type"] == "error":
                tags = cell.get("metadata", {}).get("tags", [])
                if "raises-exception" not in tags:
                    yield i, "error", f"{out['ename']}: {out['evalue']}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_stored_outputs_hold_no_log_line_warning_or_stderr(path):
    bad = [
        f"cell {i} ({stream}): {line[:120]}"
        for i, stream, line in _lines(path)
        if stream != "stdout" or LOG_LINE.search(line)
    ]
    assert not bad, f"{path.name}: {len(bad)} log/stderr line(s):\n  " + "\n  ".join(bad[:10])
