"""DDP from scratch: equal to one device on the full batch, for every bucketing, and as torch DDP.

Every configuration runs inside ONE spawn per world size (each spawn costs ~2 s on 2 cores): the
rank function ``_suite`` trains all cases and returns their final weights and communication logs;
the parametrized tests below each read the case they name and compare it with a single-device run
computed here in the test process, within the named tolerances of ``course_lib.results``.
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib import comm
from course_lib.data import make_batch
from course_lib.ddp import (
    DDP,
    make_buckets,
    naive_allreduce_gradients,
    torch_ddp,
    trainable_parameters,
)
from course_lib.experiments.ddp import EXPOSURE_VARIANTS, DDPTimeline
from course_lib.launch import spawn
from course_lib.models import GPT, equality_config
from course_lib.results import ADAMW, BF16, EXACT, FP16, SGD, for_optimizer, max_abs_diff
from course_lib.step_time import AlphaBeta

CFG = dict(vocab_size=32, block_size=16, n_layer=2, n_head=2, d_model=32)
BATCH = 16  # global batch, divisible by every world size (at 8, fp32 rounding at world 4 already moves AdamW by 2e-4)
SGD_STEPS, ADAMW_STEPS = 5, 10
WORLDS = [2, 4]
# bucket_cap_mb per name: one all-reduce per parameter in place, everything in one bucket,
# a few buckets, and one *flat* bucket per parameter (cap 0: every parameter exceeds it)
BUCKETS = {"per_param": None, "one_bucket": 100.0, "several": 0.03, "bucket_per_param": 0.0}
MODELS = ["tied", "untied_frozen"]
OPTS = {"sgd": SGD_STEPS, "adamw": ADAMW_STEPS}
NO_SYNC_BATCH = 24  # 3 equal micro-batches per rank at world 2 and 4
# own DDP's options per wrapper name ("own" = the defaults, like torch: copies, no unused-parameter search)
OWN = {
    "own": {},
    "own_view": dict(gradient_as_bucket_view=True),
    "own_find_unused": dict(find_unused_parameters=True),
    "own_fp16": dict(comm_hook="fp16"),
    "own_bf16": dict(comm_hook="bf16"),
}


# --------------------------------------------------------------------------- models and references


def build_model(kind: str, seed: int = 0) -> nn.Module:
    """``tied``: the equality GPT (lm_head is wte). ``untied_frozen``: untied, with wpe frozen."""
    model = GPT(equality_config(**CFG, tie_weights=(kind == "tied")), seed=seed)
    if kind == "untied_frozen":
        model.wpe.weight.requires_grad_(False)
    return model


def make_optimizer(name: str, params):
    params = [p for p in params if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    return torch.optim.AdamW(
        params, lr=3e-3, weight_decay=0.1
    )  # the course's lr (train_single_device)


class WithUnused(nn.Module):
    """The GPT plus two parameters registered *last* (so they sit in the first bucket):
    ``extras.extra`` is used only on the ranks told to, ``extras.dead`` never."""

    def __init__(self):
        super().__init__()
        self.gpt = GPT(equality_config(**CFG), seed=0)
        V = CFG["vocab_size"]
        gen = torch.Generator().manual_seed(7)
        self.extras = nn.ParameterDict(
            {
                "extra": nn.Parameter(torch.randn(V, V, generator=gen) * 0.02),
                "dead": nn.Parameter(torch.randn(V, V, generator=gen) * 0.02),
            }
        )

    def forward(self, idx, targets, use_extra: bool):
        logits, _ = self.gpt(idx)
        if use_extra:
            logits = logits + logits @ self.extras["extra"]
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def params_of(module: nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.size(0) // world
    return t[rank * n : (rank + 1) * n]


def batch(step: int, size: int = BATCH):
    return make_batch(size, CFG["block_size"], CFG["vocab_size"], seed=1000 + step)


@functools.lru_cache(maxsize=None)
def reference(model_kind: str, opt: str, steps: int, batch_size: int = BATCH) -> dict:
    """Single device, full batch."""
    model = build_model(model_kind)
    optimizer = make_optimizer(opt, model.parameters())
    for step in range(steps):
        x, y = batch(step, batch_size)
        optimizer.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        optimizer.step()
    return params_of(model)


@functools.lru_cache(maxsize=None)
def reference_unused(world: int, steps: int) -> dict:
    """One device computes what DDP should: the mean over shards, ``extra`` used on all shards but the last."""
    model = WithUnused()
    optimizer = make_optimizer("adamw", model.parameters())
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad(set_to_none=True)
        loss = (
            sum(model(shard(x, r, world), shard(y, r, world), r != world - 1) for r in range(world))
            / world
        )
        loss.backward()
        optimizer.step()
    return {"params": params_of(model), "dead_grad_is_none": model.extras["dead"].grad is None}


# --------------------------------------------------------------------------- what the ranks run


def _train_case(model_kind, bucket_cap_mb, opt, steps, wrapper):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(model_kind)
    ddp = (
        DDP(model, bucket_cap_mb=bucket_cap_mb, **OWN[wrapper])
        if wrapper in OWN
        else torch_ddp(model)
    )
    optimizer = make_optimizer(opt, ddp.parameters())
    grad_bytes, grad_calls, used_calls, grad_is_view = [], [], [], []
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad(set_to_none=True)
        with comm.CommLog() as log:
            _, loss = ddp(shard(x, rank, world), shard(y, rank, world))
            loss.backward()
        grad_bytes.append(log.total("tensor_bytes", tag="grad"))
        grad_calls.append(log.count(tag="grad"))
        used_calls.append(log.count(tag="used"))
        if wrapper in OWN:
            grad_is_view.append(
                [
                    p.grad.data_ptr() == ddp._slot[p].data_ptr()
                    for p in model.parameters()
                    if p in ddp._slot
                ]
            )
        optimizer.step()
    out = {
        "params": params_of(model),
        "grad_bytes": grad_bytes,
        "grad_calls": grad_calls,
        "used_calls": used_calls,
        "frozen_grad_is_none": [p.grad is None for p in model.parameters() if not p.requires_grad],
    }
    if wrapper in OWN:
        out["buckets"], out["grad_is_view"] = ddp.buckets, grad_is_view
    return out


def _unused_case(bucket_cap_mb, steps):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = WithUnused()
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, find_unused_parameters=True)
    optimizer = make_optimizer("adamw", ddp.parameters())
    dead_none, extra_none = [], []
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad(set_to_none=True)
        ddp(shard(x, rank, world), shard(y, rank, world), rank != world - 1).backward()
        dead_none.append(model.extras["dead"].grad is None)
        extra_none.append(model.extras["extra"].grad is None)
        optimizer.step()
    return {
        "params": params_of(model),
        "dead_grad_is_none": dead_none,
        "extra_grad_is_none": extra_none,
        "buckets": ddp.buckets,
    }


def _unused_default_case(bucket_cap_mb):
    """find_unused_parameters=False (the default): ``extras.dead`` gets no gradient on any rank → a clear error."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = DDP(WithUnused(), bucket_cap_mb=bucket_cap_mb)
    x, y = batch(0)
    with comm.CommLog() as log:
        try:
            ddp(shard(x, rank, world), shard(y, rank, world), True).backward()
            error = ""
        except RuntimeError as e:
            error = str(e)
    return {"error": error, "grad_calls": log.count(tag="grad"), "n_buckets": len(ddp.buckets)}


