"""course_lib.profiling: real profiler traces of real steps, read back, classified and drawn.

One single-process profile (module fixture) and one 2-rank spawn per DDP variant; nothing mocked.
"""

import json

import matplotlib
import pytest
import torch

from course_lib import profiling as P
from course_lib.clock import AcceleratorClock
from course_lib.configs import make_optimizer, small_config
from course_lib.launch import spawn
from course_lib.models import GPT
from course_lib.train import step_batch

matplotlib.use("Agg")

STEPS = 2


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """Two profiled steps (after one warm-up) of the small GPT under a fast modelled clock."""
    cfg = small_config()
    model = GPT(cfg)
    opt = make_optimizer("adamw", model.parameters())
    clock = AcceleratorClock(5e9)  # short sleeps: the trace holds the clock's ranges, cheaply
    clock.apply(model)
    x, y = step_batch(0, cfg, 8)
    path = tmp_path_factory.mktemp("traces") / "one_device.json"
    prof = P.profile_steps(lambda: P.marked_step(model, opt, x, y), steps=STEPS, trace_path=path)
    clock.remove()
    return prof, P.read_trace(prof.trace_path)


def test_profile_writes_a_chrome_trace_with_one_profiler_step_range_per_step(one_device):
    prof, events = one_device
    with open(prof.trace_path, encoding="utf-8") as f:
        data = json.load(f)
    assert any(e.get("ph") == "X" for e in data["traceEvents"])
    steps = sorted(e.name for e in events if e.name.startswith("ProfilerStep#"))
    assert len(steps) == STEPS
    assert len(prof.step_s_trace) == len(prof.step_s_wall) == STEPS
    assert prof.checks()[0].verdict, (
        prof
    )  # the ProfilerStep count row (the timing row is shown only)
    assert prof.top_ops and {"name", "calls", "self_cpu_ms"} <= set(prof.top_ops[0])
    text = str(prof)
    assert "top ops by self time" in text and prof.trace_file in text


def test_the_classification_finds_every_phase_and_the_clock(one_device):
    _, events = one_device
    kinds = {e.kind for e in events}
    assert {"forward", "backward", "optimizer", "clock sleep"} <= kinds, kinds
    assert {e.kind for e in events if e.name == "aten::mm"} <= {"forward", "backward"}
    assert any(e.kind == "backward" and e.name.endswith("Backward0") for e in events)
    sleeps = [e for e in events if e.kind == "clock sleep"]
    assert all(e.name.startswith(P.CLOCK_PREFIX) for e in sleeps)
    assert {e.phase for e in sleeps} == {"forward", "backward"}
    assert any(e.name.startswith("Optimizer.step#") for e in events if e.kind == "optimizer")


