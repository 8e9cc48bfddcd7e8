"""The MoE / expert-parallelism chapter's measurements: EP equal to one device, its bytes, imbalance, cost.

Rank functions (run them with ``launch.spawn``; every tensor on ``launch.device()``), each
returning a :class:`~course_lib.results.Result` of this rank:

* :func:`ep_equality` — the EP MoE layer at e = world size against the one-device
  :class:`~course_lib.moe.MoE` built from the same weights on every rank (the full batch = the
  ranks' tokens, rank-major): output, loss with its auxiliary term, input / router / expert
  gradients, the weights after one SGD step (``SGD`` rows) and the dropped tokens (``EXACT``
  rows) (:class:`EPEqualityResult`);
* :func:`ep_traffic` — one training step of the EP GPT: the bytes each all-to-all sends to other
  ranks, read off ``all_to_all_single``'s split sizes, forward and backward, against
  :func:`~course_lib.expert_parallel.all_to_all_bytes` of the kept matrix of the one-device
  run (``EXACT``), beside the capacity-padded ``E·C·d`` buffer; and the count: 2 all-to-alls
  per MoE layer forward, 2 backward (:class:`EPTrafficResult`);
* :func:`routing_imbalance` — tokens per expert at every step of two short trainings of an MoE
  GPT, without and with the auxiliary loss, at settings where the first collapses onto few
  experts (routers drawn ~ N(0, 1), top-1 routing with the raw gate, 8 experts); the max/mean
  load, its coefficient of variation and the drops per step, for the plot
  (:class:`ImbalanceResult`);
* :func:`hot_expert_step` — the EP layer under the modelled accelerator clock, experts costed by
  the tokens routed to them (:func:`~course_lib.moe.expert_parts`): designed routing, balanced
  (every expert N·k/E) against skewed (a router bias toward rank 0's experts: 3/4 of the
  assignments there). Per-rank time inside the experts, measured, against
  ``3 · expert_flops(routed) / rate``; the step (max over ranks) slower when skewed, by
  separated ranges over interleaved rounds (:class:`HotExpertResult`);
* :func:`ep_training` (alias :func:`ep_dp_training`) — the EP GPT (× DP where the world allows:
  on 2 ranks only EP = 2) trained a few AdamW steps, equal to one device (:class:`EPTrainingResult`);
* :func:`notebook_suite` — the five in one spawn: ``{"equality", "traffic", "imbalance",
  "hot_expert", "training"}``.

Why the all-to-alls are measured here and not by :class:`~course_lib.comm.CommLog`: the technique
calls ``torch.distributed.all_to_all_single`` directly, so :class:`AllToAllMeter` (a dispatch
mode, as ``tests/test_expert_parallel.py`` measures them) reads the split sizes of every
``c10d.alltoall_base_`` call and counts the rows this rank sends to the *other* ranks.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..clock import BACKWARD_FACTOR, AcceleratorClock
from ..expert_parallel import (
    ExpertParallelMoE,
    all_to_all_bytes,
    allreduce_expert_parallel_grads,
    expert_data_parallel_mesh,
    expert_parallel_gpt,
)
from ..launch import device
from ..models import GPTConfig
from ..moe import (
    MoE,
    MoEConfig,
    MoEGPT,
    expert_capacity,
    expert_flops,
    expert_parts,
    route,
    routing_history,
)
from ..results import EXACT, SGD, Result, for_optimizer
from ..timing import AGREEMENT_BAND, time_steps
from .common import make_optimizer, mean_over_ranks, small_config, step_batch, train_step

__all__ = [
    "moe_gpt_config",
    "moe_config",
    "imbalance_config",
    "load_imbalance",
    "AllToAllMeter",
    "EPEqualityResult",
    "ep_equality",
    "EPTrafficResult",
    "ep_traffic",
    "balanced_all_to_all",
    "ImbalanceResult",
    "routing_imbalance",
    "HotExpertResult",
    "hot_expert_step",
    "EPTrainingResult",
    "ep_training",
    "ep_dp_training",
    "notebook_suite",
]


def moe_gpt_config(**overrides) -> GPTConfig:
    """The chapter's MoE GPT shape: ``small_config(mlp_ratio=2)`` (d_model 32, 2 layers, expert hidden 64)."""
    return small_config(**{"mlp_ratio": 2, **overrides})


def moe_config(**overrides) -> MoEConfig:
    """8 experts, top-2, capacity factor 0.75 (it drops, so "the same drops" is not vacuous), aux 0.5."""
    return MoEConfig(
        **{"num_experts": 8, "top_k": 2, "capacity_factor": 0.75, "aux_loss_coef": 0.5, **overrides}
    )


def imbalance_config(**overrides) -> MoEConfig:
    """The imbalance runs' router: 8 experts, top-1 with raw gates (Switch), capacity factor 1.25."""
    return MoEConfig(
        **{
            "num_experts": 8,
            "top_k": 1,
            "capacity_factor": 1.25,
            "aux_loss_coef": 0.0,
            "renormalize": False,
            **overrides,
        }
    )


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().clone()