def _no_sync_case(bucket_cap_mb, micro):
    """Two steps of ``micro`` micro-batches each: the first ``micro-1`` under no_sync."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model("tied")
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    optimizer = make_optimizer("sgd", ddp.parameters())
    calls_no_sync, calls_sync, bytes_sync = [], [], []
    for step in range(2):
        x, y = batch(step, NO_SYNC_BATCH)
        xs, ys = shard(x, rank, world).chunk(micro), shard(y, rank, world).chunk(micro)
        optimizer.zero_grad(set_to_none=True)
        with comm.CommLog() as log:
            with ddp.no_sync():
                for i in range(micro - 1):
                    (ddp(xs[i], ys[i])[1] / micro).backward()
        calls_no_sync.append(log.count())
        with comm.CommLog() as log:
            (ddp(xs[-1], ys[-1])[1] / micro).backward()
        calls_sync.append(log.count(tag="grad"))
        bytes_sync.append(log.total("tensor_bytes", tag="grad"))
        optimizer.step()
    return {
        "params": params_of(model),
        "calls_no_sync": calls_no_sync,
        "calls_sync": calls_sync,
        "bytes_sync": bytes_sync,
        "n_buckets": len(ddp.buckets),
    }


def _broadcast_case():
    rank = dist.get_rank()
    model = build_model("tied", seed=100 + rank)  # every rank initialised differently
    model.register_buffer("scale", torch.full((3,), float(rank) + 1))
    before = params_of(model)
    DDP(model)
    return {"before": before, "after": params_of(model), "buffer": model.scale.clone()}


def _naive_case(steps):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model("tied")
    optimizer = make_optimizer("sgd", model.parameters())
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad(set_to_none=True)
        model(shard(x, rank, world), shard(y, rank, world))[1].backward()
        naive_allreduce_gradients(model)
        optimizer.step()
    return {"params": params_of(model)}


class _Calls(DDPTimeline):
    """The timeline, also noting which observer hook ran, in order."""

    def __init__(self):
        super().__init__()
        self.calls = []
        for name in (
            "on_forward_start",
            "on_forward_end",
            "on_bucket_launch",
            "on_wait_start",
            "on_bucket_done",
            "on_step_done",
        ):
            hook = getattr(self, name)
            setattr(
                self,
                name,
                lambda *a, _name=name, _hook=hook: (self.calls.append(_name[3:]), _hook(*a)),
            )


def _timeline_case():
    rank, world = dist.get_rank(), dist.get_world_size()
    timeline = _Calls()  # an observer, attached from outside
    ddp = DDP(build_model("tied"), bucket_cap_mb=0.03, observer=timeline)
    x, y = batch(0)
    ddp(shard(x, rank, world), shard(y, rank, world))[1].backward()
    with ddp.no_sync():
        ddp(shard(x, rank, world), shard(y, rank, world))[1].backward()
    return {
        "timeline": list(timeline.events),
        "n_buckets": len(ddp.buckets),
        "calls": timeline.calls,
    }


def _refusal_case():
    """Sharding on top of DDP is refused because DDP marks its parameters (sharding.py imports no wrapper)."""
    from course_lib.sharding import check_not_reduced, reducer_of
    from course_lib.zero import ZeroOptimizer
    from course_lib.zero3 import Zero3

    def error(fn):
        try:
            fn()
        except ValueError as e:
            return str(e)
        return ""

    plain = build_model("tied")
    before = reducer_of(plain.parameters())
    ours = DDP(build_model("tied"))
    theirs = torch_ddp(build_model("tied"))
    out = {
        "plain": before,
        "ours": reducer_of(ours.parameters()),
        "theirs": reducer_of(theirs.parameters()),
        "zero3_of_ddp": error(lambda: Zero3(ours)),
        "zero3_of_inner": error(lambda: Zero3(ours.module)),
        "zero_of_ddp": error(lambda: ZeroOptimizer(ours.module.parameters(), torch.optim.AdamW)),
        "check": error(lambda: check_not_reduced(theirs.module.parameters(), "Sharding")),
    }
    ours = theirs = None  # drop the wrappers (and their hooks)
    return out


def _solutions_ddp():
    """solutions/ddp.py loaded by path (a rank's sys.path need not hold the repository root)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "solutions" / "ddp.py"
    spec = importlib.util.spec_from_file_location("_solutions_ddp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _ReducesAfterBackward(nn.Module):
    """A wrong stretch answer: correct averages, but every all-reduce after backward (no overlap)."""

    def __init__(self, module, bucket_size_mb=0.03):
        super().__init__()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, src=0)

    def forward(self, *args):
        return self.module(*args)

    def finish_gradient_synchronization(self):
        naive_allreduce_gradients(self.module)


class _NoBroadcast(nn.Module):
    """A wrong stretch answer: overlapped, but every rank keeps its own init."""

    def __init__(self, module, bucket_size_mb=0.03):
        super().__init__()
        self.module = module
        self.reducer = _solutions_ddp().BucketedReducer(module, bucket_cap_mb=bucket_size_mb)

    def forward(self, *args):
        return self.module(*args)

    def finish_gradient_synchronization(self):
        self.reducer.finish()


def _stretch_case():
    from course_lib.checks.ddp import check_overlapped_ddp

    return {
        "solution": check_overlapped_ddp(_solutions_ddp().OverlappedDDP),
        "after_backward": check_overlapped_ddp(_ReducesAfterBackward),
        "no_broadcast": check_overlapped_ddp(_NoBroadcast),
    }


def _exposure_case():
    from course_lib.experiments import ddp as bench

    return bench.exposed_communication(
        equality_config(**CFG), batch_size=2, bucket_cap_mb=0.03, rounds=1, timeline_steps=1
    )


def _suite(world_cases: dict) -> dict:
    runners = {
        "stretch": _stretch_case,
        "exposure": _exposure_case,
        "train": _train_case,
        "unused": _unused_case,
        "unused_default": _unused_default_case,
        "no_sync": _no_sync_case,
        "broadcast": _broadcast_case,
        "naive": _naive_case,
        "timeline": _timeline_case,
        "refusal": _refusal_case,
        "bench": _bench_smoke,
        "claims": _chapter_claims,
    }
    return {key: runners[key[0]](*key[1:]) for key in world_cases}


def all_cases(world: int) -> list[tuple]:
    cases = [
        ("train", m, cap, opt, steps, "own")
        for m in MODELS
        for cap in BUCKETS.values()
        for opt, steps in OPTS.items()
    ]
    cases += [
        ("train", m, 25.0, opt, steps, "torch") for m in MODELS for opt, steps in OPTS.items()
    ]
    cases += [
        ("train", m, 0.03, opt, steps, "own_view") for m in MODELS for opt, steps in OPTS.items()
    ]
    cases += [("train", "tied", 100.0, "sgd", SGD_STEPS, "own_view")]
    cases += [
        ("train", "tied", 0.03, "sgd", SGD_STEPS, w)
        for w in ("own_find_unused", "own_fp16", "own_bf16")
    ]
    cases += [("unused", cap, 5) for cap in (None, 0.03, 100.0)]
    cases += [("unused_default", cap) for cap in (None, 0.03)]
    cases += [("no_sync", cap, 3) for cap in (None, 0.03)]
    cases += [("broadcast",), ("naive", SGD_STEPS), ("timeline",), ("refusal",)]
    if world == 2:  # the notebook's rank functions, at the notebook's world size
        cases += [("bench",), ("claims",), ("stretch",), ("exposure",)]
    return cases


@functools.lru_cache(maxsize=None)
def suite(world: int) -> dict:
    """Run every case at this world size, in one spawn; result[key] is the list of per-rank outputs."""
    per_rank = spawn(
        _suite, world, args=(dict.fromkeys(all_cases(world)),), backend="gloo", timeout=480
    )
    return {key: [r[key] for r in per_rank] for key in per_rank[0]}


def unique_trainable_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for _, p in trainable_parameters(model))


