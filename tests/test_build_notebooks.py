"""The one notebook executor (tools/build_notebooks.py) and its provenance (tools/nb_provenance.py).

* the busy check names a real busy process (a sleeping child orphaned outside this test's process
  tree) and a load above the threshold, refuses with both, and ``make notebooks`` refuses before
  it runs anything; processes of its own tree (the pytest running it) never count;
* the opener's runtime line is kept out of the source hash (and only that line);
* the module closure follows imports inside functions and module names in strings; changing a
  module, the source or the quiz bank makes a record stale, naming what changed;
* one real kernel run of a tiny two-cell notebook, forced past a busy check it would fail, stores
  the provenance, rewrites the runtime line in source and notebook, and stores no probe cell.
"""

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_build():
    spec = importlib.util.spec_from_file_location(
        "_test_build_notebooks", ROOT / "tools" / "build_notebooks.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_build()
prov = build.prov


# --------------------------------------------------------------------------- the busy check


@pytest.fixture
def orphan_sleeper():
    """A real ``python -c 'sleep'`` whose argv carries a unique marker, outside our process tree.

    ``sh -c '... &'`` exits at once, so the sleeper is re-parented away from this test; it is
    ended by its pid afterwards."""
    marker = f"fake-nbval-{uuid.uuid4().hex[:8]}"
    code = "import time; time.sleep(60)"
    out = subprocess.run(
        ["sh", "-c", f"{sys.executable} -c '{code}' {marker} >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(out.stdout.strip())
    for _ in range(100):  # until its argv is visible
        if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            break
        time.sleep(0.02)
    yield marker, pid
    os.kill(pid, signal.SIGTERM)


def test_busy_check_names_a_busy_process_and_refuses(orphan_sleeper):
    marker, pid = orphan_sleeper
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", marker])
    try:
        busy = prov.busy_processes((marker,))
        assert [p for p, _ in busy] == [pid], busy  # our own child is not "another run"
        assert marker in busy[0][1] and "time.sleep(60)" in busy[0][1]
        with pytest.raises(prov.Busy) as exc:
            prov.wait_until_quiet(float("inf"), wait_s=0, patterns=(marker,))
    finally:
        child.kill()
        child.wait()
    assert f"pid {pid} is running:" in str(exc.value) and marker in str(exc.value)
    assert "--force" in str(exc.value)


def test_busy_check_refuses_a_load_above_the_threshold_after_waiting():
    t0 = time.monotonic()
    with pytest.raises(prov.Busy, match=r"1-minute load \d+\.\d\d > -1\.00"):
        prov.wait_until_quiet(-1.0, wait_s=0.3, patterns=(), poll_s=0.1, say=lambda _: None)
    assert time.monotonic() - t0 >= 0.3  # it waited for the load to decay before refusing
    load = prov.wait_until_quiet(float("inf"), wait_s=0, patterns=(), max_cpu=1.0)
    assert load == pytest.approx(os.getloadavg()[0], abs=1.0)


def test_busy_check_refuses_cpu_in_use_now_and_between_notebooks_leaves_the_load_out():
    with pytest.raises(prov.Busy, match=r"CPU use \d+% of all cores over 2 s > -100%"):
        prov.wait_until_quiet(float("inf"), wait_s=0, patterns=(), max_cpu=-1.0)
    # a load above the threshold alone does not refuse a build's later notebooks
    prov.wait_until_quiet(-1.0, wait_s=0, patterns=(), max_cpu=1.0, check_load=False)
    assert 0.0 <= prov.cpu_use(0.2) <= 1.0


def test_the_executor_refuses_on_a_busy_machine_before_running_anything():
    with pytest.raises(SystemExit, match=r"refusing to run 00_\w+: the machine is busy"):
        build.main(["00", "--max-load", "-1", "--wait", "0"])


def test_the_executors_own_process_tree_is_never_busy():
    tree = prov.own_tree(prov._processes())
    assert {os.getpid(), os.getppid()} <= tree
    mine = max(Path("/proc/self/cmdline").read_bytes().decode().split("\0"), key=len)
    assert [p for p, _ in prov.busy_processes((mine,)) if p in (os.getpid(), os.getppid())] == []


# --------------------------------------------------------------------------- hashes

SOURCE = """\
# %% [markdown]
# # Tiny
# **Stored build:** pending
# One line of prose.

# %%
import course_lib.results

x = 1

# %%
def f():
    from course_lib import chapters

    return chapters.number("ddp")


print(x + f())

# %% [markdown]
# **Stored build:** a later line with the marker is ordinary text
"""


def test_the_runtime_line_is_kept_out_of_the_source_hash():
    a = prov.with_runtime_line(SOURCE, "1 s on 2 cores")
    b = prov.with_runtime_line(SOURCE, "99 s on 16 cores")
    assert a != b and "# **Stored build:** 99 s on 16 cores\n" in b
    assert prov.source_hash(a) == prov.source_hash(b) == prov.source_hash(SOURCE)
    assert prov.source_hash(SOURCE.replace("x = 1", "x = 2")) != prov.source_hash(SOURCE)
    later = SOURCE.replace("ordinary text", "other text")
    assert prov.source_hash(later) != prov.source_hash(SOURCE)  # only the opener's line is left out
    no_line = SOURCE.replace("# **Stored build:** pending\n", "")
    assert prov.with_runtime_line(no_line, "1 s") == no_line  # no line: none is added


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.fixture
def fake_checkout(tmp_path):
    _tree(
        tmp_path,
        {
            "course_lib/__init__.py": "",
            "course_lib/a.py": "def f():\n    from . import b\n",  # only inside a function
            "course_lib/b.py": "import course_lib.c\n",
            "course_lib/c.py": "CHECKER = 'course_lib.d:run'\n",  # a module named in a string
            "course_lib/d.py": "from .quiz import bank\n",
            "course_lib/e.py": "",  # imported by nobody
            "course_lib/quiz/__init__.py": "",
            "course_lib/quiz/bank.py": "",
            "course_lib/quiz_bank/ddp.yaml": "- id: ddp-1\n",
            "notebooks/src/00_tiny.py": SOURCE,
        },
    )
    return tmp_path


def test_module_closure_follows_function_level_imports_and_strings(fake_checkout):
    got = prov.module_closure({"course_lib.a"}, root=fake_checkout)
    assert got == {
        "course_lib",
        "course_lib.a",
        "course_lib.b",
        "course_lib.c",
        "course_lib.d",
        "course_lib.quiz",
        "course_lib.quiz.bank",
    }
    cells = ["import subprocess\nsubprocess.run(['python', '-m', 'course_lib.e'])", "%timeit 1"]
    assert prov.source_imports(cells, root=fake_checkout) == {"course_lib", "course_lib.e"}
    # the real package: cli imports launch only inside doctor()
    assert "course_lib.launch" in prov.module_closure({"course_lib.cli"})


def test_a_record_goes_stale_naming_what_changed(fake_checkout):
    root, src = fake_checkout, fake_checkout / "notebooks" / "src" / "00_tiny.py"
    modules = prov.module_closure({"course_lib.a"}, root=root)
    data = prov.data_files(modules, root=root)
    assert [p.name for p in data] == ["ddp.yaml"]
    record = {"hashes": prov.hashes(src.read_text(), modules, data, root)}
    assert prov.stale_reasons(record, src, root) == []
    src.write_text(prov.with_runtime_line(SOURCE, "42 s on 2 cores"))
    assert prov.stale_reasons(record, src, root) == []  # a rebuild's runtime line is not a change
    (root / "course_lib" / "b.py").write_text("import course_lib.c  # edited\n")
    (root / "course_lib" / "quiz_bank" / "zero.yaml").write_text("- id: zero-1\n")
    src.write_text(SOURCE.replace("x = 1", "x = 2"))
    assert prov.stale_reasons(record, src, root) == [
        "source notebooks/src/00_tiny.py changed",
        "module course_lib.b changed (course_lib/b.py)",
        "data file course_lib/quiz_bank/zero.yaml is new",
    ]


# --------------------------------------------------------------------------- one real kernel run


def test_a_tiny_notebook_run_stores_its_provenance(tmp_path):
    src, target = tmp_path / "00_tiny.py", tmp_path / "out" / "00_tiny.ipynb"
    src.write_text(SOURCE)
    # forced: this check alone would refuse (every load is above -1)
    record = build.run_one(src, target, force=True, max_load=-1.0, wait_s=0)

    assert record["forced"] is True and record["cores"] == os.cpu_count()
    assert 0 < record["runtime_s"] < 60 and record["clock"] is None
    assert record["commit"] == prov.git_commit() and isinstance(record["dirty"], bool)
    import torch  # course_lib.results imports it, so the kernel has it

    assert record["python"] == sys.version.split()[0] and record["torch"] == str(torch.__version__)
    hashes = record["hashes"]
    assert hashes["source"] == prov.source_hash(SOURCE) == prov.source_hash(src.read_text())
    modules = hashes["modules"]
    assert {"course_lib", "course_lib.results", "course_lib.chapters"} <= set(modules)
    assert modules["course_lib.results"] == prov.file_hash(ROOT / "course_lib" / "results.py")
    assert prov.stale_reasons(record, src) == []

    nb = nbformat.read(target, as_version=4)
    assert nb.metadata["course_lib"] == record
    assert [c["id"] for c in nb.cells] == ["00-000", "00-001", "00-002", "00-003"]
    assert [c.cell_type for c in nb.cells] == ["markdown", "code", "code", "markdown"]  # no probe
    assert nb.cells[2].outputs[0]["text"] == "3\n"
    busy = f"({record['cpu_before']:.0%} of them busy just before it started)"
    line = f"**Stored build:** {record['runtime_s']:.0f} s on {os.cpu_count()} cores {busy}"
    assert 0.0 <= record["cpu_before"] <= 1.0
    assert line in nb.cells[0].source and f"# {line}" in src.read_text()
    assert "forced on a busy machine" in nb.cells[0].source


def test_cell_tags_come_from_the_header_and_stay_out_of_the_code():
    text = '# %% [markdown]\n# # T\n# %% tags=["nbval-ignore-output"]\nx = 1\n# %%\ny = 2\n'
    cells = build.parse(text).cells
    assert [c.metadata.get("tags", []) for c in cells] == [[], ["nbval-ignore-output"], []]
    assert cells[1].source == "x = 1"
    with pytest.raises(SystemExit, match="tags= must be a JSON list"):
        build.parse('# %% tags="x"\nx = 1\n')


def test_no_notebook_source_marks_cells_with_comments():
    for src in sorted((ROOT / "notebooks" / "src").glob("*.py")):
        assert "NBVAL_" not in src.read_text(encoding="utf-8"), f"{src.name}: use a cell tag"


def test_a_command_waiting_for_the_cpu_lock_is_not_busy_but_the_command_holding_it_is(tmp_path):
    """``flock LOCK cmd`` waits for the lock (not busy); once it holds it, ``cmd`` runs as its child (busy).

    Both flocks start outside our process tree (``sh -c '... &'``), like a helper's queued test run."""
    assert shutil.which("flock"), "flock(1) (util-linux) is needed by the course's CPU lock"
    marker = f"course-lib-lock-test-{uuid.uuid4().hex[:8]}"
    lock = tmp_path / "cpu.lock"
    cmd = f"{sys.executable} -c 'import time; time.sleep(20)' {marker}"
    out = subprocess.run(
        ["sh", "-c", f"for i in 1 2; do flock {lock} {cmd} >/dev/null 2>&1 & echo $!; done"],
        capture_output=True,
        text=True,
        check=True,
    )
    flocks = [int(v) for v in out.stdout.split()]
    busy = []
    try:
        for _ in range(200):  # until the holder's child runs
            busy = prov.busy_processes((marker,))
            if busy:
                break
            time.sleep(0.02)
        pids = [p for p, _ in busy]
        assert len(pids) == 1 and pids[0] not in flocks, busy  # the holder's child, not the flocks
        assert "time.sleep(20)" in busy[0][1]
    finally:
        for pid in flocks + [p for p, _ in busy]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
