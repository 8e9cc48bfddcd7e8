"""Chapter 04, part 2: the FSDP2 features people reach for, each run on real ranks and measured.

Rank functions (run with ``launch.spawn``; each returns a :class:`common.Result` whose rows the
notebook prints — ``claims()`` — and the tests assert; each row names its tolerance or formula):

* :func:`reshard_memory_and_traffic` — ``reshard_after_forward`` True vs False: bytes sent per step
  (3Ψ vs 2Ψ, counted) and memory over one step (``FSDPMemTracker``, sampled after every op);
* :func:`accumulation_without_sync` — ``set_requires_gradient_sync(False)``: fewer reduce-scatters;
* :func:`hsdp` — a (replicate, shard) = (2, 2) mesh: which collective runs on which dimension;
* :func:`reshard_to_smaller_mesh` — ``reshard_after_forward=2`` at world 4;
* :func:`prefetch_timeline` — explicit forward/backward prefetch, when each all-gather is issued.

Gradient clipping, activation checkpointing, meta-device initialisation and sharded checkpoints are in
:mod:`course_lib.experiments.fsdp_practice`.

Every run returns full tensors (``full_state``, CPU) where equality with one device is the claim,
so the test process can judge it against its own reference. Instruments (counters, the memory
tracker, the issue timeline) come from :mod:`course_lib.fsdp_meters`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from ..comm import CollectiveCounter
from ..fsdp import fsdp2_wrap, full_state_dict, padded_numel, set_prefetch
from ..fsdp_meters import (
    IssueTimeline,
    counted_step,
    held_gradient_bytes,
    memory_tracker,
    phased_step,
)
from ..launch import device
from ..models import GPT, GPTConfig
from ..results import ADAMW, SGD
from .common import (
    Result,
    check_global_batch,
    make_optimizer,
    median_times,
    race,
    reference_run,
    shard_batch,
    state_diff,
    step_batch,
    train_step,
    zero_config,
)

__all__ = [
    "features_config",
    "cpu_state",
    "timed_in_every_round",
    "reshard_memory_and_traffic",
    "accumulation_without_sync",
    "hsdp",
    "reshard_to_smaller_mesh",
    "prefetch_timeline",
]


def features_config(**overrides) -> GPTConfig:
    """``zero_config`` with 4 blocks (Ψ = 224,343): enough units for memory over a step to show."""
    return zero_config(**{"n_layer": 4, **overrides})


def cpu_state(sd: dict) -> dict:
    """A state dict's tensors, detached and copied to CPU (what a rank returns to the caller)."""
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


def _units(model, mesh, **kwargs):
    """``fully_shard`` every block, then the root (``fsdp2_wrap``'s units) on any mesh, any kwargs."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


def _per_group(cc: CollectiveCounter) -> dict:
    """``{group: {op: {"calls", "tensor_bytes", "group_size"}}}`` over a counter's records."""
    out: dict = {}
    for r in cc.records:
        row = out.setdefault(r.group, {}).setdefault(
            r.op, {"calls": 0, "tensor_bytes": 0, "group_size": r.world_size}
        )
        row["calls"] += 1
        row["tensor_bytes"] += r.tensor_bytes
    return out


# =========================================================================== reshard_after_forward