def _seeded_moe(config: GPTConfig, moe: MoEConfig, seed: int = 0) -> MoE:
    """The same MoE layer in every process (nn.Linear's own init, seeded; the caller's RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MoE(config, moe)


def _tokens(n: int, d: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The full batch of ``n`` tokens and a fixed readout ``w`` (n, d), the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    return x, torch.randn(n, d, generator=gen)


class _Readout(nn.Module):
    """A layer with a fixed linear readout, as a model ``train_step`` can step.

    ``forward(x, w) → (y, loss)`` with loss = Σ(y·w) / tokens + aux_loss_coef · aux: the mean
    over this rank's tokens, as every rank's loss in the course. Keeps ``y`` and ``stats``.
    """

    def __init__(self, layer: nn.Module, aux_loss_coef: float):
        super().__init__()
        self.layer, self.coef = layer, aux_loss_coef
        self.y = self.aux = self.stats = None

    def forward(self, x, w):
        self.y, self.aux, self.stats = self.layer(x)
        return self.y, (self.y * w).sum() / x.shape[0] + self.coef * self.aux


def _readout_step(model: _Readout, x, w, after_backward=None, lr: float = 0.1) -> dict:
    """One SGD step of ``model`` on (x, w); what it computed, the gradients before the step, after."""
    x = x.clone().requires_grad_(True)
    opt = make_optimizer("sgd", model.parameters(), lr=lr, momentum=0.0)
    grads = {}

    def keep():
        if after_backward is not None:
            after_backward()
        grads.update({n: _cpu(p.grad) for n, p in model.named_parameters()})

    loss = train_step(model, opt, x, w, after_backward=keep)
    return {
        "y": _cpu(model.y),
        "loss": loss,
        "aux": model.aux.item(),
        "x_grad": _cpu(x.grad),
        "grads": grads,
        "stats": model.stats,
        "state": {n: _cpu(p) for n, p in model.named_parameters()},
    }


# =========================================================================== 1. equality


@dataclass
class EPEqualityResult(Result):
    """This rank's EP layer against one device: its outputs, drops and the routing counts."""

    rank: int
    world: int
    expert_ids: list
    dropped: int
    capacity: int
    tokens_per_expert: list
    kept_per_expert: list
    kept_matrix: list  # (e × E): kept per source rank and expert


def ep_equality(
    tokens: int = 64, config: GPTConfig | None = None, moe: MoEConfig | None = None
) -> EPEqualityResult:
    """Rank function: the EP layer (E/e experts here, tokens chunk r of ``tokens``) vs one device.

    Both step once through ``train_step`` with SGD on the loss Σ(y·w)/tokens + coef·aux (a fixed
    readout ``w``). The model's loss is the mean over the ranks; a rank's ``x.grad`` is the
    gradient of its own loss, so ``x.grad / e`` is the one device's. Expert gradients need no
    all-reduce (the combine's backward already summed every rank's tokens); the router's is
    averaged (``allreduce_expert_parallel_grads``).
    """
    config, moe = config or moe_gpt_config(), moe or moe_config()
    dev, e, r = device(), dist.get_world_size(), dist.get_rank()
    x, w = (t.to(dev) for t in _tokens(tokens, config.d_model))
    ref = _readout_step(_Readout(_seeded_moe(config, moe).to(dev), moe.aux_loss_coef), x, w)
    layer = ExpertParallelMoE.from_moe(_seeded_moe(config, moe).to(dev))
    ep = _Readout(layer, moe.aux_loss_coef)
    got = _readout_step(
        ep, x.chunk(e)[r], w.chunk(e)[r], after_backward=lambda: allreduce_expert_parallel_grads(ep)
    )
    s, want = got["stats"], ref["stats"]
    res = EPEqualityResult(
        r,
        e,
        layer.expert_ids,
        s.dropped,
        s.capacity,
        s.tokens_per_expert.tolist(),
        s.kept_per_expert.tolist(),
        s.kept_matrix.tolist(),
        title=f"EP MoE layer (e = {e}, E = {moe.num_experts}, top-{moe.top_k}, "
        f"capacity factor {moe.capacity_factor}) vs one device, rank {r}",
    )
    res.equal("output y (this rank's tokens)", got["y"], ref["y"].chunk(e)[r], SGD)
    res.equal("loss incl. aux (mean over ranks)", mean_over_ranks(got["loss"]), ref["loss"], SGD)
    res.equal("aux loss (mean over ranks)", mean_over_ranks(got["aux"]), ref["aux"], SGD)
    res.equal("x.grad / e (this rank's tokens)", got["x_grad"] / e, ref["x_grad"].chunk(e)[r], SGD)
    res.equal(
        "router gradient (all-reduced)",
        got["grads"]["layer.router.weight"],
        ref["grads"]["layer.router.weight"],
        SGD,
    )
    mine = [n for n in got["grads"] if ".experts." in n]
    res.equal(
        f"gradients of experts {layer.expert_ids} (no all-reduce)",
        got["grads"],
        {n: ref["grads"][n] for n in mine},
        SGD,
    )
    res.equal(
        "weights after one SGD step",
        got["state"],
        {n: ref["state"][n] for n in got["state"]},
        SGD,
    )
    res.condition(
        "assignments dropped (the check is not vacuous)",
        want.dropped,
        want.dropped > 0,
        "> 0 at capacity factor < 1",
        against="one device",
    )
    res.exact("assignments dropped", s.dropped, want.dropped, "one device")
    res.equal(
        "dropped mask (this rank's tokens × k)",
        s.dropped_mask,
        want.dropped_mask.chunk(e)[r],
        EXACT,
    )
    res.exact("capacity C", s.capacity, want.capacity, "one device")
    res.exact(
        "tokens routed per expert",
        res.tokens_per_expert,
        want.tokens_per_expert.tolist(),
        "one device",
    )
    res.exact(
        "tokens kept per expert", res.kept_per_expert, want.kept_per_expert.tolist(), "one device"
    )
    return res