# --------------------------------------------------------------------------- tests: equality

world_ids = [pytest.param(w, id=f"world={w}") for w in WORLDS]
bucket_ids = [pytest.param(cap, id=f"bucket={name}") for name, cap in BUCKETS.items()]
model_ids = [pytest.param(m, id=m) for m in MODELS]


@pytest.mark.parametrize("model_kind", model_ids)
@pytest.mark.parametrize("cap", bucket_ids)
@pytest.mark.parametrize("world", world_ids)
def test_ddp_matches_single_device_sgd(world, cap, model_kind):
    ref = reference(model_kind, "sgd", SGD_STEPS)
    for rank, out in enumerate(suite(world)[("train", model_kind, cap, "sgd", SGD_STEPS, "own")]):
        SGD.assert_close(out["params"], ref, f"rank {rank}")


@pytest.mark.parametrize("model_kind", model_ids)
@pytest.mark.parametrize("cap", bucket_ids)
@pytest.mark.parametrize("world", world_ids)
def test_ddp_matches_single_device_adamw(world, cap, model_kind):
    ref = reference(model_kind, "adamw", ADAMW_STEPS)
    for out in suite(world)[("train", model_kind, cap, "adamw", ADAMW_STEPS, "own")]:
        ADAMW.assert_close(out["params"], ref)