@dataclass
class ReshardResult(Result):
    world_size: int
    units: int
    psi_pad: int
    block_param_bytes: int  # one block's parameters, gathered (padded rows)
    root_param_bytes: int
    sent: dict  # {"True"/"False": ring bytes sent per step}
    collectives: dict  # {mode: {op: {phase: calls}}}
    peak: dict  # {mode: peak total bytes over the step (FSDPMemTracker)}
    peak_breakdown: dict  # {mode: {category: bytes at that peak}}
    peak_gathered: dict  # {mode: most unsharded-parameter bytes at once}
    trace: dict = field(
        repr=False, default_factory=dict
    )  # {mode: [(phase, total, unsharded)] per op}

    def add_rows(self) -> "ReshardResult":
        ring = (self.world_size - 1) / self.world_size
        full = 4 * self.psi_pad
        block, bound = self.block_param_bytes, self.root_param_bytes + 2 * self.block_param_bytes
        self.exact(
            "reshard=True sends 3·(N−1)/N·4Ψ_pad per step",
            self.sent["True"],
            3 * ring * full,
            against="formula 3·(N−1)/N·4Ψ_pad",
        )
        self.exact(
            "reshard=False sends 2·(N−1)/N·4Ψ_pad per step (no backward all-gather)",
            self.sent["False"],
            2 * ring * full,
            against="formula 2·(N−1)/N·4Ψ_pad",
        )
        extra = self.peak["False"] - self.peak["True"]
        self.condition(
            "False's peak exceeds True's by at least one block's gathered parameters",
            extra,
            extra >= block,
            "≥",
            reference=block,
            against="one block, 4Ψ_pad(block)",
        )
        gathered = self.peak_gathered
        self.condition(
            "False holds every unit gathered at once (the whole model)",
            gathered["False"],
            gathered["False"] >= full,
            "≥",
            reference=full,
            against="the model, 4Ψ_pad",
        )
        self.condition(
            "True never holds more than the root + 2 blocks gathered",
            gathered["True"],
            gathered["True"] <= bound,
            "≤",
            reference=bound,
            against="root + 2 blocks",
        )
        return self


def reshard_memory_and_traffic(
    config: GPTConfig | None = None, global_batch: int = 8
) -> ReshardResult:
    """Rank function: one AdamW step each with ``reshard_after_forward`` True and False, counted and tracked.

    After a warm-up step (FSDP2's lazy init, AdamW's state), one step under
    :class:`comm.CollectiveCounter` (bytes per collective) and one under ``FSDPMemTracker``
    (every tensor by category — sharded/unsharded params, grads, activations, optimizer state —
    sampled after every op, so the notebook can draw memory over the step).
    """
    config = config or features_config()
    n, dev = dist.get_world_size(), device()
    check_global_batch(global_batch, n)
    x, y = shard_batch(*step_batch(0, config, global_batch, dev))
    sent, colls, peak, breakdown, gathered, trace = {}, {}, {}, {}, {}, {}
    for reshard in (True, False):
        key = str(reshard)
        model = fsdp2_wrap(GPT(config, seed=0).to(dev), reshard_after_forward=reshard)
        opt = make_optimizer("adamw", model.parameters())
        train_step(model, opt, x, y)
        cc, _ = counted_step(model, opt, x, y)
        sent[key] = cc.total("ring_bytes", op="all_gather") + cc.total(
            "ring_bytes", op="reduce_scatter"
        )
        colls[key] = {
            op: {t: cc.count(op=op, tag=t) for t in ("forward", "backward")}
            for op in ("all_gather", "reduce_scatter")
        }
        opt.zero_grad(set_to_none=True)
        tracker = memory_tracker(model, opt)
        tracker.track_inputs((x, y))
        with tracker:
            phased_step(model, opt, x, y, partial(setattr, tracker, "phase"))
            opt.zero_grad(set_to_none=True)
        snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
        peak[key] = snap["Total"]
        breakdown[key] = {getattr(k, "value", str(k)): v for k, v in snap.items()}
        gathered[key] = max(u for _, _, u in tracker.trace)
        trace[key] = tracker.trace
        block_bytes = 4 * padded_numel(model.blocks[0], n)
    root = 4 * padded_numel(model, n) - len(model.blocks) * block_bytes
    return ReshardResult(
        n,
        len(model.blocks) + 1,
        padded_numel(model, n),
        block_bytes,
        root,
        sent,
        colls,
        peak,
        breakdown,
        gathered,
        trace,
    ).add_rows()


# =========================================================================== gradient accumulation


