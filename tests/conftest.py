"""Shared test set-up: the test process itself computes with one thread, like every rank does.

Single-device references are then computed the same way as on the ranks (one thread), and the
test process does not compete with the ranks it spawns for the machine's cores.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _progress_file_in_tmp(tmp_path_factory, monkeypatch):
    """Quizzes, the exam and passing check() calls write the learner's progress file: tests write a temporary
    one (``$COURSE_LIB_HOME``), never the real ``~/.cache/course_lib/progress.json``."""
    monkeypatch.setenv("COURSE_LIB_HOME", str(tmp_path_factory.getbasetemp() / "course_lib_home"))


@pytest.fixture
def learner_answer(tmp_path, monkeypatch):
    """Install a learner's answer file as ``exercises/<module>.py`` and return ``check`` bound to it.

    ``run = learner_answer("collectives", source)`` writes the source into a temporary
    ``exercises`` package that the checker loads instead of the shipped one; ``run(name)`` checks
    exercise ``name`` against it. The real ``exercises`` modules come back after the test.
    """
    import sys

    import course_lib.check as chk

    def forget():
        for mod in [m for m in sys.modules if m == "exercises" or m.startswith("exercises.")]:
            del sys.modules[mod]

    def install(module: str, source: str):
        pkg = tmp_path / "exercises"
        pkg.mkdir(exist_ok=True)
        (pkg / "__init__.py").write_text("")
        (pkg / f"{module}.py").write_text(source)
        monkeypatch.setattr(chk, "_course_root", lambda: tmp_path)
        for mod in [m for m in sys.modules if m == "exercises" or m.startswith("exercises.")]:
            monkeypatch.delitem(sys.modules, mod)
        monkeypatch.syspath_prepend(str(tmp_path))

        def run(name: str):
            try:
                return chk.check(name)
            finally:  # forget the answer's modules; monkeypatch then puts the real ones back
                forget()

        return run

    return install
