"""Chapter 07, scaling out for real: a two-node Ray cluster on one machine, one Train worker per node.

Two Linux network namespaces ("hosts" with their own addresses) joined by a veth pair; ``ray start --head``
in one, ``ray start --address=<head>`` in the other, each with ``GLOO_SOCKET_IFNAME`` set to its veth (gloo
otherwise connects to 127.0.0.1 and fails between namespaces). A driver inside the head namespace runs a
``TorchTrainer`` with ``placement_strategy="STRICT_SPREAD"``. Needs root (``ip netns``); skips with the reason
otherwise. Every process is ended by PID (``ip netns pids``): nothing else on the machine is touched.

Opt-in (``make test-multinode``, which sets ``COURSE_MULTINODE=1``): it changes the machine's network set-up
(namespaces, a veth pair) and takes minutes, so ``make test`` and CI skip it.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

pytest.importorskip("ray")

TAG = uuid.uuid4().hex[:4]
HOSTS = {"head": (f"c7h{TAG}", f"c7vh{TAG}", "10.77.7.1"), "worker": (f"c7w{TAG}", f"c7vw{TAG}", "10.77.7.2")}
RAY = os.path.join(os.path.dirname(sys.executable), "ray")

DRIVER = textwrap.dedent("""
    import json, sys
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from course_lib.experiments import ch07_ray_train as ex

    ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
    result = TorchTrainer(
        ex.rank_function_loop, train_loop_config={"fn": ex.node_and_equality, "args": (3,)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, placement_strategy="STRICT_SPREAD"),
        run_config=RunConfig(name="multinode", storage_path=sys.argv[2]),
    ).fit()
    print("RESULT " + json.dumps(ex.rank_results(result, 2)))
""")


def _sh(*cmd, check=True, timeout=180, env=None):
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=timeout, env=env)


def _ray_start(ns, *args, env):
    """``ray start`` inside a namespace; one retry: on a busy machine Ray's agents can miss the raylet's fixed
    start-up wait (ray-project/ray#65983) and the node 'timed out during startup'."""
    for _attempt in range(2):
        proc = _sh("ip", "netns", "exec", ns, RAY, "start", *args, check=False, env=env)
        if proc.returncode == 0:
            return
        _kill_namespace(ns)
        time.sleep(1)
    raise RuntimeError(f"ray start in {ns} failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")


def _kill_namespace(ns):
    out = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in out:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


@pytest.fixture(scope="module")
def two_hosts():
    if os.environ.get("COURSE_MULTINODE") != "1":
        pytest.skip("opt-in: run `make test-multinode` (COURSE_MULTINODE=1)")
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (ip netns)")
    (hns, hveth, hip), (wns, wveth, wip) = HOSTS["head"], HOSTS["worker"]
    try:
        _sh("ip", "netns", "add", hns)
    except (subprocess.CalledProcessError, OSError) as err:
        pytest.skip(f"cannot create a network namespace here: {getattr(err, 'stderr', err)}")
    base = tempfile.mkdtemp(prefix="c7", dir="/tmp")   # short: Ray's socket paths must stay < 108 bytes
    try:
        _sh("ip", "netns", "add", wns)
        _sh("ip", "link", "add", hveth, "type", "veth", "peer", "name", wveth)
        for ns, veth, ip in ((hns, hveth, hip), (wns, wveth, wip)):
            _sh("ip", "link", "set", veth, "netns", ns)
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", veth)
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", veth, "up")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        common = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="0",
                      RAY_TRAIN_V2_ENABLED="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                      PYTHONPATH=os.getcwd())
        _ray_start(hns, "--head", f"--node-ip-address={hip}", "--port=6379",
            "--num-cpus=1", f"--temp-dir={base}/h", "--include-dashboard=false", "--disable-usage-stats",
            env=dict(common, GLOO_SOCKET_IFNAME=hveth))
        _ray_start(wns, f"--address={hip}:6379", f"--node-ip-address={wip}",
            "--num-cpus=1", f"--temp-dir={base}/w", "--disable-usage-stats",
            env=dict(common, GLOO_SOCKET_IFNAME=wveth))
        yield {"head": hns, "address": f"{hip}:6379", "env": dict(common, GLOO_SOCKET_IFNAME=hveth), "base": base,
               "ips": (hip, wip)}
    finally:
        for ns in (wns, hns):
            _kill_namespace(ns)
        time.sleep(0.5)
        for ns in (wns, hns):
            _sh("ip", "netns", "del", ns, check=False)   # deletes the veth pair with it
        shutil.rmtree(base, ignore_errors=True)


def test_torch_trainer_places_one_worker_on_each_of_two_nodes(two_hosts):
    driver = os.path.join(two_hosts["base"], "driver.py")
    with open(driver, "w") as f:
        f.write(DRIVER)
    storage = os.path.join(two_hosts["base"], "runs")   # one disk here; on a real cluster: NFS or S3
    proc = _sh("ip", "netns", "exec", two_hosts["head"], sys.executable, driver, two_hosts["address"], storage,
               check=False, timeout=400, env=two_hosts["env"])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    per_rank = json.loads(lines[-1][len("RESULT "):])
    assert sorted(r["node"] for r in per_rank) == sorted(two_hosts["ips"]), per_rank
    assert all(r["ok"] for r in per_rank), f"DDP across the two nodes equals one device: {per_rank}"
