"""The launcher: real ranks, rank-ordered results, errors and hangs surface fast, nothing left behind."""

import os
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from course_lib.launch import RankError, RankTimeout, device, hello, resolve_backend, spawn


def _children():
    return [
        p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE
    ]


@pytest.fixture(autouse=True)
def no_orphans():
    yield
    assert _children() == [], "a rank process outlived spawn()"


def _expected_device(rank: int, world: int) -> str:
    """What ``device()`` says under ``backend="auto"``: cpu with gloo, the rank's GPU with nccl."""
    return f"cuda:{rank}" if resolve_backend("auto", world) == "nccl" else "cpu"


def _rank_sum():
    t = torch.tensor([dist.get_rank() + 1.0], device=device())
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), str(device())


@pytest.mark.parametrize("world", [1, 2, 4])
def test_spawn_returns_results_in_rank_order(world):
    out = spawn(_rank_sum, world)
    assert [o[0] for o in out] == list(range(world))
    assert all(o[1] == world and o[2] == world * (world + 1) / 2 for o in out)
    assert [o[3] for o in out] == [_expected_device(rank, world) for rank in range(world)]


def test_function_and_closure_sent_by_value():
    scale = torch.arange(3.0)
    fn = lambda k: (scale * k * (dist.get_rank() + 1)).sum().item()  # noqa: E731 - by-value on purpose
    assert spawn(fn, 2, args=(2,)) == [6.0, 12.0]


def test_tensor_results_survive_rank_exit():
    out = spawn(lambda: torch.full((1000,), float(dist.get_rank())), 2)
    assert torch.equal(out[1], torch.ones(1000))


def _raise_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure")
    dist.barrier()  # rank 0 would wait here forever without the launcher
    return "unreachable"


def test_raising_rank_names_rank_and_remote_traceback_within_seconds():
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 raised ValueError: deliberate failure") as info:
        spawn(_raise_on_rank_1, 2, timeout=60)
    assert time.monotonic() - t0 < 15
    assert info.value.rank == 1 and "_raise_on_rank_1" in info.value.remote_traceback
    assert isinstance(info.value.__cause__, ValueError)


def _hang_on_rank_0():
    if dist.get_rank() == 0:
        time.sleep(600)
    return dist.get_rank()


def test_hanging_rank_ends_at_timeout():
    t0 = time.monotonic()
    with pytest.raises(RankTimeout, match=r"did not finish within timeout=4s") as info:
        spawn(_hang_on_rank_0, 2, timeout=4)
    assert 4 <= time.monotonic() - t0 < 15
    assert 0 in info.value.ranks


def test_rank_that_dies_without_exception():
    def die():
        if dist.get_rank() == 1:
            os._exit(7)
        dist.barrier()

    with pytest.raises(RankError, match=r"rank 1 raised ProcessDied: exit code 7"):
        spawn(die, 2, timeout=60)


def test_rank_output_never_reaches_parent(capfd):
    def noisy():
        print("from a rank")
        return 1

    assert spawn(noisy, 2) == [1, 1]
    out, err = capfd.readouterr()
    assert "from a rank" not in out + err


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_bad_world_size(bad):
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        spawn(_rank_sum, bad)


def test_unsendable_argument():
    with pytest.raises(TypeError, match="cannot be sent to a rank"):
        spawn(_rank_sum, 2, args=(threading.Lock(),))


@pytest.mark.skipif(torch.cuda.device_count() >= 64, reason="needs fewer GPUs than ranks")
def test_nccl_without_enough_gpus():
    with pytest.raises(ValueError, match="needs one GPU per rank"):
        spawn(_rank_sum, 64, backend="nccl")


def test_backend_resolution():
    assert resolve_backend("gloo", 2) == "gloo"
    expected = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    assert resolve_backend("auto", 2) == expected
    with pytest.raises(ValueError, match="backend='mpi' is not one of"):
        resolve_backend("mpi", 2)


def test_same_function_runs_under_torchrun():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "course_lib.launch",
            "course_lib.launch:hello",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    backend = resolve_backend("auto", 2)  # torchrun's --nproc-per-node 2 on this machine
    assert (
        f"rank 1: {{'rank': 1, 'world_size': 2, 'backend': '{backend}', 'device': '{_expected_device(1, 2)}', "
        "'sum_of_ranks': 1}"
    ) in proc.stdout


def test_hello_via_spawn():
    assert [h["sum_of_ranks"] for h in spawn(hello, 2)] == [1, 1]