@dataclass
class AccumulationResult(Result):
    world_size: int
    micro_batches: int
    units: int
    reduce_scatters: dict  # {"sync_each": calls per step, "no_sync": calls per step}
    all_gathers: dict
    max_abs_diff: dict  # {variant: vs one device on the big batch, computed on the rank}
    held: dict = field(default_factory=dict)  # {variant: held_gradient_bytes after micro-batch 1}
    param_bytes: dict = field(default_factory=dict)  # {"full": Ψ·4, "shard": Ψ_pad/N·4}
    full_state: dict = field(repr=False, default_factory=dict)  # {variant: full tensors (CPU)}

    def add_rows(self, reference: dict) -> "AccumulationResult":
        """``reference``: one device's state dict after the same steps on the big batches."""
        rs, m, u = self.reduce_scatters, self.micro_batches, self.units
        self.exact(
            "syncing every micro-batch reduce-scatters M·units times per step",
            rs["sync_each"],
            m * u,
            against="formula M·units",
        )
        self.exact(
            "set_requires_gradient_sync(False) reduce-scatters once per unit per step",
            rs["no_sync"],
            u,
            against="formula units",
        )
        if self.held:
            sync, acc = self.held["sync_each"], self.held["no_sync"]
            self.exact(
                "gradient bytes held after micro-batch 1, syncing each (sharded)",
                sync["sharded"] + sync["unsharded"],
                self.param_bytes["shard"],
                against="Ψ_pad / N × 4 B (this rank's padded shards)",
            )
            self.exact(
                "gradient bytes held after micro-batch 1, sync off (unsharded)",
                acc["sharded"] + acc["unsharded"],
                self.param_bytes["full"],
                against="Ψ × 4 B",
            )
        got = {f"{v}/{k}": t for v, sd in self.full_state.items() for k, t in sd.items()}
        want = {f"{v}/{k}": reference[k] for v in self.full_state for k in reference}
        self.equal(
            "both equal one device on the big batch (max |Δ| ≤ 1e-6, SGD)",
            got,
            want,
            SGD,
            against="one device (big batch)",
        )
        return self


def accumulation_without_sync(
    micro_batches: int = 4, steps: int = 3, global_batch: int = 16, config: GPTConfig | None = None
) -> AccumulationResult:
    """Rank function: M micro-batches per step, gradients synced each time vs only on the last one.

    ``set_requires_gradient_sync(False)`` (FSDP1's ``no_sync``) makes each unit accumulate its
    *unsharded* gradient locally; the last micro-batch turns sync back on and reduce-scatters the
    sum once. Traffic per step drops by (M−1) reduce-scatters per unit; memory rises by one
    unsharded gradient per unit until then (measured after the first micro-batch:
    ``fsdp_meters.held_gradient_bytes``, against Ψ × 4 B and Ψ_pad / N × 4 B). Losses
    are scaled by 1/M: the sum of M micro-batch gradients is then the gradient of the mean over
    the rank's slice.
    """
    config = config or features_config()
    n, dev = dist.get_world_size(), device()
    check_global_batch(global_batch, n, micro_batches)
    out: dict = {"reduce_scatters": {}, "all_gathers": {}, "max_abs_diff": {}, "full_state": {}}
    out["held"] = {}
    reference, _, _ = reference_run(config, steps, global_batch, "sgd", dev=dev)
    for variant in ("sync_each", "no_sync"):
        model = fsdp2_wrap(GPT(config, seed=0).to(dev))
        opt = make_optimizer("sgd", model.parameters())
        for step in range(steps):
            x, y = shard_batch(*step_batch(step, config, global_batch, dev))
            opt.zero_grad(set_to_none=True)
            counters = []  # one CommDebugMode per forward+backward (its module tracker breaks across passes)
            for j, (xm, ym) in enumerate(
                zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True)
            ):
                if variant == "no_sync":
                    model.set_requires_gradient_sync(j == micro_batches - 1)
                with CollectiveCounter() as cc:
                    (model(xm, ym)[1] / micro_batches).backward()
                counters.append(cc)
                if step == 0 and j == 0:  # what this rank holds until the next micro-batch
                    out["held"][variant] = held_gradient_bytes(model)
            opt.step()
        out["reduce_scatters"][variant] = sum(c.count(op="reduce_scatter") for c in counters)
        out["all_gathers"][variant] = sum(c.count(op="all_gather") for c in counters)
        full = full_state_dict(model)
        out["max_abs_diff"][variant] = state_diff(full, reference)
        out["full_state"][variant] = cpu_state(full)
    params = list(model.parameters())  # DTensors: numel() is the full size
    out["param_bytes"] = {
        "full": 4 * sum(p.numel() for p in params),
        "shard": 4
        * padded_numel(model, n)
        // n,  # each rank's shard is stored padded to ⌈d/N⌉ rows
    }
    result = AccumulationResult(n, micro_batches, len(model.blocks) + 1, **out)
    return result.add_rows(reference.state_dict())