@pytest.mark.parametrize("world", world_ids)
def test_frozen_parameter_gets_no_grad_and_does_not_move(world):
    init = params_of(build_model("untied_frozen"))
    for cap in BUCKETS.values():
        for out in suite(world)[("train", "untied_frozen", cap, "adamw", ADAMW_STEPS, "own")]:
            assert out["frozen_grad_is_none"] == [True]
            EXACT.assert_close(out["params"]["wpe.weight"], init["wpe.weight"])
            assert all("wpe.weight" not in b for b in out["buckets"])


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("model_kind", model_ids)
@pytest.mark.parametrize("world", world_ids)
def test_torch_ddp_matches_single_device_too(world, model_kind, opt):
    ref = reference(model_kind, opt, OPTS[opt])
    for out in suite(world)[("train", model_kind, 25.0, opt, OPTS[opt], "torch")]:
        for_optimizer(opt).assert_close(out["params"], ref)


@pytest.mark.parametrize("world", world_ids)
def test_naive_allreduce_after_backward_matches_single_device(world):
    ref = reference("tied", "sgd", SGD_STEPS)
    for out in suite(world)[("naive", SGD_STEPS)]:
        SGD.assert_close(out["params"], ref)


# --------------------------------------------------------------------------- tests: what is sent


@pytest.mark.parametrize("model_kind", model_ids)
@pytest.mark.parametrize("cap", bucket_ids)
@pytest.mark.parametrize("world", world_ids)
def test_grad_bytes_per_step_equal_unique_trainable_param_bytes(world, cap, model_kind):
    want = unique_trainable_bytes(build_model(model_kind))
    for out in suite(world)[("train", model_kind, cap, "sgd", SGD_STEPS, "own")]:
        assert out["grad_bytes"] == [want] * SGD_STEPS
        assert out["grad_calls"] == [len(out["buckets"])] * SGD_STEPS, "one all-reduce per bucket"
        assert out["used_calls"] == [0] * SGD_STEPS, (
            "find_unused_parameters=False: no used-flag all-reduce"
        )


