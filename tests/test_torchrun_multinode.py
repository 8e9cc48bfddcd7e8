"""Multi-node torchrun: chapter 02's DDP and chapter 04's FSDP2 rank functions across two hosts.

The proof that the course's rank functions are not tied to one machine: ``torchrun --nnodes=2
--nproc-per-node=1`` on two "hosts" — network namespaces with their own addresses, joined by a veth pair
(``tests/netns.py``) — with the c10d rendezvous on the first, runs ``course_lib.launch`` exactly as on a real
cluster; the results equal the single-node run (``spawn``, 2 ranks on one host). Inside a namespace the
hostname resolves to 127.0.0.1, so three settings are needed (README, "Multi-node"):

* ``--rdzv-conf is_host=1`` on node 0: the c10d agent decides whether it hosts the rendezvous store by
  matching the endpoint's address against its hostname's, which here is 127.0.0.1;
* ``--local-addr <the node's ip>`` on each node: the address an agent advertises (node 0's becomes the
  workers' ``MASTER_ADDR``), instead of the hostname's;
* ``GLOO_SOCKET_IFNAME=<the node's veth>``: gloo's ranks connect over that interface, not 127.0.0.1.

Needs root (``ip netns``); skips with the reason elsewhere. Every process is ended by PID and the namespaces
are deleted, pass or fail.
"""

import os
import subprocess
import sys
import time
import uuid

import pytest
import torch

import netns
from course_lib.results import (
    REORDERED,
)  # the same computation on the same 2 ranks: float order at most

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
PORT = 29400
DDP = ("course_lib.experiments.ddp:equality_with_single_device", ("own_bucketed", "adamw", 3))
FSDP = ("course_lib.experiments.fsdp:fsdp2_vs_single_device", (3, "adamw"))


def torchrun_command(node_rank: int, hosts, rdzv_id: str, out_dir: str) -> list[str]:
    """The command run on each host (the README's multi-node settings)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={hosts.ips[0]}:{PORT}",
        f"--rdzv-id={rdzv_id}",
        "--local-addr",
        hosts.ips[node_rank],
    ]
    if node_rank == 0:
        cmd += ["--rdzv-conf", "is_host=1"]
    return cmd + [
        "-m",
        "course_lib.launch",
        "netns:run_and_save",
        "--backend",
        "gloo",
        "--arg",
        repr(out_dir),
        "--arg",
        repr([DDP, FSDP]),
    ]


@pytest.fixture(scope="module")
def two_hosts():
    reason = netns.skip_reason()
    if reason:
        pytest.skip(reason)
    with netns.TwoHosts("tr", net=78) as hosts:
        yield hosts


def test_ddp_and_fsdp2_under_torchrun_on_two_nodes_equal_the_single_node_run(two_hosts, tmp_path):
    from course_lib.experiments.ddp import equality_with_single_device
    from course_lib.experiments.fsdp import fsdp2_vs_single_device
    from course_lib.launch import spawn

    out_dir = str(tmp_path)
    env = {
        "PYTHONPATH": os.pathsep.join([ROOT, TESTS]),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    rdzv_id = uuid.uuid4().hex[:8]
    t0 = time.perf_counter()
    procs = [
        two_hosts.popen(
            i,
            torchrun_command(i, two_hosts, rdzv_id, out_dir),
            env=two_hosts.env(i, **env),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (1, 0)
    ]
    try:
        outs = [p.communicate(timeout=400) for p in procs]
    except subprocess.TimeoutExpired:
        for i in range(2):
            two_hosts.kill(i)
        outs = [p.communicate() for p in procs]
        pytest.fail(
            f"torchrun on two nodes did not finish in 400 s:\n{outs[1][1][-3000:]}\n{outs[0][1][-3000:]}"
        )
    multi_s = time.perf_counter() - t0
    for (_out, err), p, node in zip(outs, procs, (1, 0), strict=True):
        assert p.returncode == 0, f"node {node}: torchrun exited {p.returncode}\n{err[-3000:]}"
    assert "rank 0:" in outs[1][0] and "rank 1:" in outs[1][0], outs[1][
        0
    ]  # node 0 holds global rank 0
    per_rank = [
        torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(2)
    ]

    where = [d["where"] for d in per_rank]
    assert [w["node_rank"] for w in where] == [0, 1] and all(
        w["local_world_size"] == 1 for w in where
    ), where
    assert where[0]["netns"] != where[1]["netns"], (
        "the two ranks ran in different network namespaces"
    )
    assert all(w["master_addr"] == two_hosts.ips[0] for w in where), where

    ddp_single = spawn(equality_with_single_device, 2, args=DDP[1], backend="gloo")
    fsdp_single = spawn(fsdp2_vs_single_device, 2, args=FSDP[1], backend="gloo")
    for r in range(2):
        ddp, fsdp = per_rank[r]["results"]
        assert all(ddp.claims().values()), ddp
        REORDERED.assert_close(
            ddp.max_abs_diff, ddp_single[r].max_abs_diff, "DDP max|Δ| vs one device"
        )
        assert fsdp["allclose_1e-5"], fsdp[
            "max_abs_diff"
        ]  # the FSDP2 experiment's own verdict vs one device
        REORDERED.assert_close(
            fsdp["full_state"], fsdp_single[r]["full_state"], "FSDP2 final state"
        )
        REORDERED.assert_close(fsdp["losses"], fsdp_single[r]["losses"], "FSDP2 losses")
    print(f"two-node torchrun (DDP + FSDP2, 3 AdamW steps each): {multi_s:.1f} s")
