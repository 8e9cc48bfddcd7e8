"""comm: every collective gives the right numbers on real ranks, and CommLog counts the bytes exactly."""
import pytest
import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.launch import RankError, spawn


def _collectives():
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    x = torch.arange(4 * n, dtype=torch.float32) + 100 * r
    with comm.CommLog() as log:
        a = x.clone()
        comm.all_reduce(a, tag="grad")
        rs = torch.empty(4)
        comm.reduce_scatter(rs, x.clone(), tag="grad")
        ag = torch.empty(4 * n)
        comm.all_gather(ag, rs, tag="param")
        b = torch.full((3,), float(r), dtype=torch.bfloat16)
        comm.broadcast(b, src=n - 1)
        nxt, prv = (r + 1) % n, (r - 1) % n
        got = torch.empty(2)
        req = comm.isend(torch.full((2,), float(r)), nxt)
        comm.recv(got, prv)
        req.wait()
        got2 = torch.empty(2)
        req = comm.irecv(got2, prv)
        comm.send(torch.full((2,), 10.0 + r), nxt)
        req.wait()
    out.update(all_reduce=a, reduce_scatter=rs, all_gather=ag, broadcast=b, ring=got, ring2=got2,
               records=log.as_dicts(), summary=log.summary(), x=x)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_and_byte_counts(world):
    res = spawn(_collectives, world)
    xs = [r["x"] for r in res]
    total = sum(xs)
    for r, out in enumerate(res):
        assert torch.equal(out["all_reduce"], total)
        assert torch.equal(out["reduce_scatter"], total[4 * r: 4 * r + 4])
        assert torch.equal(out["all_gather"], total), "all-reduce = reduce-scatter + all-gather"
        assert torch.equal(out["broadcast"], torch.full((3,), float(world - 1), dtype=torch.bfloat16))
        assert out["ring"].tolist() == [float((r - 1) % world)] * 2
        assert out["ring2"].tolist() == [10.0 + (r - 1) % world] * 2
        rec = {(d["op"], d["tag"]): d for d in out["records"]}
        full = 4 * world * 4  # bytes of the full fp32 tensor
        f = (world - 1) / world
        assert rec[("all_reduce", "grad")]["tensor_bytes"] == full
        assert rec[("all_reduce", "grad")]["ring_bytes"] == pytest.approx(full * 2 * f)
        assert rec[("reduce_scatter", "grad")]["tensor_bytes"] == full
        assert rec[("reduce_scatter", "grad")]["ring_bytes"] == pytest.approx(full * f)
        assert rec[("all_gather", "param")]["tensor_bytes"] == full
        assert rec[("all_gather", "param")]["ring_bytes"] == pytest.approx(full * f)
        assert rec[("broadcast", None)]["dtype"] == "bfloat16" and rec[("broadcast", None)]["tensor_bytes"] == 6
        sends = [d for d in out["records"] if d["op"] == "send"]
        assert [d["tensor_bytes"] for d in sends] == [8, 8]
        grad = next(s for s in out["summary"] if s["op"] == "reduce_scatter")
        assert grad["calls"] == 1


def _bad_reduce_scatter():
    comm.reduce_scatter(torch.empty(3), torch.empty(4 * dist.get_world_size()))


def test_size_mismatch_is_a_clear_error():
    with pytest.raises(RankError, match=r"reduce_scatter: input has 8 elements, expected world_size=2 × output's 3"):
        spawn(_bad_reduce_scatter, 2)


def test_ring_factors():
    assert comm.ring_factor("all_reduce", 4) == 1.5
    assert comm.ring_factor("all_gather", 4) == 0.75
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        comm.ring_factor("allreduce", 4)


def test_bandwidth_benchmark_rows():
    rows = spawn(comm.bandwidth_benchmark, 2, kwargs=dict(sizes_bytes=(4096, 65536), ops=("all_reduce", "all_gather"),
                                                         iters=3))[0]
    assert [(r["op"], r["bytes"]) for r in rows] == [("all_reduce", 4096), ("all_reduce", 65536),
                                                     ("all_gather", 4096), ("all_gather", 65536)]
    for r in rows:
        assert r["time_s"] > 0
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * comm.ring_factor(r["op"], 2))
    assert "busbw GB/s" in comm.busbw_table(rows)
