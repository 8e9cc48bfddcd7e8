"""Build Horovod once per machine, cache the wheel outside the repository, install it into this venv.

Usage (``make horovod`` runs it): ``.venv/bin/python tools/build_horovod.py [--force]``

Why a build: Horovod (Uber, 2017) is retired — its last release, 0.28.1, came out in June 2023 — and
PyPI has no wheel of it for Linux; its sdist compiles a C++ extension against the installed torch.
As shipped it does not compile against torch 2.13: its CMake files force ``CMAKE_CXX_STANDARD 14``
and torch's headers need C++17. Setting 17 in ``CMakeLists.txt`` and ``horovod/torch/CMakeLists.txt``
is the whole fix. Built with gloo (no MPI), for PyTorch only, ``make -j<cores>``: ≈290 CPU-seconds —
≈7 minutes on 2 idle cores, 17.5 minutes measured on 2 cores at load average ~15.

What it does, cheapest first:

1. Horovod 0.28.1 already installed here for this torch (a marker in the venv says so): nothing.
2. The wheel is in the cache: ``pip install --no-deps`` it (seconds).
3. Otherwise: ``pip download`` the sdist from the package index, patch the C++ standard, ``pip wheel``
   it (``--no-build-isolation``: it must compile against *this* torch), store the wheel in the cache,
   install it. A lock file keeps two clones from building at once.

The cache is ``$COURSE_LIB_WHEELS`` or ``${XDG_CACHE_HOME:-~/.cache}/course_lib/wheels``, one folder per
key ``horovod-<version>_torch-<torch version>_<python tag>_<machine>``: a wheel compiled against one
torch must not be installed beside another. The build log stays in the cache as ``<key>.log``.
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import importlib.metadata as md
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

HOROVOD_VERSION = "0.28.1"
PATCHED_FILES = ("CMakeLists.txt", "horovod/torch/CMakeLists.txt")
BUILD_ENV = {
    "HOROVOD_WITH_PYTORCH": "1",
    "HOROVOD_WITHOUT_MPI": "1",
    "HOROVOD_WITH_GLOO": "1",
    "HOROVOD_WITHOUT_TENSORFLOW": "1",
    "HOROVOD_WITHOUT_MXNET": "1",
}
MARKER = os.path.join(sys.prefix, ".horovod_build_key")


def say(msg: str) -> None:
    print(f"[build_horovod] {msg}", flush=True)


def cache_root() -> str:
    if os.environ.get("COURSE_LIB_WHEELS"):
        return os.environ["COURSE_LIB_WHEELS"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "course_lib", "wheels")


def build_key() -> str:
    try:
        torch_version = md.version("torch")
    except md.PackageNotFoundError:
        raise SystemExit(
            "[build_horovod] torch is not installed in this venv: run `make setup` first"
        ) from None
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return f"horovod-{HOROVOD_VERSION}_torch-{torch_version}_{py}_{platform.machine()}"


def installed_key() -> str | None:
    try:
        if md.version("horovod") != HOROVOD_VERSION:
            return None
        with open(MARKER) as f:
            return f.read().strip()
    except (md.PackageNotFoundError, OSError):
        return None


def pip(*args: str, log=None, env=None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    if log is None:
        subprocess.run(cmd, check=True, env=env)
        return
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if rc:
        raise subprocess.CalledProcessError(rc, cmd)


def verify() -> None:
    """Import horovod.torch in a fresh interpreter: the extension must load against this torch."""
    code = "import horovod.torch as hvd; assert hvd.gloo_built(), 'Horovod was built without gloo'"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(
            f"[build_horovod] the installed Horovod does not import:\n{out.stderr[-3000:]}"
        )


def install(wheel: str, key: str) -> None:
    t0 = time.monotonic()
    # --no-deps: Horovod's own requirements (cloudpickle, psutil, pyyaml, packaging) are in
    # requirements.txt already, and pip must not touch torch.
    pip("install", "--quiet", "--no-deps", "--force-reinstall", wheel)
    verify()
    with open(MARKER, "w") as f:
        f.write(key + "\n")
    say(f"installed {os.path.basename(wheel)} ({key}) in {time.monotonic() - t0:.0f} s")


def patch_cxx_standard(src: str) -> None:
    """``CMAKE_CXX_STANDARD 14`` → 17 in both CMake files (torch ≥ 2.1 headers need C++17)."""
    for rel in PATCHED_FILES:
        path = os.path.join(src, rel)
        with open(path) as f:
            text = f.read()
        new, n = re.subn(r"(CMAKE_CXX_STANDARD\s+)14\b", r"\g<1>17", text)
        if n == 0 and not re.search(r"CMAKE_CXX_STANDARD\s+17\b", text):
            raise SystemExit(
                f"[build_horovod] {rel}: no 'CMAKE_CXX_STANDARD 14' to patch — the sdist changed; "
                "look at the file before building"
            )
        with open(path, "w") as f:
            f.write(new)
        say(f"patched {rel}: CMAKE_CXX_STANDARD 14 -> 17 ({n} place(s))")


def check_tools(env: dict) -> None:
    if not shutil.which("c++") and not shutil.which("g++"):
        raise SystemExit(
            "[build_horovod] no C++ compiler: install one (Debian: apt-get install g++)"
        )
    if not shutil.which("cmake", path=env["PATH"]):
        say("cmake not found: installing it from PyPI into this venv")
        pip("install", "--quiet", "cmake<4")  # horovod's gloo needs CMake 3 policies


def build(key: str, dest: str, log_path: str) -> str:
    """Download, patch, compile; return the wheel's path inside ``dest`` (moved there atomically)."""
    work = tempfile.mkdtemp(prefix="horovod_build_")
    env = dict(os.environ, **BUILD_ENV)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.setdefault("MAKEFLAGS", f"-j{os.cpu_count() or 1}")
    check_tools(env)
    t0 = time.monotonic()
    try:
        with open(log_path, "w") as log:
            say(f"downloading the horovod=={HOROVOD_VERSION} sdist from the package index")
            pip(
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--no-build-isolation",
                "-d",
                work,
                f"horovod=={HOROVOD_VERSION}",
                log=log,
                env=env,
            )
            (sdist,) = glob.glob(os.path.join(work, f"horovod-{HOROVOD_VERSION}.tar.gz"))
            with tarfile.open(sdist) as tar:
                tar.extractall(work, filter="data")
            src = os.path.join(work, f"horovod-{HOROVOD_VERSION}")
            patch_cxx_standard(src)
            say(f"compiling (≈7 min on 2 idle cores, longer on a busy machine); log: {log_path}")
            out = os.path.join(work, "wheel")
            pip(
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "--verbose",
                "-w",
                out,
                src,
                log=log,
                env=env,
            )
        (wheel,) = glob.glob(os.path.join(out, "horovod-*.whl"))
        staging = f"{dest}.tmp-{os.getpid()}"
        os.makedirs(staging, exist_ok=True)
        shutil.move(wheel, os.path.join(staging, os.path.basename(wheel)))
        os.rename(staging, dest)  # atomic: the cache never holds half a wheel
        say(f"built {os.path.basename(wheel)} in {time.monotonic() - t0:.0f} s -> {dest}")
        return os.path.join(dest, os.path.basename(wheel))
    except subprocess.CalledProcessError as exc:
        with open(log_path, errors="replace") as f:
            tail = f.read()[-4000:]
        raise SystemExit(
            f"[build_horovod] {' '.join(exc.cmd[2:4])} failed (exit {exc.returncode}); "
            f"end of {log_path}:\n{tail}"
        ) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def cached_wheel(dest: str) -> str | None:
    wheels = glob.glob(os.path.join(dest, "horovod-*.whl"))
    return wheels[0] if wheels else None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if the cache holds the wheel"
    )
    ns = parser.parse_args(argv)
    key = build_key()
    if not ns.force and installed_key() == key:
        say(f"Horovod {HOROVOD_VERSION} already installed for this torch ({key})")
        return
    root = cache_root()
    os.makedirs(root, exist_ok=True)
    dest = os.path.join(root, key)
    with open(os.path.join(root, f"{key}.lock"), "w") as lock:
        fcntl.flock(
            lock, fcntl.LOCK_EX
        )  # a second clone building at the same time waits here, then reuses
        wheel = None if ns.force else cached_wheel(dest)
        if wheel is None:
            if ns.force:
                shutil.rmtree(dest, ignore_errors=True)
            wheel = build(key, dest, os.path.join(root, f"{key}.log"))
        else:
            say(f"using the cached wheel {wheel}")
        install(wheel, key)


if __name__ == "__main__":
    main()