def test_classify_inherits_from_the_innermost_enclosing_range_and_overlap_adds_up():
    node = "autograd::engine::evaluate_function: "
    raw = [
        {"thread": "main", "name": "backward", "start": 0.0, "duration": 10.0},
        {"thread": "main", "name": f"{node}MmBackward0", "start": 1.0, "duration": 4.0},
        {"thread": "main", "name": "aten::mm", "start": 2.0, "duration": 1.0},
        {"thread": "main", "name": "clock: blocks.0 bwd", "start": 5.0, "duration": 3.0},
        {"thread": "main", "name": f"{node}torch::autograd::AccumulateGrad", "start": 8.0, "duration": 0.5},
        {"thread": "main", "name": "c10d::allreduce_", "start": 8.1, "duration": 0.2},  # a DDP hook launches
        {"thread": "main", "name": "aten::copy_", "start": 9.0, "duration": 0.8},  # end of backward: copy into .grad
        {"thread": "main", "name": "aten::add", "start": 12.0, "duration": 1.0},
        {"thread": "gloo", "name": "gloo:all_reduce", "start": 7.0, "duration": 4.0},
    ]  # fmt: skip
    ev = {e.name: e for e in P.classify(raw)}
    assert (ev["aten::mm"].kind, ev["aten::mm"].phase) == ("backward", "backward")
    assert (ev["clock: blocks.0 bwd"].kind, ev["clock: blocks.0 bwd"].phase) == (
        "clock sleep",
        "backward",
    )
    assert (ev["c10d::allreduce_"].kind, ev["c10d::allreduce_"].phase) == (
        "communication",
        "backward",
    )
    assert (ev["gloo:all_reduce"].kind, ev["gloo:all_reduce"].phase) == ("communication", "")
    assert ev["aten::add"].kind == "other"
    assert (ev["aten::copy_"].kind, ev["aten::copy_"].phase) == ("backward", "backward")
    # backward computes 1–8.5 (the nodes, the sleep) less the hook's enqueueing call 8.1–8.3; not
    # the mark (0–10), nor the copy under it after the last node (9–9.8: DDP's end of backward)
    assert [t for span in P.computing(list(ev.values())) for t in span] == pytest.approx(
        [1.0, 8.1, 8.3, 8.5]
    )
    # so the gloo range 7–11 runs beside backward's compute for 1.1 + 0.2 s
    assert P.overlap(list(ev.values())) == pytest.approx(1.3)
    assert P.overlap(list(ev.values()), ranges=[ev["gloo:all_reduce"]]) == pytest.approx(1.3)
    # the enqueueing c10d call sits on the training thread (it holds the "backward" mark): not counted
    assert P.training_threads(list(ev.values())) == {"main"}
    assert P.busy(list(ev.values())) == pytest.approx(4.0)


def test_draw_trace_returns_axes_with_a_legend_of_the_kinds_in_ms(one_device):
    _, events = one_device
    ax = P.draw_trace(events, title="one device")
    labels = {t.get_text() for t in ax.get_legend().get_texts()}
    assert {
        "forward",
        "backward",
        "optimizer",
        "clock sleep in forward",
        "clock sleep in backward",
    } <= labels
    assert "ms" in ax.get_xlabel() and ax.get_title() == "one device"
    matplotlib.pyplot.close(ax.figure)


def test_relative_prints_paths_inside_the_repository_from_its_root():
    assert P.relative(P.TRACE_DIR / "x.json") == ".cache/traces/x.json"


@pytest.mark.parametrize("variant", ["torch_ddp", "own"])
def test_a_two_rank_ddp_trace_shows_gloo_collectives(variant, tmp_path):
    res = spawn(
        P.ddp_step_trace,
        2,
        kwargs={"variant": variant, "steps": STEPS, "trace_dir": str(tmp_path), "clock_rate": 5e9},
        timeout=120,
    )
    assert [r.rank for r in res] == [0, 1]
    for r in res:
        assert r.trace_path.endswith(f"ddp_{variant}_rank{r.rank}.json")
        assert "gloo:all_reduce" in r.comm_names, r.comm_names
        assert r.comm_s > 0
        assert r.checks()[0].verdict and r.claims()["collective ranges off the training thread"], r
        events = P.read_trace(r.trace_path)
        gloo = [e for e in events if e.name == "gloo:all_reduce"]
        main = {e.thread for e in events if e.name == "backward"}
        assert gloo and all(e.kind == "communication" for e in gloo)
        assert {e.thread for e in gloo}.isdisjoint(main)  # gloo runs on its own threads
    both = P.read_traces([r.trace_path for r in res])  # one time axis: the ranks' steps line up
    firsts = [
        min(e.start for e in evs if e.name.startswith("ProfilerStep#")) for evs in both.values()
    ]
    assert min(firsts) >= 0 and max(firsts) - min(firsts) < 1.0
    ax = P.draw_trace(both, title=f"{variant}, 2 ranks")
    rows = [t.get_text() for t in ax.get_yticklabels()]
    assert sum("training thread" in t for t in rows) == 2 and rows[0].startswith("rank 0 · ")
    assert "communication" in {t.get_text() for t in ax.get_legend().get_texts()}
    matplotlib.pyplot.close(ax.figure)