# =========================================================================== HSDP and reshard-to-int


@dataclass
class HSDPResult(Result):
    world_size: int
    mesh_shape: tuple
    units: int
    per_group: dict  # {group name: {op: {"calls", "tensor_bytes", "group_size"}}} over one step
    max_abs_diff: float  # vs one device, computed on the rank
    allclose: bool
    local_losses: list = field(default_factory=list)
    full_state: dict = field(repr=False, default_factory=dict)
    local_shapes: dict = field(default_factory=dict)

    def add_rows(self, reference: dict) -> "HSDPResult":
        """``reference``: one device's state dict after the same steps on the full batches."""
        g, u = self.per_group, self.units
        ag = g.get("shard", {}).get("all_gather", {})
        self.condition(
            "all-gathers run on the shard dimension (groups of 2), one per unit per pass",
            (ag.get("calls"), ag.get("group_size")),
            (ag.get("calls"), ag.get("group_size")) == (2 * u, 2),
            "(calls, group size) exact",
            reference=(2 * u, 2),
            against="2 per unit, shard groups",
        )
        self.exact(
            "reduce-scatters run on the shard dimension, one per unit",
            g.get("shard", {}).get("reduce_scatter", {}).get("calls"),
            u,
            against="one per unit",
        )
        ar = g.get("replicate", {}).get("all_reduce", {})
        self.condition(
            "all-reduces run on the replicate dimension, one per unit",
            (ar.get("calls"), ar.get("group_size")),
            (ar.get("calls"), ar.get("group_size")) == (u, 2),
            "(calls, group size) exact",
            reference=(u, 2),
            against="one per unit, replicate groups",
        )
        kinds = sorted(f"{dim}:{op}" for dim, ops in g.items() for op in ops)
        only = set(g) == {"shard", "replicate"} and set(g["replicate"]) == {"all_reduce"}
        self.condition(
            "nothing else is communicated",
            kinds,
            only,
            "groups: shard, replicate; on replicate only all_reduce",
        )
        self.equal(
            "HSDP equals one device (AdamW, allclose 1e-5)",
            self.full_state,
            reference,
            ADAMW,
            against="one device (full batch)",
        )
        return self