# =========================================================================== 2. traffic


class AllToAllMeter:
    """Bytes this rank sends to *other* ranks in every ``all_to_all_single``, per phase.

    A ``TorchDispatchMode`` (entered with ``with meter:``) that reads each
    ``c10d.alltoall_base_`` call's input split sizes: Σ rows to ranks ≠ ``rank`` × row bytes (the
    self chunk is a local copy). ``calls[phase]`` lists them in call order; set ``phase``
    (``"forward"`` / ``"backward"``) as the step goes.
    """

    def __init__(self, rank: int | None = None):
        from torch.utils._python_dispatch import TorchDispatchMode

        meter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.c10d.alltoall_base_.default:
                    inp, in_splits = args[1], args[4]
                    row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
                    sent = sum(s for q, s in enumerate(in_splits) if q != meter.rank)
                    meter.calls[meter.phase].append(sent * row)
                return func(*args, **(kwargs or {}))

        self.rank = dist.get_rank() if rank is None else rank
        self.phase = "forward"
        self.calls: dict[str, list[int]] = {"forward": [], "backward": []}
        self._mode = _Mode()

    def __enter__(self) -> "AllToAllMeter":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


@dataclass
class EPTrafficResult(Result):
    """One EP GPT step's all-to-all bytes on this rank, per MoE layer, measured and by the formula.

    ``layers[l]``: ``{"forward": [dispatch, combine], "backward": [...], "formula": [...],
    "padded": E·C·d·4 with GShard's per-rank C (its self chunk included), "padded_offrank": the
    (e−1)/e of it sent to other ranks, "capacity_per_rank" / "capacity_group": C on the "tokens_per_rank" and the
    C over the whole batch our layer applies, "tokens_sent": rows, "kept": the one-device (e × E)
    kept matrix}``;
    ``calls``: all-to-alls per phase (all layers).
    """

    rank: int
    world: int
    layers: list
    calls: dict
    collectives: dict  # CommLog: {"op:tag": calls} of the step


def _one_device_kept(model: MoEGPT, x, y, world: int) -> tuple[list[torch.Tensor], list[int]]:
    """Each MoE layer's (e × E) kept assignments per batch chunk, from one device's forward alone."""
    seen = {}
    hooks = [
        b.mlp.register_forward_pre_hook(
            lambda mod, args, i=i: seen.__setitem__(i, args[0].detach())
        )
        for i, b in enumerate(model.blocks)
    ]
    with torch.no_grad():
        model(x, y)
    for h in hooks:
        h.remove()
    kept, capacity = [], []
    m = model.moe
    for i, (block, stats) in enumerate(zip(model.blocks, model.routing_stats(), strict=True)):
        xin = seen[i].reshape(-1, seen[i].shape[-1])
        _, _, experts = route(xin, block.mlp.router.weight, m.top_k, m.renormalize)
        keep = ~stats.dropped_mask
        rows = [
            torch.bincount(ex[k], minlength=m.num_experts)
            for ex, k in zip(experts.chunk(world), keep.chunk(world), strict=True)
        ]
        kept.append(torch.stack(rows).cpu())
        capacity.append(stats.capacity)
    return kept, capacity


