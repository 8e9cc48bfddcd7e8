"""Two "hosts" on one machine for the multi-node tests: Linux network namespaces joined by a veth pair.

    reason = skip_reason()              # None where namespaces can be made (root, iproute2, a kernel that allows it)
    with TwoHosts("rt", net=77) as hosts:
        hosts.ips                       # ("10.77.0.1", "10.77.0.2"): each host's own address on its veth
        hosts.run(0, "ip", "addr")      # a command inside host 0's namespace
        hosts.popen(1, [...], env=hosts.env(1))   # env(i): os.environ + GLOO_SOCKET_IFNAME=<host i's veth>

Inside a namespace the machine's hostname still resolves to 127.0.0.1 (``/etc/hosts`` is shared), which is why
gloo needs ``GLOO_SOCKET_IFNAME`` and torchrun needs ``--local-addr`` there.

Clean-up, in ``close()`` (and on a failed set-up): every process in the two namespaces is killed by PID
(``ip netns pids``: Ray's daemons, torchrun's agents and workers — nothing outside them is touched), then the
namespaces are deleted, which deletes the veth pair with them. A namespace name carries the PID of the test
process that made it, so namespaces left by a run that was itself SIGKILLed (no clean-up could run) are
removed by the next run (:func:`sweep_stale`).

Also the rank-side helper :func:`run_and_save` for ``torchrun ... -m course_lib.launch netns:run_and_save``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

PREFIX = "coursenet"
_skip: list = []


def _sh(*cmd, check=True, timeout=60, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, capture_output=True, text=True, check=check, timeout=timeout, env=env
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def skip_reason() -> str | None:
    """Why two namespaces cannot be made here (``None``: they can). Probed once per process."""
    if not _skip:
        reason = None
        if not sys.platform.startswith("linux"):
            reason = "network namespaces are Linux-only"
        elif os.geteuid() != 0:
            reason = (
                "network namespaces need root (ip netns add); run as root, e.g. in CI's container"
            )
        elif shutil.which("ip") is None:
            reason = "iproute2's `ip` is not installed (apt-get install iproute2)"
        else:
            probe = f"{PREFIX}-{os.getpid()}-probe"
            proc = _sh("ip", "netns", "add", probe, check=False)
            if proc.returncode != 0:
                reason = f"cannot create a network namespace here: {proc.stderr.strip()}"
            _sh("ip", "netns", "del", probe, check=False)
        _skip.append(reason)
    return _skip[0]


def _namespaces() -> list[str]:
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def kill_namespace(ns: str, rounds: int = 5) -> None:
    """SIGKILL every process in namespace ``ns``, until none is left (a dying parent may have started one)."""
    for _ in range(rounds):
        pids = [
            int(p)
            for p in _sh("ip", "netns", "pids", ns, check=False).stdout.split()
            if p.isdigit()
        ]
        pids = [p for p in pids if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.3)


def sweep_stale() -> list[str]:
    """Remove this course's namespaces whose creating test process is gone (a SIGKILLed run); return them."""
    removed = []
    for ns in _namespaces():
        m = re.fullmatch(rf"{PREFIX}-(\d+)-\w+", ns)
        if m and not _alive(int(m[1])):
            kill_namespace(ns)
            _sh("ip", "netns", "del", ns, check=False)
            removed.append(ns)
    return removed


class TwoHosts:
    """Two network namespaces ("hosts") with addresses ``10.<net>.0.1`` and ``10.<net>.0.2`` on a veth pair."""

    def __init__(self, tag: str, net: int = 77):
        if not re.fullmatch(r"[a-z0-9]{1,4}", tag):
            raise ValueError(
                f"tag must be 1-4 lowercase letters/digits (it goes into interface names), got {tag!r}"
            )
        uid = uuid.uuid4().hex[:4]
        self.names = tuple(f"{PREFIX}-{os.getpid()}-{tag}{uid}{i}" for i in range(2))
        self.veths = tuple(f"cn{tag}{uid}{i}" for i in range(2))  # ≤ 15 characters (IFNAMSIZ)
        self.ips = tuple(f"10.{net}.0.{i + 1}" for i in range(2))
        self._made: list[str] = []

    def __enter__(self) -> TwoHosts:
        sweep_stale()
        try:
            for ns in self.names:
                _sh("ip", "netns", "add", ns)
                self._made.append(ns)
            _sh("ip", "link", "add", self.veths[0], "type", "veth", "peer", "name", self.veths[1])
            for ns, veth, ip in zip(self.names, self.veths, self.ips, strict=True):
                _sh("ip", "link", "set", veth, "netns", ns)
                _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", veth)
                _sh("ip", "netns", "exec", ns, "ip", "link", "set", veth, "up")
                _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            if shutil.which("ping"):
                self.run(
                    0, "ping", "-c", "1", "-W", "5", self.ips[1]
                )  # the link works before anything uses it
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def env(self, i: int, **extra) -> dict:
        """The environment for a process on host ``i``: gloo bound to its veth (not 127.0.0.1)."""
        return {**os.environ, "GLOO_SOCKET_IFNAME": self.veths[i], **extra}

    def run(self, i: int, *cmd, env=None, timeout=180, check=True) -> subprocess.CompletedProcess:
        return _sh(
            "ip", "netns", "exec", self.names[i], *cmd, check=check, timeout=timeout, env=env
        )

    def popen(self, i: int, cmd: list, env=None, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.names[i], *cmd], env=env, **kwargs)

    def kill(self, i: int) -> None:
        kill_namespace(self.names[i])

    def close(self) -> None:
        """Kill every process in both namespaces, then delete them (and the veth pair with them)."""
        for ns in self._made:
            kill_namespace(ns)
        for ns in self._made:
            _sh("ip", "netns", "del", ns, check=False)
        leftover = [ns for ns in self._made if ns in _namespaces()]
        self._made = []
        _sh(
            "ip", "link", "del", self.veths[0], check=False
        )  # a veth not yet moved into a namespace
        if leftover:
            raise RuntimeError(f"could not delete network namespaces {leftover}")


# --------------------------------------------------------------------------- rank side (under torchrun)


def run_and_save(out_dir: str, targets: list) -> str:
    """Rank function: run each ``(module:function, args)`` of ``targets`` in turn; save the results to a file.

    ``course_lib.launch`` prints only each rank's ``repr``; tensors need their exact values, so every rank
    writes ``rank<r>.pt`` (both "hosts" share this machine's disk) and returns its path.
    """
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(
        1
    )  # like spawn's ranks: the same float summation order as the single-node run
    results = []
    for target, args in targets:
        mod, _, name = target.partition(":")
        results.append(getattr(importlib.import_module(mod), name)(*args))
    where = {
        "node_rank": int(os.environ["GROUP_RANK"]),
        "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
        "master_addr": os.environ["MASTER_ADDR"],
        "netns": os.stat("/proc/self/ns/net").st_ino,
    }
    path = os.path.join(out_dir, f"rank{dist.get_rank()}.pt")
    torch.save({"where": where, "results": results}, path)
    return path
