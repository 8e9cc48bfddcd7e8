"""comm: the collectives give the right numbers on real ranks; CommLog and CollectiveCounter count bytes exactly.

One spawn per world size runs every case (``_suite``); each case is run under its own
``try`` on the ranks, so a failing case fails only the tests that read it, with its own traceback.
"""

import traceback

import pytest
import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.experiments import collectives
from course_lib.launch import RankError, device, spawn
from course_lib.results import REORDERED


def _collectives():
    r, n, dev = dist.get_rank(), dist.get_world_size(), device()
    out = {}
    x = torch.arange(4 * n, dtype=torch.float32, device=dev) + 100 * r
    with comm.CommLog() as log:
        a = x.clone()
        comm.all_reduce(a, tag="grad")
        rs = torch.empty(4, device=dev)
        comm.reduce_scatter(rs, x.clone(), tag="grad")
        ag = torch.empty(4 * n, device=dev)
        comm.all_gather(ag, rs, tag="param")
        b = torch.full((3,), float(r), dtype=torch.bfloat16, device=dev)
        comm.broadcast(b, src=n - 1)
        nxt, prv = (r + 1) % n, (r - 1) % n
        got = torch.empty(2, device=dev)
        req = comm.isend(torch.full((2,), float(r), device=dev), nxt, tag="act")
        comm.recv(got, prv, tag="act")
        req.wait()
        got2 = torch.empty(2, device=dev)
        req = comm.irecv(got2, prv, tag="grad-act")
        comm.send(torch.full((2,), 10.0 + r, device=dev), nxt, tag="grad-act")
        req.wait()
    out.update(
        all_reduce=a, reduce_scatter=rs, all_gather=ag, broadcast=b, ring=got, ring2=got2, x=x
    )
    out = {k: v.cpu() for k, v in out.items()}
    out.update(records=log.as_dicts(), summary=log.summary())
    return out