def hsdp(steps: int = 4, global_batch: int = 8, config: GPTConfig | None = None) -> HSDPResult:
    """Rank function (world 4): HSDP — shard within groups of 2, replicate across the 2 groups.

    ``init_device_mesh(dev, (2, 2), mesh_dim_names=("replicate", "shard"))`` and ``fully_shard``
    on that 2-D mesh: each parameter is ``Shard(0)`` over the shard dimension and replicated
    over the other. Per unit and step: all-gathers within the shard group, a reduce-scatter within
    it, then an all-reduce of the reduced shard across the replicate group — the model state is
    ``16Ψ/2`` per rank, and the largest collective spans 2 ranks, not 4 (on GPUs: one node).
    """
    from torch.distributed.device_mesh import init_device_mesh

    config = config or features_config()
    n, dev = dist.get_world_size(), device()
    if n != 4:
        raise ValueError(f"hsdp runs on a (2, 2) mesh: world_size must be 4, got {n}")
    check_global_batch(global_batch, n)
    mesh = init_device_mesh(dev.type, (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _units(GPT(config, seed=0).to(dev), mesh, reshard_after_forward=True)
    opt = make_optimizer("adamw", model.parameters())
    local = []
    for step in range(steps - 1):
        local.append(
            train_step(model, opt, *shard_batch(*step_batch(step, config, global_batch, dev)))
        )
    cc, loss = counted_step(
        model, opt, *shard_batch(*step_batch(steps - 1, config, global_batch, dev))
    )
    local.append(loss)
    reference, _, _ = reference_run(config, steps, global_batch, "adamw", dev=dev)
    full, ref = full_state_dict(model), reference.state_dict()
    shapes = {k: tuple(p.to_local().shape) for k, p in model.named_parameters()}
    result = HSDPResult(
        n,
        (2, 2),
        len(model.blocks) + 1,
        _per_group(cc),
        state_diff(full, reference),
        ADAMW.ok(full, ref),
        local,
        cpu_state(full),
        shapes,
    )
    return result.add_rows(ref)


@dataclass
class ReshardToIntResult(Result):
    world_size: int
    reshard_after_forward: int
    units: int
    all_gathers: dict  # {phase: {group size: calls}}
    local_numel_after_forward: (
        int  # elements of block 0's registered parameters between forward and backward
    )
    local_numel_sharded: int
    full_numel: int

    def add_rows(self) -> "ReshardToIntResult":
        u, k, n = self.units, self.reshard_after_forward, self.world_size
        self.exact(
            f"forward all-gathers span all {n} ranks",
            self.all_gathers.get("forward"),
            {n: u},
            against="{group size: calls}, one per unit",
        )
        self.exact(
            f"backward all-gathers span only {k} ranks (the smaller mesh)",
            self.all_gathers.get("backward"),
            {k: u},
            against="{group size: calls}, one per unit",
        )
        held = self.local_numel_after_forward
        self.condition(
            f"between forward and backward a rank holds 1/{k} of a block, not 1/{n} nor all of it",
            held,
            self.local_numel_sharded < held < self.full_numel,
            "between",
            reference=(self.local_numel_sharded, self.full_numel),
            against="(1/N, all) elements",
        )
        return self


def reshard_to_smaller_mesh(
    reshard_after_forward: int = 2, global_batch: int = 8, config: GPTConfig | None = None
) -> ReshardToIntResult:
    """Rank function (world 4): ``reshard_after_forward=2`` — after forward, keep 1/2 of each unit, not 1/4.

    The middle ground between True (re-gather from 1/N) and False (keep everything): after a
    unit's forward FSDP2 frees the gathered weights but keeps a shard over a *smaller* mesh (here
    2 ranks), so the backward all-gather runs over groups of 2 — on GPUs, inside one node.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    config = config or features_config()
    n, dev = dist.get_world_size(), device()
    check_global_batch(global_batch, n)
    model = _units(
        GPT(config, seed=0).to(dev),
        init_device_mesh(dev.type, (n,)),
        reshard_after_forward=reshard_after_forward,
    )
    opt = make_optimizer("adamw", model.parameters())
    x, y = shard_batch(*step_batch(0, config, global_batch, dev))
    train_step(model, opt, x, y)
    sharded = sum(p.to_local().numel() for p in model.blocks[0].parameters())
    held = []  # block 0's registered elements once the forward is done (before backward)
    block0 = model.blocks[0].parameters
    hook = model.register_forward_hook(
        lambda m, a, o: held.append(
            sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in block0())
        )
    )
    cc, _ = counted_step(model, opt, x, y)
    hook.remove()
    after = held[0]
    gathers = {}
    for r in cc.select(op="all_gather"):
        phase = gathers.setdefault(r.tag, {})
        phase[r.world_size] = phase.get(r.world_size, 0) + 1
    return ReshardToIntResult(
        n,
        reshard_after_forward,
        len(model.blocks) + 1,
        gathers,
        after,
        sharded,
        sum(p.numel() for p in model.blocks[0].parameters()),
    ).add_rows()


# =========================================================================== prefetch


@dataclass
class PrefetchResult(Result):
    world_size: int
    n_layer: int
    gathers_issued_at_block_start: (
        dict  # {variant: [forward all-gathers issued when block i starts]}
    )
    events: dict  # {variant: [(kind, label, start_s, end_s)]}: "F"/"B" compute per block, "AG"/"RS" issue spans
    step_s: dict  # {variant: median step seconds (interleaved rounds, max over ranks)}
    step_s_rounds: dict

    def add_rows(self) -> "PrefetchResult":
        L, g = self.n_layer, self.gathers_issued_at_block_start
        self.exact(
            "without a plan, block i's all-gather is issued when block i starts (root + i+1 issued)",
            g["implicit"],
            [i + 2 for i in range(L)],
            against="root + i+1, per block",
        )
        self.exact(
            "with set_modules_to_forward_prefetch, block i+1's is already issued when block i starts",
            g["explicit"],
            [min(i + 3, L + 1) for i in range(L)],
            against="root + i+2, per block",
        )
        return self


def timed_in_every_round(step_s: dict, rounds: dict) -> bool:
    """Each variant was timed in the same number of rounds, every time > 0, and reports their median."""
    counts = {len(r) for r in rounds.values()}
    return (
        len(counts) == 1
        and min(counts) > 0
        and all(min(r) > 0 and step_s[v] == statistics.median(r) for v, r in rounds.items())
    )


def _block_spans(model, timeline: IssueTimeline):
    """Hooks recording compute spans per block (F, B) and how many all-gathers were issued as each starts."""
    events, at_start, open_ = timeline.events, [], {}
    now = timeline.now
    handles = []
    for i, block in enumerate(model.blocks):

        def pre(m, args, i=i):
            if torch.is_grad_enabled() and args[0].requires_grad:
                args[0].register_hook(
                    lambda g, i=i: events.append(("B", str(i), open_.pop(("B", i)), now()))
                )
            at_start.append(timeline.issued("all_gather"))
            open_[("F", i)] = now()

        def post(m, args, out, i=i):
            events.append(("F", str(i), open_.pop(("F", i)), now()))
            if out.requires_grad:
                out.register_hook(lambda g, i=i: open_.__setitem__(("B", i), now()))

        handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    return at_start, handles


def prefetch_timeline(
    config: GPTConfig | None = None, global_batch: int = 8, rounds: int = 3
) -> PrefetchResult:
    """Rank function: FSDP2 with and without an explicit prefetch plan (:func:`fsdp.set_prefetch`).

    Explicit plan: each block all-gathers the next one in forward (``set_modules_to_forward_prefetch``)
    and the previous one in backward (``set_modules_to_backward_prefetch``); the root prefetches
    block 0. One recorded step each: compute spans per block (forward hooks; backward from the
    gradient hooks of the block's output and input) and the moment each all-gather / reduce-scatter
    is issued. Then both are timed in interleaved rounds. On GPUs the all-gather runs on its own
    stream while the previous block computes; on CPU with gloo it is done in the caller's time,
    so prefetch may gain nothing here — what is measured is *when* each all-gather is issued.
    """
    config = config or features_config()
    n, dev = dist.get_world_size(), device()
    check_global_batch(global_batch, n)
    x, y = shard_batch(*step_batch(0, config, global_batch, dev))
    models, opts, events, at_start = {}, {}, {}, {}
    for variant in ("implicit", "explicit"):
        model = fsdp2_wrap(GPT(config, seed=0).to(dev))
        if variant == "explicit":
            b = list(model.blocks)
            set_prefetch(
                model,
                forward={model: [b[0]], **{b[i]: [b[i + 1]] for i in range(len(b) - 1)}},
                backward={b[i]: [b[i - 1]] for i in range(1, len(b))},
            )
        models[variant], opts[variant] = model, make_optimizer("adamw", model.parameters())
        train_step(model, opts[variant], x, y)  # lazy init, optimizer state
        dist.barrier()
        timeline = IssueTimeline(time.perf_counter())
        starts, handles = _block_spans(model, timeline)
        counted_step(model, opts[variant], x, y, counter=timeline)
        for h in handles:
            h.remove()
        events[variant], at_start[variant] = sorted(timeline.events, key=lambda e: e[2]), starts
    times = race(
        {v: (lambda v=v: train_step(models[v], opts[v], x, y)) for v in models}, rounds=rounds
    )
    return PrefetchResult(
        n, config.n_layer, at_start, events, median_times(times), times
    ).add_rows()
