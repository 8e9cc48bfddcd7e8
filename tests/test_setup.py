"""Set-up: pins agree everywhere, the CLI doctor passes, CI calls the README's test command."""

import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _pins(lines):
    return {
        re.split(r"[=\[]", ln)[0].lower(): ln.strip()
        for ln in lines
        if ln.strip() and not ln.strip().startswith("#")
    }


def test_environment_yml_mirrors_requirements():
    req = _pins((ROOT / "requirements.txt").read_text().splitlines())
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert _pins(pip) == req
    assert pip[0] == "torch==2.13.0", "torch must be installed first"
    assert all("==" in v for v in req.values()), "every requirement is pinned"


def test_makefile_installs_pinned_torch_first():
    mk = (ROOT / "Makefile").read_text()
    assert mk.index("pip install --quiet torch==2.13.0") < mk.index("-r requirements.txt")


def test_ci_runs_make_test_and_readme_has_the_two_commands():
    assert "make test" in (ROOT / ".ci/run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make lab" in readme and "make test" in readme


def test_doctor_passes():
    proc = subprocess.run(
        [sys.executable, "-m", "course_lib.cli", "doctor"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for word in (
        "torch",
        "ray",
        "backend",
        "cpu cores",
        "ranks",
        "c++ compiler",
        "Python.h",
        "doctor: ok",
    ):
        assert word in proc.stdout


def test_jupyterlab_starts_on_localhost_with_a_token(tmp_path):
    """What `make lab` runs: JupyterLab on notebooks/, bound to 127.0.0.1, token kept."""
    import os
    import time

    lab = Path(sys.executable).parent / "jupyter"
    mk = (ROOT / "Makefile").read_text()
    assert "--ServerApp.ip=127.0.0.1" in mk and "token" not in mk.lower(), (
        "make lab must not drop the token"
    )
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path), HOME=str(tmp_path))
    proc = subprocess.Popen(
        [
            str(lab),
            "lab",
            "--ServerApp.ip=127.0.0.1",
            "--ServerApp.port=0",
            "--no-browser",
            *(["--allow-root"] if os.getuid() == 0 else []),
            f"--notebook-dir={ROOT / 'notebooks'}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        deadline, seen = time.monotonic() + 90, ""
        while time.monotonic() < deadline and "?token=" not in seen:
            line = proc.stdout.readline()
            if not line:
                break
            seen += line
        assert "http://127.0.0.1:" in seen and "?token=" in seen, seen[-2000:]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