def test_cuda_activities_are_added_only_where_cuda_is():
    acts = P._activities(torch.device("cpu"))
    assert torch.profiler.ProfilerActivity.CPU in acts
    assert (
        torch.profiler.ProfilerActivity.CUDA in P._activities(None)
    ) == torch.cuda.is_available()


def test_memory_curve_agrees_with_the_course_meters(tmp_path):
    """One profiled step's allocator events against memory.model_state_bytes and SavedTensorMeter."""
    from course_lib import memory
    from course_lib.models import tiny_config

    cfg = tiny_config()
    model = GPT(cfg)
    opt = make_optimizer("adamw", model.parameters())
    x, y = step_batch(0, cfg, 8)
    first = P.memory_curve(model, opt, x, y, trace_path=tmp_path / "first.json")
    assert first.passed, first  # the first step leaves the gradients and Adam's moments behind
    assert first.states_after["total"] - first.states_before["total"] == (
        first.states_after["grads"] + first.states_after["optimizer"]
    )
    curve = P.memory_curve(model, opt, x, y, trace_path=tmp_path / "step.json")
    assert curve.passed, curve  # a later step: exactly the gradients stay
    assert curve.allocated[-1] - curve.states_before["total"] == curve.states_after["grads"]
    with memory.SavedTensorMeter(exclude=model) as meter:
        model(x, y)
    expected = curve.states_after["total"] + meter.bytes
    assert abs(curve.peak / expected - 1) <= P.MEMORY_PEAK_BAND, (curve.peak, expected)
    fwd = curve.at_end_of("forward") - curve.states_before["total"]
    assert abs(fwd / meter.bytes - 1) <= P.MEMORY_PEAK_BAND, (fwd, meter.bytes)
    assert curve.peak_phase in ("forward", "backward")
    assert [n for n, _, _ in curve.phases] == ["optimizer", "forward", "backward", "optimizer"]
    ax = P.draw_memory_curve(curve, references={"meters": expected})
    assert "peak" in " ".join(t.get_text() for t in ax.texts)
    matplotlib.pyplot.close(ax.figure)
    ev = P.read_trace(curve.trace_path)
    ax = P.draw_ops(ev, (curve.phases[0][1], curve.phases[-1][2]))
    assert {"forward", "backward", "optimizer"} <= {
        t.get_text() for t in ax.get_legend().get_texts()
    }
    matplotlib.pyplot.close(ax.figure)


def test_unseen_frees_places_the_frees_gloo_made_unrecorded(tmp_path):
    """A collective's buffer the trace never frees, and an address handed out twice, are freed
    when the collective's gloo range ends; a buffer made before any collective and kept is held."""

    def rng(name, tid, ts, dur):
        return {"ph": "X", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}

    def mem(tid, ts, addr, nbytes):
        return {"ph": "i", "name": "[memory]", "pid": 1, "tid": tid, "ts": ts,
                "args": {"Addr": addr, "Bytes": nbytes, "Total Allocated": 0, "Device Type": 0}}  # fmt: skip

    events = [
        rng("backward", 1, 0, 100),
        rng("FSDP::post_backward_reduce", 1, 10, 30),
        rng("c10d::_reduce_scatter_base_", 1, 20, 5),
        rng("gloo:all_reduce", 2, 22, 8),  # the work, on a worker thread: ends at 30 µs
        mem(1, 15, 0xA, 100),  # a gradient shard, made before the call: held
        mem(1, 21, 0xB, 400),  # the clone inside the call: never freed in the trace
        mem(1, 60, 0xC, 7),
        mem(1, 70, 0xC, 7),  # 0xC handed out again: the first was freed, unseen, by then
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    lost = P.unseen_frees(path)
    assert [(round(t * 1e6), b, c) for t, b, c in lost] == [
        (30, 400, "c10d::_reduce_scatter_base_"),
        (70, 7, "?"),
    ]
    times, allocated = P.read_memory(path)
    assert allocated == [100, 500, 507, 514]  # the recorded Bytes, summed