def balanced_all_to_all(tokens: int = 64, num_experts: int = 8) -> dict:
    """Rank function: the EP layer's all-to-all bytes to other ranks, routing designed to be even.

    Token t's top-2 experts are t mod E and t+1 mod E (the router reads one-hot features), so every
    expert takes the same share and nothing is dropped: the case the planner's all-to-all formula
    assumes. Returns the :class:`AllToAllMeter` calls and the assignments kept per expert."""
    cfg, E = moe_gpt_config(), num_experts
    moe = MoEConfig(num_experts=E, top_k=2, capacity_factor=None, aux_loss_coef=0.0)
    e, r, dev = dist.get_world_size(), dist.get_rank(), device()
    torch.manual_seed(0)
    layer = MoE(cfg, moe)
    t = torch.arange(tokens)
    x = torch.zeros(tokens, cfg.d_model)
    x[t, t % E], x[t, (t + 1) % E] = (
        2.0,
        1.0,
    )  # the router reads these: top-2 = experts t, t+1 (mod E)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, :E] = torch.eye(E)
    ep = ExpertParallelMoE.from_moe(layer.to(dev))
    meter = AllToAllMeter(r)  # bytes to other ranks, read off every all_to_all_single
    with meter:
        y, _, stats = ep(x.chunk(e)[r].to(dev).requires_grad_())
        meter.phase = "backward"
        y.sum().backward()
    return {"calls": meter.calls, "kept": stats.kept_per_expert.tolist()}