@pytest.mark.parametrize("world", world_ids)
def test_find_unused_parameters_costs_one_flag_allreduce_and_keeps_the_result(world):
    ref = reference("tied", "sgd", SGD_STEPS)
    for out in suite(world)[("train", "tied", 0.03, "sgd", SGD_STEPS, "own_find_unused")]:
        assert out["used_calls"] == [1] * SGD_STEPS
        SGD.assert_close(out["params"], ref)


# --------------------------------------------------------------------------- tests: gradient_as_bucket_view


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("model_kind", model_ids)
@pytest.mark.parametrize("world", world_ids)
def test_gradient_as_bucket_view_matches_single_device_and_grads_are_bucket_views(
    world, model_kind, opt
):
    ref = reference(model_kind, opt, OPTS[opt])
    for out in suite(world)[("train", model_kind, 0.03, opt, OPTS[opt], "own_view")]:
        for_optimizer(opt).assert_close(out["params"], ref)
        assert all(all(step) and step for step in out["grad_is_view"]), (
            ".grad is the view into its bucket"
        )
    for out in suite(world)[("train", model_kind, 0.03, opt, OPTS[opt], "own")]:
        assert not any(any(step) for step in out["grad_is_view"]), (
            "default: .grad is its own tensor (copy back)"
        )


@pytest.mark.parametrize("world", world_ids)
def test_gradient_as_bucket_view_in_one_bucket(world):
    ref = reference("tied", "sgd", SGD_STEPS)
    for out in suite(world)[("train", "tied", 100.0, "sgd", SGD_STEPS, "own_view")]:
        SGD.assert_close(out["params"], ref)


# --------------------------------------------------------------------------- tests: gradient compression


