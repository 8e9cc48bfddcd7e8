"""Chapter 08, scaling out for real: a two-node Ray cluster on one machine, one Train worker per node.

Two "hosts" with their own addresses — Linux network namespaces joined by a veth pair (``tests/netns.py``);
``ray start --head`` in one, ``ray start --address=<head>`` in the other, each with ``GLOO_SOCKET_IFNAME`` set
to its veth (gloo otherwise connects to 127.0.0.1 and fails between namespaces). A driver inside the head
namespace runs a ``TorchTrainer`` with ``placement_strategy="STRICT_SPREAD"``; each worker returns its node's
IP and chapter 02's DDP equality through the checkpoint (``Result.metrics`` is None without one).

Part of ``make test`` where namespaces can be made (root + iproute2: CI's container); skips with the reason
elsewhere. ``make test-multinode`` runs just the multi-node tests. Clean-up, pass or fail: every process in
the two namespaces (Ray's daemons, the driver) is killed by PID, the namespaces and the veth pair are deleted,
the Ray temp dirs removed.
"""

import json
import os
import shutil
import sys
import tempfile
import textwrap
import time

import pytest

import netns

pytest.importorskip("ray")

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_V2_ENABLED": "1",
    "OMP_NUM_THREADS": "1",
    "PYTHONWARNINGS": "ignore",
    "PYTHONPATH": ROOT,
}

DRIVER = textwrap.dedent("""
    import json, sys
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from course_lib.experiments import ray_train as ex

    ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
    result = TorchTrainer(
        ex.rank_function_loop, train_loop_config={"fn": ex.node_and_equality, "args": (3,)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, placement_strategy="STRICT_SPREAD"),
        run_config=RunConfig(name="multinode", storage_path=sys.argv[2]),
    ).fit()
    print("RESULT " + json.dumps(ex.rank_results(result, 2)))
""")


def _ray_start(hosts, i, *args):
    """``ray start`` on host ``i``; one retry: on a busy machine Ray's agents can miss the raylet's fixed
    start-up wait (ray-project/ray#65983) and the node 'timed out during startup'."""
    for _attempt in range(2):
        proc = hosts.run(i, RAY, "start", *args, check=False, env=hosts.env(i, **RAY_ENV))
        if proc.returncode == 0:
            return
        hosts.kill(i)
        time.sleep(1)
    raise RuntimeError(
        f"ray start on host {i} failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}"
    )


@pytest.fixture(scope="module")
def two_node_ray():
    reason = netns.skip_reason()
    if reason:
        pytest.skip(reason)
    base = tempfile.mkdtemp(
        prefix="c7", dir="/tmp"
    )  # short: Ray's socket paths must stay < 108 bytes
    try:
        with netns.TwoHosts("ray", net=77) as hosts:
            head, worker = hosts.ips
            t0 = time.perf_counter()
            _ray_start(
                hosts,
                0,
                "--head",
                f"--node-ip-address={head}",
                "--port=6379",
                "--num-cpus=1",
                f"--temp-dir={base}/h",
                "--include-dashboard=false",
                "--disable-usage-stats",
            )
            _ray_start(
                hosts,
                1,
                f"--address={head}:6379",
                f"--node-ip-address={worker}",
                "--num-cpus=1",
                f"--temp-dir={base}/w",
                "--disable-usage-stats",
            )
            print(f"two Ray nodes started in {time.perf_counter() - t0:.1f} s")
            yield {"hosts": hosts, "address": f"{head}:6379", "base": base}
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.timeout(600)
def test_torch_trainer_places_one_worker_on_each_of_two_nodes(two_node_ray):
    hosts, base = two_node_ray["hosts"], two_node_ray["base"]
    driver = os.path.join(base, "driver.py")
    with open(driver, "w") as f:
        f.write(DRIVER)
    storage = os.path.join(base, "runs")  # one disk here; on a real cluster: NFS or S3
    t0 = time.perf_counter()
    proc = hosts.run(
        0,
        sys.executable,
        driver,
        two_node_ray["address"],
        storage,
        check=False,
        timeout=400,
        env=hosts.env(0, **RAY_ENV),
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    per_rank = json.loads(lines[-1][len("RESULT ") :])
    assert sorted(r["node"] for r in per_rank) == sorted(hosts.ips), per_rank
    assert all(r["ok"] for r in per_rank), f"DDP across the two nodes equals one device: {per_rank}"
    print(f"TorchTrainer across two nodes: {time.perf_counter() - t0:.1f} s")