def ep_traffic(
    batch_size: int = 8, config: GPTConfig | None = None, moe: MoEConfig | None = None
) -> EPTrafficResult:
    """Rank function: one ``train_step`` of the EP GPT (e = world size); its all-to-all bytes.

    Measured with :class:`AllToAllMeter` (forward until the model returns, backward after). The
    reference is :func:`~course_lib.expert_parallel.all_to_all_bytes` of each layer's kept matrix
    computed from the one-device MoE GPT on the full batch (which of each chunk's assignments it
    keeps). Forward calls run layer by layer (dispatch, combine); backward in reverse, the
    combine's backward first (it sends the dispatch's volume back), then the dispatch's.
    """
    config, moe = config or moe_gpt_config(), moe or moe_config()
    dev, e, r = device(), dist.get_world_size(), dist.get_rank()
    L, d = config.n_layer, config.d_model
    x, y = step_batch(0, config, batch_size, dev)
    kept, capacity = _one_device_kept(MoEGPT(config, moe, seed=0).to(dev), x, y, e)
    model = expert_parallel_gpt(MoEGPT(config, moe, seed=0).to(dev))
    opt = make_optimizer("adamw", model.parameters())
    meter = AllToAllMeter(r)
    model.register_forward_hook(lambda *_: setattr(meter, "phase", "backward"))
    with comm.CommLog() as log, meter:
        train_step(
            model, opt, x.chunk(e)[r], y.chunk(e)[r], lambda: allreduce_expert_parallel_grads(model)
        )
    fwd, bwd = meter.calls["forward"], meter.calls["backward"]
    collectives = {}
    for rec in log.records:
        key = f"{rec.op}:{rec.tag}"
        collectives[key] = collectives.get(key, 0) + 1
    # A GShard-style padded buffer applies C per group (here: per rank), on this rank's tokens
    tokens_rank = x.shape[0] // e * x.shape[1]
    c_rank = expert_capacity(tokens_rank, moe.num_experts, moe.top_k, moe.capacity_factor)
    layers = []
    for i in range(L):
        f = all_to_all_bytes(kept[i], d, 4, capacity=c_rank)[r]
        j = 2 * (L - 1 - i)  # backward runs the layers in reverse
        layers.append(
            {
                "forward": fwd[2 * i : 2 * i + 2],
                "backward": bwd[j : j + 2],
                "formula": [f["dispatch"], f["combine"]],
                "padded": f["padded"],
                "padded_offrank": f["padded"] * (e - 1) // e,
                "capacity_per_rank": c_rank,
                "tokens_per_rank": tokens_rank,
                "capacity_group": capacity[i],
                "tokens_sent": f["dispatch"] // (d * 4),
                "kept": kept[i].tolist(),
            }
        )
    res = EPTrafficResult(
        r,
        e,
        layers,
        {"forward": len(fwd), "backward": len(bwd)},
        collectives,
        title=f"EP GPT all-to-all bytes (e = {e}, E = {moe.num_experts}, d = {d}, fp32), rank {r}",
    )
    per_layer = {k: v / L if v % L else v // L for k, v in res.calls.items()}
    res.exact(
        "all-to-alls per MoE layer per step",
        per_layer,
        {"forward": 2, "backward": 2},
        "2 forward (dispatch, combine) + 2 backward",
    )
    why = "all_to_all_bytes: tokens to other ranks × d × 4"
    for i, lay in enumerate(layers):
        res.exact(
            f"layer {i}: forward [dispatch, combine] bytes", lay["forward"], lay["formula"], why
        )
        res.exact(
            f"layer {i}: backward [combine's, dispatch's] bytes",
            lay["backward"],
            lay["formula"],
            "the forward's volumes, reversed",
        )
    res.exact(
        "other collectives of the step (CommLog)",
        collectives,
        {"all_gather:moe_counts": L, "all_reduce:dense_grad": 1},
        "1 counts all-gather per layer, 1 dense-gradient all-reduce",
    )
    return res


# =========================================================================== 3. imbalance


def load_imbalance(tokens_per_expert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max/mean, std/mean)`` over the last dimension (experts): 1 and 0 when perfectly balanced."""
    t = tokens_per_expert.double()
    mean = t.mean(dim=-1)
    return t.amax(dim=-1) / mean, t.std(dim=-1, unbiased=False) / mean


@dataclass
class ImbalanceResult(Result):
    """Routing over two short trainings (``runs["no aux"]``, ``runs["aux"]``), for the plot.

    Each run: ``tokens_per_expert`` (steps, L, E), ``max_over_mean`` and ``cv`` (steps, L),
    ``dropped`` (steps, L), ``loss`` [steps], ``capacity``, ``aux_loss_coef``. ``final`` /
    ``final_cv``: each run's max/mean / CV (worst layer), ``final_dropped``: its drops per layer,
    averaged over the last ``tail`` steps.
    """

    runs: dict = field(repr=False)
    final: dict
    final_cv: dict
    final_dropped: dict
    settings: dict
    tail: int


def _routing_run(
    config: GPTConfig,
    moe: MoEConfig,
    steps: int,
    batch_size: int,
    lr: float,
    router_std: float,
    seed: int,
) -> dict:
    """One device: an MoE GPT trained ``steps`` AdamW steps (``moe.routing_history``), with the
    routers drawn again ~ N(0, ``router_std``), and its imbalance per step."""
    run = routing_history(
        config,
        moe,
        steps,
        batch_size,
        "adamw",
        seed=seed,
        dev=device(),
        router_std=router_std,
        lr=lr,
    )
    ratio, cv = load_imbalance(run["tokens_per_expert"])
    return {**run, "max_over_mean": ratio, "cv": cv, "aux_loss_coef": moe.aux_loss_coef}


def routing_imbalance(
    steps: int = 60,
    batch_size: int = 16,
    lr: float = 1e-2,
    router_std: float = 1.0,
    aux_loss_coef: float = 0.1,
    config: GPTConfig | None = None,
    moe: MoEConfig | None = None,
    tail: int = 10,
    seed: int = 0,
    collapsed: float = 2.0,
) -> ImbalanceResult:
    """Rank function: two trainings, without and with the auxiliary loss; their routing per step.

    Same model, router, data and optimizer; only ``aux_loss_coef`` differs (0 vs the given one).
    Run i trains on rank i mod world (both at once on 2 ranks), then every rank gathers both.

    The defaults are chosen so the two runs differ visibly (at the GPT's router init, 0.02, top-2
    and 40 steps the counts stay balanced either way): routers ~ N(0, 1) so routing starts
    decided, top-1 with the raw gate (the router learns from the cross-entropy through the one
    gate it scales), 8 experts, 60 AdamW steps of 16 sequences at lr 1e-2. Rows: the same routing
    at step 0 (the runs start equal); the no-aux run collapsed (max/mean ≥ ``collapsed``); the aux
    run's final max/mean and drops lower.
    """
    config, moe = config or moe_gpt_config(), moe or imbalance_config()
    settings = {
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "router_std": router_std,
        "num_experts": moe.num_experts,
        "top_k": moe.top_k,
        "capacity_factor": moe.capacity_factor,
        "renormalize": moe.renormalize,
    }
    coefs = {"no aux": 0.0, "aux": aux_loss_coef}
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = {
        name: _routing_run(
            config,
            dataclasses.replace(moe, aux_loss_coef=coef),
            steps,
            batch_size,
            lr,
            router_std,
            seed,
        )
        for i, (name, coef) in enumerate(coefs.items())
        if i % world == rank
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    runs = {name: run for part in gathered for name, run in part.items()}
    runs = {name: runs[name] for name in coefs}
    last = {name: slice(-tail, None) for name in runs}
    final = {n: run["max_over_mean"][last[n]].amax(-1).mean().item() for n, run in runs.items()}
    final_cv = {n: run["cv"][last[n]].amax(-1).mean().item() for n, run in runs.items()}
    final_dropped = {n: run["dropped"][last[n]].double().mean().item() for n, run in runs.items()}
    res = ImbalanceResult(
        runs,
        final,
        final_cv,
        final_dropped,
        settings,
        tail,
        title=f"routing over {steps} steps without / with the auxiliary loss (coef {aux_loss_coef})",
    )
    res.exact(
        "tokens per expert at step 0 (the runs start equal)",
        runs["aux"]["tokens_per_expert"][0].tolist(),
        runs["no aux"]["tokens_per_expert"][0].tolist(),
        "the no-aux run",
    )
    res.condition(
        f"final max/mean load, aux (last {tail} steps, worst layer)",
        final["aux"],
        final["aux"] < final["no aux"],
        "below the no-aux run's",
        reference=final["no aux"],
        against="no aux",
    )
    res.condition(
        "final max/mean load, no aux: unbalanced",
        final["no aux"],
        final["no aux"] >= collapsed,
        f"≥ {collapsed:g}: the busiest expert takes ≥ {collapsed:g}× its share",
    )
    res.condition(
        f"assignments dropped per step and layer, aux (last {tail} steps)",
        final_dropped["aux"],
        final_dropped["aux"] < final_dropped["no aux"],
        "below the no-aux run's",
        reference=final_dropped["no aux"],
        against="no aux",
    )
    return res


# =========================================================================== 4. a hot expert


class _ExpertTimer:
    """Wall seconds spent inside the given experts, forward and backward (hooks around each).

    Registered after the clock, so the forward hook runs after the clock's sleep; the backward
    pre-hook fires when the expert's output gradient is ready (before the clock's backward
    sleep), the backward hook when its input gradient is done.
    """

    def __init__(self, experts):
        self.seconds, self._t0, self._handles = 0.0, {}, []
        for e in experts:
            self._handles += [
                e.register_forward_pre_hook(self._start),
                e.register_forward_hook(self._stop),
                e.register_full_backward_pre_hook(self._start),
                e.register_full_backward_hook(self._stop),
            ]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _start(self, module, *_):
        self._t0[id(module)] = time.perf_counter()

    def _stop(self, module, *_):
        self.seconds += time.perf_counter() - self._t0.pop(id(module))


@dataclass
class HotExpertResult(Result):
    """Balanced vs skewed routing under the modelled clock; every rank's expert time, measured and predicted.

    ``per_rank[variant]``: for each rank ``{"routed", "measured_s", "predicted_s", "real_s"}``
    (medians over the timed rounds; ``real_s``: the same experts with the clock paused).
    """

    rate: float
    clock: str
    timings: object = field(repr=False)  # course_lib.timing.Timings
    per_rank: dict
    sleep_over_real: float  # this rank's worst modelled / real expert time


def _designed_routing(x: torch.Tensor, router: nn.Linear, skew: float, per_rank: int) -> None:
    """In place: features 0…E−1 of ``x`` and the router decide every token's two experts.

    Token t gets feature ``t mod E`` = 2 and ``(t+1) mod E`` = 1, the router reads them with
    weight 4 (nothing else), so its top-2 are experts t mod E and t+1 mod E: each expert takes
    exactly N·k/E. ``skew`` > 0 adds a bias (feature E = 1, weights ``skew − 0.5·j``) to the
    first ``per_rank`` experts — rank 0's.
    """
    E = router.weight.shape[0]
    t = torch.arange(x.shape[0])
    x[:, : E + 1] = 0.0
    x[t, t % E] = 2.0
    x[t, (t + 1) % E] = 1.0
    x[:, E] = 1.0
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, :E] = 4.0 * torch.eye(E)
        if skew:
            router.weight[:per_rank, E] = skew - 0.5 * torch.arange(per_rank)


def hot_expert_step(
    tokens: int = 64,
    rounds: int = 5,
    steps_per_round: int = 2,
    expert_ms: float = 25.0,
    ratio: float = 10.0,
    skew: float = 5.0,
    config: GPTConfig | None = None,
    num_experts: int = 4,
) -> HotExpertResult:
    """Rank function: the EP layer (top-2, no capacity limit) stepped with balanced and skewed routing.

    The routing is designed (:func:`_designed_routing`): balanced, every expert takes exactly
    N·k/E assignments; skewed, a router bias ``skew`` toward rank 0's experts — at E = 4, e = 2
    three quarters of the assignments land on rank 0 (expert 0 takes every token). The rate: an
    expert sleeps ``expert_ms`` forward + backward at the balanced load, or slower if needed for
    ≥ ``ratio`` × its real compute (× 2 margin); one rate on every rank. Rows: each variant's
    per-rank expert time (hooks around the experts) within
    :data:`~course_lib.timing.AGREEMENT_BAND` of ``(1 + 2) · expert_flops(routed) / rate``; the
    sleep ≥ ``ratio`` × real; the skewed step (max over ranks) slower than the balanced one.
    """
    config = config or moe_gpt_config()
    if num_experts + 1 > config.d_model:
        raise ValueError(
            f"num_experts={num_experts} needs d_model > num_experts (d_model={config.d_model}): "
            "the designed routing reads features 0…E"
        )
    moe = MoEConfig(num_experts=num_experts, top_k=2, capacity_factor=None, aux_loss_coef=0.0)
    dev, e, r = device(), dist.get_world_size(), dist.get_rank()
    d, hidden = config.d_model, config.mlp_ratio * config.d_model
    x, w = _tokens(tokens, d)
    models, timers, opts = {}, {}, {}
    for name in ("balanced", "skewed"):
        layer = _seeded_moe(config, moe)
        _designed_routing(x, layer.router, skew if name == "skewed" else 0.0, num_experts // e)
        models[name] = _Readout(ExpertParallelMoE.from_moe(layer.to(dev)), 0.0)
        opts[name] = make_optimizer("sgd", models[name].parameters(), lr=1e-3, momentum=0.0)
    xr, wr = x.chunk(e)[r].to(dev), w.chunk(e)[r].to(dev)
    factor = 1 + BACKWARD_FACTOR

    def flops(name: str) -> float:  # this rank's experts at the routing of the last forward
        layer = models[name].layer
        kept = models[name].stats.kept_per_expert.tolist()
        return sum(expert_flops(kept[i], d, hidden) for i in layer.expert_ids)

    def routed(name: str) -> int:
        kept = models[name].stats.kept_per_expert.tolist()
        return sum(kept[i] for i in models[name].layer.expert_ids)

    # real compute first (no clock yet), to choose the rate
    real = {}
    for name, model in models.items():
        timer = _ExpertTimer(model.layer.experts.values())
        timers[name] = timer
        samples = []
        for i in range(6):
            timer.seconds = 0.0
            train_step(model, opts[name], xr.clone().requires_grad_(True), wr)
            if i:
                samples.append(timer.seconds)
        real[name] = statistics.median(samples)
        timer.remove()
    balanced_expert = expert_flops(tokens * moe.top_k // num_experts, d, hidden)
    rate = factor * balanced_expert / (expert_ms / 1e3)
    for name in models:
        if flops(name) > 0:
            rate = min(rate, factor * flops(name) / (ratio * 2 * real[name]))
    rate_t = torch.tensor([rate], dtype=torch.float64, device=dev)
    dist.all_reduce(rate_t, op=dist.ReduceOp.MIN)
    rate = rate_t.item()
    # one clock per model (the same rate), on the experts alone; the timers after it (their
    # forward hook must run after the clock's sleep)
    clocks = {}
    for name, model in models.items():
        clocks[name] = AcceleratorClock(rate, force=True)
        clocks[name].apply(model, parts=expert_parts(model))
        timers[name] = _ExpertTimer(model.layer.experts.values())
    measured = {name: [] for name in models}
    predicted = {name: [] for name in models}
    counts = {name: [] for name in models}

    def stepper(name):
        def step():
            timers[name].seconds = 0.0
            train_step(models[name], opts[name], xr.clone().requires_grad_(True), wr)
            measured[name].append(timers[name].seconds)
            predicted[name].append(factor * flops(name) / rate)
            counts[name].append(routed(name))

        return step

    warmup = 1
    timings = time_steps(
        {name: stepper(name) for name in models},
        rounds=rounds,
        steps_per_round=steps_per_round,
        warmup=warmup,
        clock=clocks["balanced"],
        title=f"EP step, {e} ranks, experts under the clock",
    )
    mine = {
        name: [
            float(counts[name][-1]),
            statistics.median(measured[name][warmup:]),
            statistics.median(predicted[name][warmup:]),
            real[name],
        ]
        for name in models
    }
    table = torch.tensor([mine[n] for n in models], dtype=torch.float64, device=dev)
    everyone = [torch.empty_like(table) for _ in range(e)]
    dist.all_gather(everyone, table)
    per_rank = {
        name: [
            dict(zip(("routed", "measured_s", "predicted_s", "real_s"), t[i].tolist(), strict=True))
            for t in everyone
        ]
        for i, name in enumerate(models)
    }
    for rows in per_rank.values():
        for row in rows:
            row["routed"] = int(row["routed"])
    over = min(
        mine[n][2] / mine[n][3] for n in models if mine[n][2] > 0
    )  # modelled / real, this rank
    res = HotExpertResult(
        rate,
        clocks["balanced"].name,
        timings,
        per_rank,
        over,
        title=f"a hot expert: balanced vs skewed routing, EP = {e}, rank {r}",
    )
    for name in models:
        res.within(
            f"rank {r}'s expert time, {name} (s)",
            mine[name][1],
            mine[name][2],
            AGREEMENT_BAND,
            "3 · expert_flops(routed) / rate",
        )
    res.condition(
        f"rank {r}'s experts sleep / real compute",
        over,
        over >= ratio,
        f"≥ {ratio:g}×",
    )
    hot = per_rank["skewed"][0]["routed"]
    busiest = max(row["routed"] for row in per_rank["balanced"])
    res.condition(
        "rank 0's routed assignments, skewed",
        hot,
        hot > busiest,
        "above the busiest rank's, balanced",
        reference=busiest,
    )
    res.checked.append(timings.compare_row("skewed", "balanced", "slower"))
    return res


# =========================================================================== 5. EP (× DP) training


@dataclass
class EPTrainingResult(Result):
    """This rank's parameters (its experts + the dense ones) after AdamW steps of the EP (× DP) GPT."""

    rank: int
    dp_rank: int
    ep_rank: int
    losses: list  # the model's loss per step (mean over all ranks)
    dropped: list  # per step, per layer (this EP group's)
    groups: list  # (op, tag, group) of the collectives
    state: dict = field(repr=False)