@pytest.mark.parametrize("hook", ["own_fp16", "own_bf16"])
@pytest.mark.parametrize("world", world_ids)
def test_compress_hook_halves_the_bytes_and_stays_close_to_fp32(world, hook):
    ref = reference("tied", "sgd", SGD_STEPS)
    want = unique_trainable_bytes(build_model("tied"))
    for out in suite(world)[("train", "tied", 0.03, "sgd", SGD_STEPS, hook)]:
        assert out["grad_bytes"] == [want // 2] * SGD_STEPS, "16-bit all-reduce: half the bytes"
        assert max_abs_diff(out["params"], ref) > 0, "16-bit communication rounds"
        (FP16 if hook == "own_fp16" else BF16).assert_close(
            out["params"], ref
        )  # rounded, not wrong


def test_comm_hook_rejects_unknown_names():
    with pytest.raises(ValueError, match="comm_hook"):
        DDP(nn.Linear(2, 2), comm_hook="int8")


@pytest.mark.parametrize("world", world_ids)
def test_buckets_cover_each_trainable_param_once_in_reverse_order(world):
    model = build_model("tied")
    names = [n for n, _ in trainable_parameters(model)]
    counts = {}
    for name, cap in BUCKETS.items():
        buckets = suite(world)[("train", "tied", cap, "sgd", SGD_STEPS, "own")][0]["buckets"]
        assert [n for b in buckets for n in b] == names[::-1], name
        counts[name] = len(buckets)
    assert counts["one_bucket"] == 1
    assert counts["per_param"] == counts["bucket_per_param"] == len(names)
    assert 1 < counts["several"] < len(names)
    assert "lm_head.weight" not in names, "the tied weight appears once, as wte.weight"


def test_make_buckets_respects_the_cap():
    model = build_model("tied")
    named = trainable_parameters(model)
    cap = 20_000
    buckets = make_buckets(named, cap)
    for b in buckets:
        size = sum(p.numel() * 4 for _, p in b)
        assert size <= cap or len(b) == 1
    assert [n for b in buckets for n, _ in b] == [n for n, _ in reversed(named)]


@pytest.mark.parametrize(
    "cap", [pytest.param(None, id="bucket=per_param"), pytest.param(0.03, id="bucket=several")]
)
@pytest.mark.parametrize("world", world_ids)
def test_no_sync_accumulates_then_syncs_once(world, cap):
    ref = reference(
        "tied", "sgd", 2, NO_SYNC_BATCH
    )  # 3 equal micro-batches per rank = the full batch
    want_bytes = unique_trainable_bytes(build_model("tied"))
    for out in suite(world)[("no_sync", cap, 3)]:
        assert out["calls_no_sync"] == [0, 0], "no communication inside no_sync"
        assert out["calls_sync"] == [out["n_buckets"]] * 2
        assert out["bytes_sync"] == [want_bytes] * 2
        SGD.assert_close(out["params"], ref)


@pytest.mark.parametrize("world", world_ids)
def test_wrapping_broadcasts_params_and_buffers_from_rank0(world):
    outs = suite(world)[("broadcast",)]
    rank0 = params_of(build_model("tied", seed=100))
    assert not SGD.ok(outs[1]["before"], rank0), "ranks really started different"
    for out in outs:
        EXACT.assert_close(out["after"], rank0)
        assert out["buffer"].tolist() == [1.0, 1.0, 1.0]


# --------------------------------------------------------------------------- tests: unused parameters


@pytest.mark.parametrize(
    "cap",
    [
        pytest.param(None, id="bucket=per_param"),
        pytest.param(0.03, id="bucket=several"),
        pytest.param(100.0, id="bucket=one_bucket"),
    ],
)
@pytest.mark.parametrize("world", world_ids)
def test_param_unused_on_every_rank_keeps_grad_none(world, cap):
    for out in suite(world)[("unused", cap, 5)]:
        assert out["dead_grad_is_none"] == [True] * 5
        assert out["extra_grad_is_none"] == [False] * 5


@pytest.mark.parametrize(
    "cap",
    [
        pytest.param(None, id="bucket=per_param"),
        pytest.param(0.03, id="bucket=several"),
        pytest.param(100.0, id="bucket=one_bucket"),
    ],
)
@pytest.mark.parametrize("world", world_ids)
def test_param_unused_on_one_rank_does_not_hang_and_matches_single_device(world, cap):
    ref = reference_unused(world, 5)
    for out in suite(world)[("unused", cap, 5)]:
        first = [n for b in out["buckets"] for n in b][:2]
        assert set(first) == {"extras.dead", "extras.extra"}, (
            "registered last, reduced first: they block the rest"
        )
        ADAMW.assert_close(out["params"], ref["params"])


@pytest.mark.parametrize("world", world_ids)
def test_unused_parameter_without_find_unused_raises_a_clear_error_and_does_not_hang(world):
    for cap in (None, 0.03):
        for out in suite(world)[("unused_default", cap)]:
            assert "extras.dead" in out["error"] and "find_unused_parameters=True" in out["error"]
            assert out["grad_calls"] == out["n_buckets"], (
                "every bucket still launched: no rank hangs"
            )


# --------------------------------------------------------------------------- tests: timeline


@pytest.mark.parametrize("world", world_ids)
def test_timeline_shows_communication_launched_during_backward(world):
    for out in suite(world)[("timeline",)]:
        events = out["timeline"]
        kinds = [e[0] for e in events]
        assert kinds.count("comm") == out["n_buckets"]
        assert all(t1 >= t0 for _, _, t0, t1 in events)
        (bwd,) = [e for e in events if e[:2] == ("compute", "backward")]
        first_launch = min(e[2] for e in events if e[0] == "comm")
        assert first_launch < bwd[3], "the first bucket is launched before backward ends (overlap)"


@pytest.mark.parametrize("world", world_ids)
def test_observer_hooks_run_in_step_order_and_not_under_no_sync(world):
    for out in suite(world)[("timeline",)]:
        k = out["n_buckets"]
        synced = [
            "forward_start",
            "forward_end",
            *["bucket_launch"] * k,
            "wait_start",
            *["bucket_done"] * k,
            "step_done",
        ]
        assert out["calls"] == synced + ["forward_start", "forward_end"], (
            "no_sync: a forward, no reduction"
        )


# --------------------------------------------------------------------------- the notebook's measurements


# a laptop-like link for the predictions of the bucket sweep (α 100 µs, 1 GB/s)
_AB = AlphaBeta({"all_reduce": 1e-4}, {"all_reduce": 1e9}, 2, 0)


def _bench_smoke():
    from course_lib.experiments import ddp as bench

    cfg = equality_config(**CFG)
    kw = dict(config=cfg, batch_size=2)
    return {
        "throughput": bench.ddp_throughput(
            **kw, bucket_cap_mb=0.03, rounds=2, steps_per_round=1, warmup=1
        ),
        "sweep": bench.bucket_size_sweep(
            (None, 0.03, 100.0), **kw, rounds=1, steps_per_round=1, warmup=0
        ),
        "step": bench.ddp_step_time(cfg, global_batch=4, steps=1, warmup=0),
        "timelines": bench.ddp_timelines(**kw, bucket_cap_mb=0.03, steps=1),
        "sweep_clock": bench.bucket_sweep_under_clock(
            (None, 100.0), rate=1e9, fit=_AB, config=cfg, batch_size=2, rounds=1
        ),
    }


def test_bench_rank_functions_return_numbers_for_the_notebook():
    res = suite(2)[("bench",)][0]
    thr = res["throughput"]
    assert all(
        thr[v]["tokens_per_s"] > 0 for v in ("naive", "own_per_param", "own_bucketed", "torch_ddp")
    )
    assert [r["n_buckets"] for r in res["sweep"]][::2] == [
        len(trainable_parameters(build_model("tied"))),
        1,
    ]
    assert (
        res["step"]["world_size"] == 2
        and res["step"]["step_s"] > 0
        and res["step"]["compute_s"] > 0
    )
    rows = res["sweep_clock"]["rows"]
    params = trainable_parameters(build_model("tied"))
    assert [r["label"] for r in rows] == ["per param", "100 MiB"]
    assert [r["n_buckets"] for r in rows] == [len(params), 1]
    one_bucket = _AB.predict("all_reduce", sum(p.numel() * 4 for _, p in params), 2)
    assert rows[1]["predicted"].parts["exposed all_reduce"] == pytest.approx(one_bucket)
    assert len(res["sweep_clock"].checks()) == 2 and all(r["timing"].median > 0 for r in rows)
    tl = res["timelines"]
    assert {e[0] for e in tl["naive"]} == {"compute", "comm"}
    assert {e[0] for e in tl["overlapped"]} == {"compute", "comm", "wait"}
    naive_backward_end = [e for e in tl["naive"] if e[1] == "backward"][0][3]
    assert min(e[2] for e in tl["naive"] if e[0] == "comm") >= naive_backward_end, (
        "naive: comm after backward"
    )


def test_stretch_checker_passes_the_solution_and_fails_wrong_answers():
    for out in suite(2)[("stretch",)]:
        assert out["solution"] == [], out["solution"]
        assert any("after backward() returned" in p for p in out["after_backward"]), out
        assert any("differs from one device" in p for p in out["no_broadcast"]), out


def test_exposed_communication_counts_calls_and_orders_launches():
    res = suite(2)[("exposure",)][0]
    n = len(trainable_parameters(build_model("tied")))
    calls = res["all_reduces"]
    assert calls["blocking per-param"] == calls["overlapped per-param"] == n
    assert calls["blocking bucketed"] == calls["overlapped bucketed"] < n
    assert all(r.verdict for r in res["timelines"].checks()), res["timelines"].table()
    assert set(res["exposed"]) == set(res["all_reduces"]) == {"compute only", *EXPOSURE_VARIANTS}
    assert "exposed: predicted" in res.exposure_table()


def test_hints_come_in_two_layers_and_never_hold_the_code():
    from course_lib.checks.ddp import HINTS, hint

    for name in HINTS:
        assert hint(name, 1) != hint(name, 2)
        assert "p.grad.div_(" not in hint(name, 2) and ".copy_(" not in hint(name, 2)
    with pytest.raises(ValueError, match="no level with the code"):
        hint("allreduce_gradients", 3)
    with pytest.raises(ValueError, match="no hints"):
        hint("nope")


def test_one_device_replay_refuses_uneven_shards():
    from course_lib.experiments.ddp import one_device_replay

    model = build_model("tied")
    with pytest.raises(ValueError, match="same number of micro-batches"):
        one_device_replay(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            None,
            [[[0, 1, 2, 3]], [[4, 5]]],
            batch_size=2,
            accumulation=1,
        )


def _chapter_claims():
    from course_lib.experiments import ddp

    return [
        ddp.equality_with_single_device(v, o, steps)
        for v in ddp.VARIANTS
        for o, steps in (("sgd", 5), ("adamw", 10))
    ] + [ddp.accumulation_with_no_sync(micro_batches=4)]


def test_notebook_02_claims_hold_on_every_rank():
    per_rank = suite(2)[("claims",)]
    failed = [
        (rank, type(r).__name__, getattr(r, "variant", ""), claim)
        for rank, results in enumerate(per_rank)
        for r in results
        for claim, ok in r.claims().items()
        if not ok
    ]
    assert failed == []
    assert all(
        r.claims() for results in per_rank for r in results
    )  # every result states at least one claim


# --------------------------------------------------------------------------- sharding on top of DDP


@pytest.mark.parametrize("world", world_ids)
def test_sharding_refuses_parameters_a_data_parallel_wrapper_already_reduces(world):
    for out in suite(world)[("refusal",)]:
        assert out["plain"] is None
        assert (out["ours"], out["theirs"]) == (
            "course_lib.ddp.DDP",
            "torch.nn.parallel.DistributedDataParallel",
        )
        assert "Zero3" in out["zero3_of_ddp"] and "DDP" in out["zero3_of_ddp"]
        assert out["zero3_of_inner"], (
            "the inner module's parameters are marked too: DDP would reduce them"
        )
        assert "course_lib.ddp.DDP" in out["zero_of_ddp"]
        assert "DistributedDataParallel" in out["check"] and "Sharding" in out["check"]