def _subgroup():
    """CommLog on a ``new_group([0, 1])`` (ranks 0, 1 only) and on the dimensions of a 2×2 mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    r, dev = dist.get_rank(), device()
    pair = dist.new_group([0, 1])
    mesh = init_device_mesh(dev.type, (2, 2), mesh_dim_names=("dp", "tp"))
    t = torch.ones(8, device=dev)
    with comm.CommLog() as log:
        if r in (0, 1):
            comm.all_reduce(t, group=pair, tag="pair")
        comm.all_reduce(torch.ones(8, device=dev), group=mesh.get_group("tp"), tag="tp")
        comm.all_reduce(torch.ones(8, device=dev), tag="world")
    return {
        "records": log.as_dicts(),
        "pair_name": pair.group_name if r in (0, 1) else None,
        "pair_sum": t.cpu(),
    }


def _counter():
    """CollectiveCounter on torch's own calls: default group, a mesh dimension, a functional collective."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    n, dev = dist.get_world_size(), device()
    mesh = init_device_mesh(dev.type, (2, n // 2), mesh_dim_names=("dp", "tp"))
    with comm.CollectiveCounter(tag="default") as cc:
        dist.all_gather_into_tensor(torch.empty(6 * n, device=dev), torch.ones(6, device=dev))
        cc.tag = "dp"
        dist.all_gather_into_tensor(
            torch.empty(12, device=dev), torch.ones(6, device=dev), group=mesh.get_group("dp")
        )
        cc.tag = "funcol"
        funcol.all_gather_tensor(
            torch.ones(5, dtype=torch.bfloat16, device=dev), 0, mesh.get_group("tp")
        ).wait()
    return {
        "records": cc.as_dicts(),
        "count": cc.count(op="all_gather"),
        "count_dp": cc.count(op="all_gather", tag="dp"),
        "total_default": cc.total(op="all_gather", tag="default"),
        "ring_default": cc.total("ring_bytes", tag="default"),
        "debug_counts": {str(k): v for k, v in cc.get_comm_counts().items()},
    }


CASES = {
    2: {"collectives": _collectives},
    4: {"collectives": _collectives, "subgroup": _subgroup, "counter": _counter},
}


def _suite():
    """Rank function: every case for this world size; a case's exception is returned, not raised."""
    out = {}
    for name, fn in CASES[dist.get_world_size()].items():
        try:
            out[name] = {"ok": fn()}
        except Exception:  # noqa: BLE001 - reported by the tests that read this case
            out[name] = {"error": traceback.format_exc()}
        dist.barrier()
    return out


_RESULTS: dict[int, list] = {}


def case(world: int, name: str) -> list:
    """Every rank's result of case ``name`` at ``world`` ranks (one spawn per world size, cached)."""
    if world not in _RESULTS:
        _RESULTS[world] = spawn(_suite, world, timeout=120)
    ranks = [r[name] for r in _RESULTS[world]]
    errors = [f"rank {i}:\n{r['error']}" for i, r in enumerate(ranks) if "error" in r]
    if errors:
        pytest.fail(
            f"case {name!r} at world {world} raised on the ranks:\n" + "\n".join(errors),
            pytrace=False,
        )
    return [r["ok"] for r in ranks]


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_and_byte_counts(world):
    res = case(world, "collectives")
    xs = [r["x"] for r in res]
    total = sum(xs)
    for r, out in enumerate(res):
        assert torch.equal(out["all_reduce"], total)
        assert torch.equal(out["reduce_scatter"], total[4 * r : 4 * r + 4])
        assert torch.equal(out["all_gather"], total), "all-reduce = reduce-scatter + all-gather"
        assert torch.equal(
            out["broadcast"], torch.full((3,), float(world - 1), dtype=torch.bfloat16)
        )
        assert out["ring"].tolist() == [float((r - 1) % world)] * 2
        assert out["ring2"].tolist() == [10.0 + (r - 1) % world] * 2
        rec = {(d["op"], d["tag"]): d for d in out["records"]}
        full = 4 * world * 4  # bytes of the full fp32 tensor
        f = (world - 1) / world
        assert rec[("all_reduce", "grad")]["tensor_bytes"] == full
        REORDERED.assert_close(rec[("all_reduce", "grad")]["ring_bytes"], full * 2 * f)
        assert rec[("reduce_scatter", "grad")]["tensor_bytes"] == full
        REORDERED.assert_close(rec[("reduce_scatter", "grad")]["ring_bytes"], full * f)
        assert rec[("all_gather", "param")]["tensor_bytes"] == full
        REORDERED.assert_close(rec[("all_gather", "param")]["ring_bytes"], full * f)
        assert (
            rec[("broadcast", None)]["dtype"] == "bfloat16"
            and rec[("broadcast", None)]["tensor_bytes"] == 6
        )
        assert {(d["group"], d["world_size"]) for d in out["records"]} == {("default", world)}
        grad = next(s for s in out["summary"] if s["op"] == "reduce_scatter")
        assert grad["calls"] == 1 and grad["group"] == "default"


@pytest.mark.parametrize("world", [2, 4])
def test_commlog_counts_point_to_point_sends_and_receives(world):
    for out in case(world, "collectives"):
        p2p = [
            (d["op"], d["tag"], d["tensor_bytes"], d["ring_bytes"])
            for d in out["records"]
            if d["op"] in ("send", "recv")
        ]
        # isend + recv (tag "act"), then irecv + send (tag "grad-act"): 8 bytes each; a send sends, a recv does not
        assert p2p == [
            ("send", "act", 8, 8.0),
            ("recv", "act", 8, 0.0),
            ("recv", "grad-act", 8, 0.0),
            ("send", "grad-act", 8, 8.0),
        ]


def test_ring_bytes_use_the_size_of_the_subgroup_the_call_ran_on():
    res = case(4, "subgroup")
    for r, out in enumerate(res):
        rec = {d["tag"]: d for d in out["records"]}
        if r in (0, 1):
            assert out["pair_sum"].tolist() == [2.0] * 8
            pair = rec["pair"]
            assert (pair["world_size"], pair["group"]) == (2, out["pair_name"])
            assert pair["ring_bytes"] == 32 * 2 * (2 - 1) / 2  # 2(N−1)/N with N = 2, not 4
        else:
            assert "pair" not in rec
        assert (rec["tp"]["world_size"], rec["tp"]["group"], rec["tp"]["ring_bytes"]) == (
            2,
            "tp",
            32.0,
        )
        assert (rec["world"]["world_size"], rec["world"]["group"]) == (4, "default")
        assert rec["world"]["ring_bytes"] == 32 * 2 * 3 / 4


def test_collective_counter_counts_and_sizes_all_gather_into_tensor_and_records_its_group():
    for out in case(4, "counter"):
        by_tag = {}
        for d in out["records"]:
            by_tag.setdefault(d["tag"], []).append(d)
        (default,) = by_tag["default"]
        assert (default["op"], default["dtype"], default["numel"]) == ("all_gather", "float32", 24)
        assert (default["tensor_bytes"], default["group"], default["world_size"]) == (
            96,
            "default",
            4,
        )
        assert default["ring_bytes"] == 96 * 3 / 4
        (dp,) = by_tag["dp"]
        assert (dp["op"], dp["tensor_bytes"], dp["group"], dp["world_size"], dp["ring_bytes"]) == (
            "all_gather",
            48,
            "dp",
            2,
            24.0,
        )
        # a functional collective names its group by string: resolved, and sized by its output
        (fc,) = by_tag["funcol"]
        assert (fc["op"], fc["dtype"], fc["tensor_bytes"], fc["group"], fc["world_size"]) == (
            "all_gather",
            "bfloat16",
            20,
            "tp",
            2,
        )
        assert out["count"] == 3 and out["count_dp"] == 1
        assert out["total_default"] == 96 and out["ring_default"] == 72.0
        assert out["debug_counts"]["c10d._allgather_base_"] == 2


def _bad_reduce_scatter():
    comm.reduce_scatter(
        torch.empty(3, device=device()), torch.empty(4 * dist.get_world_size(), device=device())
    )


def test_size_mismatch_is_a_clear_error():
    with pytest.raises(
        RankError, match=r"reduce_scatter: input has 8 elements, expected world_size=2 × output's 3"
    ):
        spawn(_bad_reduce_scatter, 2)


def test_ring_factors():
    assert comm.ring_factor("all_reduce", 4) == 1.5
    assert comm.ring_factor("all_gather", 4) == 0.75
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        comm.ring_factor("allreduce", 4)


def test_bandwidth_benchmark_rows():
    rows = spawn(
        collectives.bandwidth_benchmark,
        2,
        kwargs=dict(
            sizes_bytes=(4096, 65536),
            ops=("all_reduce", "all_gather", "send_recv"),
            iters=3,
            repeats=5,
        ),
    )[0]
    assert [(r["op"], r["bytes"]) for r in rows] == [
        ("all_reduce", 4096),
        ("all_reduce", 65536),
        ("all_gather", 4096),
        ("all_gather", 65536),
        ("send_recv", 4096),
        ("send_recv", 65536),
    ]
    for r in rows:  # time_s is the median of 5 repeats, with their min and max as the spread
        assert (
            len(r["times_s"]) == 5
            and r["time_lo_s"] <= r["time_s"] <= r["time_hi_s"]
            and r["time_s"] > 0
        )
        factor = (
            1.0 if r["op"] == "send_recv" else comm.ring_factor(r["op"], 2)
        )  # point-to-point: sent once
        REORDERED.assert_close(r["busbw_GBps"], r["algbw_GBps"] * factor)
    with pytest.raises(RankError, match="unsupported op 'gather'"):
        spawn(collectives.bandwidth_benchmark, 2, kwargs=dict(ops=("gather",)))
    assert "busbw GB/s" in collectives.busbw_table(rows)