class _ShardMean(nn.Module):
    """One device: the mean of a model's losses over ``dp`` batch shards (each an EP group's tokens)."""

    def __init__(self, model: nn.Module, dp: int):
        super().__init__()
        self.model, self.dp = model, dp
        self.dropped = []

    def forward(self, x, y):
        losses, dropped = [], []
        for xj, yj in zip(x.chunk(self.dp), y.chunk(self.dp), strict=True):
            losses.append(self.model(xj, yj)[1])
            dropped.append([s.dropped for s in self.model.routing_stats()])
        self.dropped = dropped
        return None, sum(losses) / self.dp


def ep_training(
    steps: int = 3,
    optimizer: str = "adamw",
    global_batch: int = 8,
    ep_size: int | None = None,
    config: GPTConfig | None = None,
    moe: MoEConfig | None = None,
) -> EPTrainingResult:
    """Rank function: the EP GPT on a (dp, ep) mesh trained ``steps`` steps; vs one device.

    ``ep_size`` (default: the world size, so no DP): EP groups of ``ep_size`` ranks, dp = world /
    ep_size replicas, each EP group one dp shard of the global batch. Gradients:
    ``allreduce_expert_parallel_grads`` (dense over all ranks, experts over "dp"). The reference
    trains one MoE GPT on the same batches with the loss = mean over the dp shards (each shard's
    capacity and aux loss are its EP group's). Rows: this rank's parameters, the loss per step,
    the drops per step, the collectives' groups.
    """
    config, moe = config or moe_gpt_config(), moe or moe_config()
    dev, world = device(), dist.get_world_size()
    ep_size = world if ep_size is None else ep_size
    dp, rank = world // max(ep_size, 1), dist.get_rank()
    dp_rank, ep_rank, dp_group, ep_group = 0, rank, None, None  # EP alone: the default group
    if ep_size != world:
        mesh = expert_data_parallel_mesh(ep_size)
        dp_rank, ep_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("ep")
        dp_group, ep_group = mesh.get_group("dp"), mesh.get_group("ep")
    model = expert_parallel_gpt(MoEGPT(config, moe, seed=0).to(dev), ep_group)
    opt = make_optimizer(optimizer, model.parameters())
    ref = _ShardMean(MoEGPT(config, moe, seed=0).to(dev), dp)
    ref_opt = make_optimizer(optimizer, ref.parameters())
    losses, ref_losses, dropped, ref_dropped = [], [], [], []
    with comm.CommLog() as log:
        for step in range(steps):
            x, y = step_batch(step, config, global_batch, dev)
            xr, yr = x.chunk(world)[rank], y.chunk(world)[rank]  # rank = dp_rank · e + ep_rank
            loss = train_step(
                model, opt, xr, yr, lambda: allreduce_expert_parallel_grads(model, dp_group)
            )
            losses.append(loss)
            dropped.append([s.dropped for s in model.routing_stats()])
            ref_losses.append(train_step(ref, ref_opt, x, y))  # one device: no collectives
            ref_dropped.append(ref.dropped[dp_rank])
    model_losses = [mean_over_ranks(v) for v in losses]
    state = {n: _cpu(p) for n, p in model.named_parameters()}
    want = {n: p.detach() for n, p in ref.model.named_parameters()}
    groups = sorted({(c.op, c.tag, c.group) for c in log.records})
    res = EPTrainingResult(
        rank,
        dp_rank,
        ep_rank,
        model_losses,
        dropped,
        groups,
        state,
        title=f"EP {ep_size} × DP {dp} GPT, {steps} {optimizer} steps vs one device, rank {rank}",
    )
    tol = for_optimizer(optimizer)
    res.equal(
        f"dp {dp_rank}, ep {ep_rank}: parameters after {steps} steps",
        state,
        {n: want[n] for n in state},
        tol,
    )
    res.equal("loss per step (mean over ranks)", model_losses, ref_losses, tol)
    res.exact("assignments dropped per step and layer", dropped, ref_dropped, "one device")
    want_groups = [("all_gather", "moe_counts", "ep" if dp > 1 else "default")]
    if world > 1:  # one rank alone has nothing to all-reduce
        want_groups.append(("all_reduce", "dense_grad", "default"))
    if dp > 1:
        want_groups.append(("all_reduce", "expert_grad", "dp"))
    res.exact(
        "collectives (op, tag, group)",
        groups,
        sorted(want_groups),
        "counts on EP, dense grads on all, expert grads on DP",
    )
    return res


ep_dp_training = ep_training


# =========================================================================== one spawn for the notebook


def notebook_suite(imbalance: dict | None = None, hot_expert: dict | None = None) -> dict:
    """Rank function: what the chapter's MoE / EP half runs, in one spawn (2 ranks: EP = 2).

    ``imbalance`` / ``hot_expert``: keyword overrides for :func:`routing_imbalance` and
    :func:`hot_expert_step`. Returns ``{"equality", "traffic", "imbalance", "hot_expert",
    "training"}``, each this rank's :class:`~course_lib.results.Result`.
    """
    out = {
        "equality": ep_equality(),
        "traffic": ep_traffic(),
        "training": ep_training(),
        "imbalance": routing_imbalance(**(imbalance or {})),
        "hot_expert": hot_expert_step(**(hot_expert or {})),
    }
    dist.barrier()
    return out
