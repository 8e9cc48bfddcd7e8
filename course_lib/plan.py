"""Choosing a parallel layout: per-GPU memory of every strategy from the course's formulas, and a recommendation.

The course measured each technique alone; a real job combines them. This module adds up, per GPU:

* **model states** — ``formulas.zero_model_state_breakdown`` (Rajbhandari et al. 2019) on the parameters a GPU's
  model-parallel group holds, Ψ/(t·p) for tensor parallel size t and pipeline size p, sharded by ZeRO stage z over
  the d data-parallel ranks;
* **activations** — ``formulas.korthikanti_activation_bytes`` (Korthikanti et al. 2022; 16-bit, with tensor and
  sequence parallelism and recompute) for L/p layers, times the micro-batches a 1F1B pipeline keeps alive on its
  first stage (p of them: so a pipeline does not shrink activation memory — its first stage still holds L layers'
  worth of one micro-batch), plus the fp32 logits of the loss; for the course's own model in fp32 on the CPU,
  ``formulas.activation_bytes_estimate`` (derived op by op and measured in chapters 01 and 03).

**Five axes** (:class:`Layout`): data (``dp``, with ZeRO stage ``zero``), tensor (``tp``), pipeline (``pp``),
context (``cp``: each rank holds S/c tokens of every sequence — activations ÷ c, ring attention's K/V sent round
c ranks, :func:`~course_lib.step_time.cp_ring_bytes`) and expert (``ep``: an MoE :class:`Model`'s experts ÷ e
per rank with their gradients and optimizer states, two all-to-alls per MoE layer each way,
:func:`~course_lib.step_time.ep_all_to_all_bytes`). The world is dp·tp·pp·cp; ep divides dp·cp. Chapter 07
checks the bytes against its measurements (``tests/test_plan_five_axes.py``).

:func:`recommend` then walks a ladder, cheapest communication first, and stops at the first layout that fits in the
usable memory (``gpu_memory_gb`` minus a ``reserve`` for the CUDA context, communication buffers and fragmentation):

1. **DDP** — nothing sharded, one gradient all-reduce per step (2Ψ), overlapped with backward, no model changes;
2. **ZeRO-2** as DeepSpeed stage 2 runs it (gradients reduce-scattered during backward, the updated parameters
   all-gathered after the optimizer step; FSDP2's ``reshard_after_forward=False`` gathers in the next forward
   instead, which is not what is modelled) — the same 2Ψ of traffic, gradients and optimizer states sharded.
   ZeRO-1 sends the same bytes and saves less, so the ladder skips it (pipeline engines pair with it: they
   accumulate gradients over micro-batches, which sharded gradients would make communicate every micro-batch);
3. **ZeRO-3** (DeepSpeed stage 3; FSDP2 ``fully_shard``) — parameters sharded too, 3Ψ;
4. **tensor parallelism inside a node** (its 4 all-reduces per layer sit on the critical path: NVLink, not the
   network) at the node's size, "TP up to the GPUs of a server" (Narayanan et al. 2021, takeaway 1), with sequence
   parallelism, and ZeRO-2 then ZeRO-3 (FSDP) over the remaining ranks, across nodes. A 3D layout (TP inside the
   node, a pipeline across nodes, ZeRO-1 data parallel for the rest) is listed next to it: its network traffic is
   lower, and it needs enough micro-batches to keep the bubble (p−1)/(m+p−1) small;
5. the same with **full activation recompute** (one more forward per step, ≈ +33 % compute);
6. nothing fits: :class:`PlanError` says what is missing (how many GPUs, or that activations alone are too big).

**Which is fastest.** The ladder picks by traffic; :func:`rank` then predicts the step of every
layout that fits (:func:`candidates`: TP inside a node × PP × data parallel, × CP for a long
sequence, × EP for an MoE model) with the course's
step-time model on a named GPU node (``step_time.layout_step`` on ``step_time.H100_NODE`` by
default: published FLOP/s and link bandwidths, an assumed MFU — not the laptop's α–β), as
compute + exposed communication + bubble for one global batch, and orders them.
:func:`recommend` puts that ranking in the plan (``Plan.ranking``, ``Plan.fastest``,
``Plan.fastest_reason()``): memory decides what fits, the step-time model what is fastest among it.

Inputs that break a rule raise :class:`PlanError` naming it, e.g. ``num_heads=6 is not divisible by tp_size=4``.
All sizes are decimal (1 GB = 10⁹ bytes), as in the ZeRO paper.

This module is the model only; the ipywidgets form over :func:`recommend` is
``course_lib.viz.planner_widget`` (the view layer, with the other widgets).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .formulas import (
    activation_bytes_estimate,
    korthikanti_activation_bytes,
    pipeline_bubble,
    zero_model_state_breakdown,
)
from .context_parallel import ring_attention_saved_bytes
from .step_time import H100_NODE, NodeProfile, Prediction, layout_step

__all__ = [
    "PlanError",
    "Model",
    "Cluster",
    "Layout",
    "memory_per_gpu",
    "model_states_per_gpu",
    "attention_saved_bytes",
    "gpt_num_params",
    "recommend",
    "Plan",
    "zero_paper_table",
    "ZERO_NAMES",
    "check_layout",
    "candidates",
    "rank",
    "step_parts",
    "H100_NODE",
]

GB = 1e9
ZERO_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
RECOMPUTE = ("none", "selective", "full")


class PlanError(ValueError):
    """An input breaks a rule, or no layout fits; the message names the rule or what is missing."""


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name}={value!r} must be an int >= 1")


def gpt_num_params(config) -> int:
    """Parameters of ``models.GPT(config)``, counted from the config (the same number ``GPT.num_params()`` gives)."""
    h, r, V, L, bias = (
        config.d_model,
        config.mlp_ratio,
        config.vocab_size,
        config.n_layer,
        config.bias,
    )
    block = (4 + 2 * r) * h * h + 2 * h * (
        2 if bias else 1
    )  # Linear weights; two LayerNorms (weight, bias)
    block += (3 * h + h + r * h + h) if bias else 0  # Linear biases
    head = 0 if config.tie_weights else V * h
    return V * h + config.block_size * h + L * block + h + (h if bias else 0) + head


@dataclass(frozen=True)
class Model:
    """A transformer to place: Ψ ``params``, ``layers``, ``hidden`` size, attention ``heads``, ``seq_len``.

    ``vocab`` adds the loss's fp32 logits to the activations. ``config`` (a ``models.GPTConfig``, see
    :meth:`from_config`) lets ``precision="fp32"`` use the course model's derived activation bytes.
    """

    params: float
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int | None = None
    name: str = ""
    config: object = field(default=None, compare=False, repr=False)
    experts: int = 0
    top_k: int = 1
    expert_hidden: int = 0
    expert_bias: bool = False

    def __post_init__(self):
        if (
            isinstance(self.params, bool)
            or not isinstance(self.params, (int, float))
            or not self.params > 0
        ):
            raise PlanError(f"params={self.params!r} (the parameter count Ψ) must be a number > 0")
        for name in ("layers", "hidden", "heads", "seq_len"):
            _positive_int(name, getattr(self, name))
        if self.vocab is not None:
            _positive_int("vocab", self.vocab)
        if self.hidden % self.heads:
            raise PlanError(f"hidden={self.hidden} is not divisible by num_heads={self.heads}")
        if isinstance(self.experts, bool) or not isinstance(self.experts, int) or self.experts < 0:
            raise PlanError(f"experts={self.experts!r} must be an int >= 0 (0: a dense model)")
        if self.experts:
            _positive_int("top_k", self.top_k)
            _positive_int("expert_hidden", self.expert_hidden)
            if self.top_k > self.experts:
                raise PlanError(
                    f"top_k={self.top_k} exceeds experts={self.experts}: a token picks k "
                    f"different experts"
                )
            if self.expert_params >= self.params:
                raise PlanError(
                    f"the experts' {self.expert_params:,.0f} parameters (L · E · one expert) "
                    f"are not fewer than params={self.params:,.0f}: Ψ counts every parameter"
                )

    @property
    def expert_params(self) -> float:
        """Parameters of every expert of every layer: L · E · (2·h·f, + f + h with biases); 0 if dense.

        Every layer is an MoE layer (as the course's ``moe.MoEGPT``); an expert is an MLP of hidden
        size f = ``expert_hidden``.
        """
        f = self.expert_hidden
        one = 2 * self.hidden * f + ((f + self.hidden) if self.expert_bias else 0)
        return float(self.layers * self.experts * one) if self.experts else 0.0

    @property
    def active_params(self) -> float:
        """Parameters one token meets: Ψ less the experts it is not routed to (Ψ for a dense model)."""
        if not self.experts:
            return self.params
        return self.params - self.expert_params * (1 - self.top_k / self.experts)

    @classmethod
    def from_config(cls, config, name: str = "course GPT", moe=None) -> "Model":
        """The course's ``GPTConfig`` as a :class:`Model` (Ψ counted by :func:`gpt_num_params`).

        ``moe`` (a ``moe.MoEConfig``): the course's ``MoEGPT`` instead — every block's MLP
        becomes ``num_experts`` MLPs and a router (d_model × E, no bias).
        """
        psi = gpt_num_params(config)
        extra = {}
        if moe is not None:
            h, f = config.d_model, config.mlp_ratio * config.d_model
            mlp = 2 * h * f + ((f + h) if config.bias else 0)
            psi += config.n_layer * ((moe.num_experts - 1) * mlp + moe.num_experts * h)
            extra = dict(
                experts=moe.num_experts, top_k=moe.top_k, expert_hidden=f, expert_bias=config.bias
            )
        return cls(
            psi,
            config.n_layer,
            config.d_model,
            config.n_head,
            config.block_size,
            config.vocab_size,
            name,
            config,
            **extra,
        )

    def label(self) -> str:
        size = f"{self.params / 1e9:g}B" if self.params >= 1e8 else f"{self.params:,.0f}"
        moe = f", E = {self.experts} experts, top-{self.top_k}" if self.experts else ""
        return (
            f"{self.name + ': ' if self.name else ''}Ψ = {size} parameters, L = {self.layers}, "
            f"h = {self.hidden}, a = {self.heads}, s = {self.seq_len}{moe}"
        )


@dataclass(frozen=True)
class Cluster:
    """``nodes`` machines of ``gpus_per_node`` GPUs with ``gpu_memory_gb`` (decimal GB) each."""

    gpu_memory_gb: float
    gpus_per_node: int = 8
    nodes: int = 1

    def __post_init__(self):
        if (
            isinstance(self.gpu_memory_gb, bool)
            or not isinstance(self.gpu_memory_gb, (int, float))
            or not self.gpu_memory_gb > 0
        ):
            raise PlanError(f"gpu_memory_gb={self.gpu_memory_gb!r} must be a number > 0")
        _positive_int("gpus_per_node", self.gpus_per_node)
        _positive_int("nodes", self.nodes)

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def label(self) -> str:
        return (
            f"{self.nodes} node{'s' if self.nodes > 1 else ''} × {self.gpus_per_node} "
            f"GPU{'s' if self.gpus_per_node > 1 else ''} × {self.gpu_memory_gb:g} GB"
        )


@dataclass(frozen=True)
class Layout:
    """``dp`` × ``tp`` × ``pp`` × ``cp`` ranks; ZeRO stage ``zero``; activation ``recompute``; ``ep``.

    Five axes. ``cp``: context parallel — each rank holds S/c tokens of every sequence (ring
    attention, zig-zag layout, ``course_lib.context_parallel``); its weights are replicated, so a
    ZeRO stage shards them over the dp·cp ranks that hold them. ``ep``: expert parallel — each
    rank holds E/e of every MoE layer's experts (``course_lib.expert_parallel``). The rule chosen
    here is the usual MoE mesh's (Megatron-Core, torchtitan): **ep divides dp·cp** — the EP groups
    are carved out of the data × context ranks, which see different tokens — so the world stays
    dp·tp·pp·cp; the experts' states are then sharded by ZeRO over the dp·cp/ep ranks that hold
    the same experts. ``sequence_parallel`` defaults to on whenever ``tp > 1`` (Korthikanti et
    al.: it removes the activations TP alone leaves replicated).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    recompute: str = "selective"
    sequence_parallel: bool | None = None
    cp: int = 1
    ep: int = 1

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "cp", "ep"):
            _positive_int(f"{name}_size", getattr(self, name))
        if isinstance(self.zero, bool) or self.zero not in ZERO_NAMES:
            raise PlanError(f"zero_stage={self.zero!r} must be 0, 1, 2 or 3")
        if self.recompute not in RECOMPUTE:
            raise PlanError(f"recompute={self.recompute!r} must be one of {RECOMPUTE}")
        if (self.dp * self.cp) % self.ep:
            raise PlanError(
                f"ep_size={self.ep} does not divide dp_size × cp_size = {self.dp} × {self.cp}: "
                f"the expert-parallel groups are carved out of the data × context ranks"
            )

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def sp(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else bool(self.sequence_parallel)

    @property
    def replicas(self) -> int:
        """Ranks holding the same dense weights: dp · cp (ZeRO's group for them)."""
        return self.dp * self.cp

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts: dp · cp / ep (ZeRO's group for the experts' states)."""
        return self.dp * self.cp // self.ep

    def name(self) -> str:
        parts = []
        if self.tp > 1:
            parts.append(f"TP {self.tp}{' + SP' if self.sp else ''}")
        if self.cp > 1:
            parts.append(f"CP {self.cp}")
        if self.pp > 1:
            parts.append(f"PP {self.pp}")
        if self.ep > 1:
            parts.append(f"EP {self.ep}")
        dp = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3/FSDP"}[self.zero]
        if self.dp > 1 or not parts:
            parts.append(f"{dp} (dp {self.dp})")
        elif self.cp > 1:  # the cp ranks' replicated weights: reduced (and sharded) over them
            parts.append(f"{dp} (over cp)")
        text = ", ".join(parts)
        return text + (", full recompute" if self.recompute == "full" else "")


def check_layout(model: Model, layout: Layout, cluster: Cluster | None = None) -> None:
    """Raise :class:`PlanError` naming the first rule ``layout`` breaks for ``model`` (and ``cluster``)."""
    t, p, c, e = layout.tp, layout.pp, layout.cp, layout.ep
    if model.heads % t:
        raise PlanError(
            f"num_heads={model.heads} is not divisible by tp_size={t}: tensor parallelism gives each "
            f"rank whole attention heads"
        )
    if model.hidden % t:
        raise PlanError(f"hidden={model.hidden} is not divisible by tp_size={t}")
    if c > 1 and model.seq_len % (2 * c):
        raise PlanError(
            f"seq_len={model.seq_len} is not divisible by 2·cp_size={2 * c}: context parallelism "
            f"(zig-zag ring attention) cuts each sequence into 2·cp_size equal chunks"
        )
    if layout.sp and (model.seq_len // c) % t:
        raise PlanError(
            f"seq_len / cp_size = {model.seq_len // c} is not divisible by tp_size={t}: sequence "
            f"parallelism splits a rank's tokens over the TP ranks"
            if c > 1
            else f"seq_len={model.seq_len} is not divisible by tp_size={t}: sequence parallelism "
            f"splits the sequence over the TP ranks"
        )
    if model.layers % p:
        raise PlanError(
            f"layers={model.layers} is not divisible by pp_size={p}: equal pipeline stages"
        )
    if e > 1 and not model.experts:
        raise PlanError(
            f"ep_size={e} needs an MoE model (experts > 0): expert parallelism shards experts"
        )
    if model.experts and model.experts % e:
        raise PlanError(
            f"num_experts={model.experts} is not divisible by ep_size={e}: expert parallelism "
            f"gives every rank E/e whole experts"
        )
    if cluster is not None:
        if layout.world != cluster.gpus:
            cps = " × cp_size" if c > 1 else ""
            cpv = f" × {c}" if c > 1 else ""
            raise PlanError(
                f"dp_size × tp_size × pp_size{cps} = {layout.dp} × {t} × {p}{cpv} = {layout.world} "
                f"must equal the number of GPUs, nodes × gpus_per_node = {cluster.nodes} × "
                f"{cluster.gpus_per_node} = {cluster.gpus}"
            )
        if cluster.gpus_per_node % t:
            raise PlanError(
                f"tp_size={t} does not divide gpus_per_node={cluster.gpus_per_node}: a tensor-parallel "
                f"group must stay inside one node (4 all-reduces per layer need its fast links)"
            )


def model_states_per_gpu(model: Model, layout: Layout, precision: str = "mixed") -> dict:
    """Bytes of params / grads / optimizer per GPU (and ``total``), dense part and experts apart.

    The ZeRO formula (``formulas.zero_model_state_breakdown``) twice: the dense parameters
    Ψ_dense/(t·p) sharded by stage ``zero`` over the dp·cp ranks that hold them; the experts'
    Ψ_E/(t·p·e) over the dp·cp/e ranks that hold the same experts. Returns ``params``, ``grads``,
    ``optimizer``, ``total`` and the same for each part under ``"dense"`` and ``"experts"``.
    """
    check_layout(model, layout)
    if precision not in ("mixed", "fp32"):
        raise PlanError(f"precision={precision!r} must be 'mixed' or 'fp32'")
    mp = layout.tp * layout.pp
    dense_psi = model.params - model.expert_params
    dense = zero_model_state_breakdown(dense_psi / mp, layout.replicas, layout.zero, precision)
    if not model.experts:  # the dense formula alone, as before experts existed
        return {**dense, "dense": dense}
    experts = zero_model_state_breakdown(
        model.expert_params / (mp * layout.ep), layout.expert_replicas, layout.zero, precision
    )
    out = {k: dense[k] + experts[k] for k in ("params", "grads", "optimizer", "total")}
    return {**out, "dense": dense, "experts": experts}


def attention_saved_bytes(
    model: Model, layout: Layout, *, micro_batch: int = 1, element_size: int = 2
) -> int:
    """Bytes one rank's ring attention saves for backward in one layer: q, k, v, out and lse.

    ``context_parallel.ring_attention_saved_bytes`` on this rank's heads (a/t) and tokens (S/c):
    the part of a layer's activations that chapter 07 measures at c = 1 and c = 2. Every other
    saved activation of a layer is per token as well, which is why :func:`memory_per_gpu` divides
    a layer's activations by c.
    """
    check_layout(model, layout)
    return ring_attention_saved_bytes(
        micro_batch,
        model.heads // layout.tp,
        model.seq_len,
        model.hidden // model.heads,
        layout.cp,
        element_size,
    )


def memory_per_gpu(
    model: Model,
    layout: Layout,
    *,
    micro_batch: int = 1,
    num_microbatches: int | None = None,
    precision: str = "mixed",
) -> dict:
    """Bytes per GPU of ``layout``: params / grads / optimizer (``model_states``), ``activations``, ``total``.

    Model states: :func:`model_states_per_gpu` (the ZeRO formula on Ψ/(t·p) over the dp·cp
    ranks; an MoE model's experts ÷ e as well, over dp·cp/e). Activations of one ``micro_batch``:
    ``precision="mixed"`` — Korthikanti et al. for L/p layers (TP t, sequence parallelism,
    recompute), times min(p, m) micro-batches alive on a 1F1B pipeline's first stage (m =
    ``num_microbatches``, default p), plus the loss's fp32 logits 4·s·b·V/t on the last stage
    (when ``vocab`` is known); ``precision="fp32"`` — the course GPT on one device, no recompute
    (``formulas.activation_bytes_estimate``; needs :meth:`Model.from_config` of a dense GPT and
    tp = pp = 1), what chapters 01 and 03 measured. Context parallelism divides all of it by c:
    a rank holds S/c tokens of each sequence, and ring attention keeps no other rank's K/V or
    S×S scores (:func:`attention_saved_bytes`). An MoE model's activations are counted as the
    dense model's (the experts' k·f hidden activations per token are not modelled).
    """
    check_layout(model, layout)
    _positive_int("micro_batch", micro_batch)
    p, t, c = layout.pp, layout.tp, layout.cp
    m = p if num_microbatches is None else num_microbatches
    _positive_int("num_microbatches", m)
    if precision not in ("mixed", "fp32"):
        raise PlanError(f"precision={precision!r} must be 'mixed' or 'fp32'")
    states = model_states_per_gpu(model, layout, precision)
    if precision == "fp32":
        if model.config is None or model.experts or t > 1 or p > 1 or layout.recompute != "none":
            raise PlanError(
                "precision='fp32' activations are derived for the course GPT on one device: pass "
                "Model.from_config(config) of a dense GPT with tp_size = pp_size = 1 and "
                "recompute='none'"
            )
        acts = activation_bytes_estimate(model.config, micro_batch, model.seq_len)["total"]
    else:
        per_mb = korthikanti_activation_bytes(
            model.seq_len,
            micro_batch,
            model.hidden,
            model.heads,
            model.layers // p,
            tensor_parallel=t,
            sequence_parallel=layout.sp,
            recompute=layout.recompute,
        )
        logits = 4 * model.seq_len * micro_batch * model.vocab / t if model.vocab else 0.0
        first = per_mb * min(p, m) + (logits if p == 1 else 0.0)
        acts = max(first, per_mb + logits)  # the first stage, or the last one with the loss
    if c > 1:
        acts = acts / c  # S/c tokens per rank
    out = {k: states[k] for k in ("params", "grads", "optimizer")}
    out.update(model_states=states["total"], activations=float(acts), total=states["total"] + acts)
    return out


def zero_paper_table(psi: float = 7.5e9, world_size: int = 64) -> dict[str, float]:
    """The ZeRO paper's example through the planner: model states per GPU in GB for DDP and ZeRO-1/2/3.

    Mixed-precision Adam, Ψ = 7.5B on 64 GPUs → 120 / 31.4 / 16.6 / 1.9 GB (model states only: the
    model's shape does not enter them, so a placeholder 1-layer shape is used).
    """
    model = Model(psi, 1, 64, 1, 1)
    return {
        ZERO_NAMES[z]: memory_per_gpu(model, Layout(dp=world_size, zero=z))["model_states"] / GB
        for z in range(4)
    }


# --------------------------------------------------------------------------- the recommendation


@dataclass
class Plan:
    """What :func:`recommend` found: the ``layout``, its ``memory`` (bytes), ``reasons``, every candidate tried.

    ``layout`` is the ladder's choice (the least communication that fits). ``ranking`` orders every
    layout that fits by predicted step time on ``profile`` (:func:`rank`), fastest first, as
    ``(Layout, memory dict, Prediction)``; ``fastest`` is its first layout. ``unranked`` says why
    the ranking is empty when it is.
    """

    model: Model
    cluster: Cluster
    layout: Layout
    memory: dict
    reasons: list[str]
    usable_bytes: float
    tried: list = field(default_factory=list)  # (Layout, memory dict, fits) in ladder order
    alternatives: list = field(default_factory=list)  # (Layout, memory dict, note) that also fit
    micro_batch: int = 1
    num_microbatches: int = 8
    ranking: list = field(default_factory=list)  # (Layout, memory dict, Prediction), fastest first
    profile: NodeProfile | None = None
    global_batch: int | None = None
    unranked: str = ""

    @property
    def fastest(self) -> Layout | None:
        """The layout with the shortest predicted step among those that fit (None if unranked)."""
        return self.ranking[0][0] if self.ranking else None

    def table(self) -> str:
        lines = [
            f"{'layout':<40} {'states GB':>9} {'acts GB':>8} {'total GB':>9}  "
            f"fits ≤ {self.usable_bytes / GB:.0f} GB"
        ]
        for lay, mem, fits in self.tried:
            mark = " ← chosen" if lay == self.layout else ""
            lines.append(
                f"{lay.name():<40} {mem['model_states'] / GB:>9.1f} {mem['activations'] / GB:>8.1f} "
                f"{mem['total'] / GB:>9.1f}  {'yes' if fits else 'no'}{mark}"
            )
        return "\n".join(lines)

    def _unit(self) -> tuple[float, str]:
        """Seconds, or milliseconds when the fastest step is under a second."""
        return (1.0, "s") if self.ranking[0][2].total >= 1 else (1e3, "ms")

    def ranking_table(self) -> str:
        """Rank, layout, GB per GPU, micro-batches per replica, predicted step (s) and its parts."""
        if not self.ranking:
            return f"no ranking: {self.unranked}"
        k, unit = self._unit()
        w = max([34] + [len(lay.name()) for lay, _, _ in self.ranking])
        lines = [
            f"{'#':>2} {'layout':<{w}} {'GB/GPU':>6} {'m':>4} {'step ' + unit:>8} {'compute':>8} "
            f"{'exp. comm':>9} {'bubble':>7}"
        ]
        for i, (lay, mem, pred) in enumerate(self.ranking, 1):
            c, e, b = (k * v for v in step_parts(pred).values())
            m = self.global_batch // (lay.dp * self.micro_batch)
            mark = " ← ladder" if lay == self.layout else ""
            lines.append(
                f"{i:>2} {lay.name():<{w}} {mem['total'] / GB:>6.1f} {m:>4} {k * pred.total:>8.3f} "
                f"{c:>8.3f} {e:>9.3f} {b:>7.3f}{mark}"
            )
        lines.append(
            f"(m: micro-batches per replica in a step of {self.global_batch} sequences; "
            f"step = compute + exposed communication + bubble, in {unit})"
        )
        return "\n".join(lines)

    def fastest_reason(self) -> str:
        """The fastest layout that fits, why (its parts against the next), on which node."""
        if not self.ranking:
            return f"no ranking: {self.unranked}"
        (lay, _, pred), n = self.ranking[0], len(self.ranking)
        parts = step_parts(pred)
        k, unit = self._unit()
        lines = [
            f"fastest predicted of the {n} layout{'s' if n > 1 else ''} that fit: {lay.name()}, "
            f"{k * pred.total:.3f} {unit} per step of {self.global_batch} sequences = "
            + " + ".join(f"{name} {k * v:.3f} {unit}" for name, v in parts.items())
        ]
        computes = [step_parts(p)["compute"] for _, _, p in self.ranking]
        if max(computes) - min(computes) <= 1e-9 * max(computes):
            lines.append(
                f"every layout that fits computes the same FLOPs per GPU "
                f"({k * computes[0]:.3f} {unit}): exposed communication and the bubble decide"
            )
        if n > 1:
            nxt_lay, _, nxt = self.ranking[1]
            gaps = [
                f"{name} {k * (v - parts[name]):+.3f} {unit}"
                + (f" (its largest: {_largest_comm(nxt, k, unit)})" if "comm" in name else "")
                for name, v in step_parts(nxt).items()
                if abs(v - parts[name]) >= 1e-4 * pred.total
            ]
            lines.append(
                f"next: {nxt_lay.name()}, {k * (nxt.total - pred.total):+.3f} {unit} "
                f"({nxt.total / pred.total - 1:+.1%}): " + ", ".join(gaps or ["no part differs"])
            )
        if lay != self.layout:
            i = next(i for i, (la, _, _) in enumerate(self.ranking, 1) if la == self.layout)
            lines.append(
                f"the ladder's choice (least traffic that fits), {self.layout.name()}, ranks {i} "
                f"({k * self.ranking[i - 1][2].total:.3f} {unit})"
            )
        prof = self.profile
        lines.append(
            f"a model, not a measurement: the course's step-time model (step_time.layout_step) "
            f"on {prof.name}: {prof.flops / 1e12:.0f} TFLOP/s peak per GPU at an assumed "
            f"{prof.mfu:.0%} MFU, {prof.intra_bw / 1e9:.0f} GB/s inside a node and "
            f"{prof.inter_bw / 1e9:.0f} GB/s across nodes each way"
        )
        return "\n  - ".join(lines)

    def __str__(self) -> str:
        return self.text()

    def text(self, ranking: bool = True) -> str:
        """The plan as text; ``ranking=False`` prints one line for the step-time ranking instead of its table."""
        mem = self.memory
        lines = [
            f"model:   {self.model.label()}",
            f"cluster: {self.cluster.label()} (usable "
            f"{self.usable_bytes / GB:.0f} GB per GPU); micro-batch {self.micro_batch}",
            f"→ {self.layout.name()}: {mem['total'] / GB:.1f} GB per GPU (model states "
            f"{mem['model_states'] / GB:.1f} + activations {mem['activations'] / GB:.1f})",
            "why:",
        ]
        lines += [f"  - {r}" for r in self.reasons]
        for lay, m, note in self.alternatives:
            lines.append(f"also fits: {lay.name()}: {m['total'] / GB:.1f} GB per GPU — {note}")
        lines += ["tried:", self.table()]
        if self.profile is not None and ranking:
            lines += [
                f"step time: {self.fastest_reason()}",
                f"ranked by predicted step time on {self.profile.name}:",
                self.ranking_table(),
            ]
        elif self.profile is not None and self.ranking:
            k, unit = self._unit()
            i = next(i for i, (la, _, _) in enumerate(self.ranking, 1) if la == self.layout)
            lines.append(
                f"step time (model, {self.profile.name}): fastest predicted {self.fastest.name()} "
                f"{k * self.ranking[0][2].total:.3f} {unit}; the ladder's choice ranks {i} of "
                f"{len(self.ranking)} ({k * self.ranking[i - 1][2].total:.3f} {unit})"
            )
        elif self.profile is not None:
            lines.append(f"step time: no ranking: {self.unranked}")
        return "\n".join(lines)

    __repr__ = __str__


def step_parts(pred: Prediction) -> dict[str, float]:
    """A predicted step in three parts: ``compute``, ``exposed communication``, ``bubble``.

    ``compute`` includes a ``recompute`` part; exposed communication is the rest of the total.
    """
    compute = pred.parts.get("compute", 0.0) + pred.parts.get("recompute", 0.0)
    bubble = pred.parts.get("bubble", 0.0)
    return {
        "compute": compute,
        "exposed communication": pred.total - compute - bubble,
        "bubble": bubble,
    }


def _largest_comm(pred: Prediction, scale: float = 1.0, unit: str = "s") -> str:
    """``pred``'s largest exposed-communication part, named, with its time (s × ``scale``)."""
    comm = {k: v for k, v in pred.parts.items() if k not in ("compute", "recompute", "bubble")}
    k = max(comm, key=comm.get)
    return f"{k} {scale * comm[k]:.3f} {unit}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


LONG_SEQUENCE = 16384
"""From this ``seq_len`` on, :func:`candidates` adds context parallelism (activations ∝ S fill the
memory; below it, the course's four axes are listed as before)."""


def candidates(model: Model, cluster: Cluster, recompute: str = "selective") -> list[Layout]:
    """Every layout of the course's techniques on ``cluster`` that :func:`check_layout` accepts.

    TP t inside a node (t divides ``gpus_per_node``, the heads, hidden and sequence), PP p
    dividing the layers, data parallel over the rest: DDP, ZeRO-2 or ZeRO-3 without a pipeline,
    ZeRO-1 with one (pipeline engines accumulate gradients over micro-batches; ZeRO-1 is what
    they pair with). ZeRO-1 without a pipeline sends ZeRO-2's bytes and saves less: left out,
    as the ladder leaves it out. Five axes: for a sequence of :data:`LONG_SEQUENCE` tokens or
    more, context parallel c over the ranks left after TP and PP (c ≤ ``gpus_per_node``, the
    sequence split into 2c chunks); for an MoE model, every expert-parallel e that divides the
    experts and dp·c (e = 1 included). A dense model of a shorter sequence gets the same list
    as with three axes.
    """
    out = []
    long = model.seq_len >= LONG_SEQUENCE
    for t in _divisors(cluster.gpus_per_node):
        if model.heads % t or model.hidden % t or model.seq_len % t:
            continue
        for p in _divisors(model.layers):
            if (cluster.gpus // t) % p:
                continue
            rest = cluster.gpus // (t * p)
            cps = [1]
            if long:
                cps = [
                    c
                    for c in _divisors(rest)
                    if c <= cluster.gpus_per_node
                    and model.seq_len % (2 * c) == 0
                    and (model.seq_len // c) % t == 0
                ]
            for c in cps:
                d = rest // c
                eps = (
                    [e for e in _divisors(d * c) if model.experts % e == 0]
                    if model.experts
                    else [1]
                )
                for e in eps:
                    stages = (0,) if d * c == 1 else (0, 2, 3) if p == 1 else (1,)
                    out += [
                        Layout(dp=d, tp=t, pp=p, zero=z, recompute=recompute, cp=c, ep=e)
                        for z in stages
                    ]
    return out


def rank(
    model: Model,
    cluster: Cluster,
    layouts: list[Layout] | None = None,
    *,
    profile: NodeProfile = H100_NODE,
    micro_batch: int = 1,
    global_batch: int | None = None,
    num_microbatches: int = 8,
    reserve: float = 0.1,
    recompute: str = "selective",
) -> list[tuple[Layout, dict, Prediction]]:
    """The ``layouts`` that fit, fastest predicted first: ``(Layout, memory dict, Prediction)``.

    Memory decides what fits (:func:`memory_per_gpu` ≤ the usable memory, as :func:`recommend`);
    among what fits, :func:`~course_lib.step_time.layout_step` on ``profile`` predicts a step:
    compute + exposed communication + bubble. ``layouts``: default :func:`candidates` (at
    ``recompute``); given ones must use all the cluster's GPUs (a TP group may cross nodes here,
    to see what that costs). Every layout trains the same ``global_batch`` sequences per step,
    default ``num_microbatches · micro_batch · gpus`` (the data-parallel-only layouts
    accumulate ``num_microbatches`` micro-batches); a pipeline's memory counts the micro-batches
    it then runs per replica.
    """
    _positive_int("micro_batch", micro_batch)
    _positive_int("num_microbatches", num_microbatches)
    if not 0 <= reserve < 1:
        raise PlanError(f"reserve={reserve!r} must be in [0, 1)")
    if profile.gpus_per_node != cluster.gpus_per_node:
        raise PlanError(
            f"profile {profile.name!r} has {profile.gpus_per_node} GPUs per node, the cluster "
            f"{cluster.gpus_per_node}: pass a NodeProfile of the cluster's node"
        )
    g = num_microbatches * micro_batch * cluster.gpus if global_batch is None else global_batch
    _positive_int("global_batch", g)
    if g % (micro_batch * cluster.gpus):
        raise PlanError(
            f"global_batch={g} must be a multiple of micro_batch × GPUs = "
            f"{micro_batch} × {cluster.gpus}: every data-parallel size must split it evenly"
        )
    usable = cluster.gpu_memory_gb * GB * (1 - reserve)
    fits = []
    for lay in candidates(model, cluster, recompute) if layouts is None else layouts:
        check_layout(model, lay)
        if lay.world != cluster.gpus:
            axes = "dp × tp × pp" + (" × cp" if lay.cp > 1 else "")
            raise PlanError(
                f"{lay.name()} uses {axes} = {lay.world} GPUs; the cluster has {cluster.gpus}"
            )
        m = g // (lay.dp * micro_batch)
        mem = memory_per_gpu(model, lay, micro_batch=micro_batch, num_microbatches=m)
        if mem["total"] <= usable:
            fits.append((lay, mem))
    preds = [
        layout_step(model, lay, profile, global_batch=g, micro_batch=micro_batch) for lay, _ in fits
    ]
    order = sorted(range(len(fits)), key=lambda i: preds[i].total)
    return [(*fits[i], preds[i]) for i in order]


def _tp_size(model: Model, cluster: Cluster) -> int:
    """The largest divisor of ``gpus_per_node`` that also divides the heads, hidden and sequence (≥ 1)."""
    return max(
        t
        for t in range(1, cluster.gpus_per_node + 1)
        if cluster.gpus_per_node % t == 0
        and model.heads % t == 0
        and model.hidden % t == 0
        and model.seq_len % t == 0
    )


def _ladder(model: Model, cluster: Cluster, recompute: str) -> list[tuple[Layout, str]]:
    g, t = cluster.gpus, _tp_size(model, cluster)
    steps = [
        (
            Layout(dp=g, zero=0, recompute=recompute),
            "DDP: the model states and activations fit on every GPU; one gradient all-reduce (2Ψ) per step, "
            "overlapped with backward, no change to the model",
        ),
        (
            Layout(dp=g, zero=2, recompute=recompute),
            "ZeRO-2 (DeepSpeed stage 2: gradients reduce-scattered in backward, the updated parameters "
            "all-gathered after the step): DDP's 16Ψ does not fit; sharding gradients and optimizer states "
            "costs no extra traffic (reduce-scatter + all-gather = 2Ψ)",
        ),
        (
            Layout(dp=g, zero=3, recompute=recompute),
            "ZeRO-3 / FSDP (fully_shard): ZeRO-2 does not fit; parameters sharded too, at 3Ψ of traffic",
        ),
    ]
    if g == 1:
        return steps[:1]  # one GPU: nothing to shard over
    if t > 1 and g > 1:
        for z in (2, 3):
            steps.append(
                (
                    Layout(dp=g // t, tp=t, zero=z, recompute=recompute),
                    f"TP {t} inside each node (Narayanan et al. 2021: tensor parallelism up to the GPUs of a "
                    f"node, where its 4 all-reduces per layer use fast links) with sequence parallelism, "
                    f"which divides the weights and the activations (that ZeRO does not shard) by {t}; "
                    f"{ZERO_NAMES[z]}{' / FSDP' if z == 3 else ' (DeepSpeed stage 2)'} over "
                    f"the {g // t} TP groups, across nodes",
                )
            )
    return steps


def _three_d(
    model: Model, cluster: Cluster, usable: float, micro_batch: int, m: int, recompute: str
):
    """TP inside the node × the smallest pipeline across nodes that fits × ZeRO-1 data parallel (or None)."""
    t = _tp_size(model, cluster)
    for p in range(2, cluster.nodes + 1):
        if cluster.nodes % p or model.layers % p:
            continue
        lay = Layout(dp=cluster.gpus // (t * p), tp=t, pp=p, zero=1, recompute=recompute)
        mem = memory_per_gpu(model, lay, micro_batch=micro_batch, num_microbatches=m)
        if mem["total"] <= usable:
            return lay, mem
    return None


def recommend(
    model: Model,
    cluster: Cluster,
    *,
    micro_batch: int = 1,
    num_microbatches: int = 8,
    reserve: float = 0.1,
    profile: NodeProfile | None = H100_NODE,
    global_batch: int | None = None,
) -> Plan:
    """Walk the ladder (module docstring) and return the first layout that fits, with the reasons.

    ``reserve``: the fraction of each GPU's memory kept free for the CUDA context, communication buffers
    and fragmentation. ``num_microbatches``: micro-batches per step of a pipeline (the 3D alternative's
    bubble). Raises :class:`PlanError` when nothing fits, saying what is missing.

    Then :func:`rank` orders every candidate that fits (at the recompute the ladder needed) by
    predicted step time on ``profile`` (a named GPU node; ``None``: no ranking) for ``global_batch``
    sequences per step: ``Plan.ranking``, ``Plan.fastest``, ``Plan.fastest_reason()``. A cluster
    whose nodes are not the profile's size is not ranked (``Plan.unranked`` says so).
    """
    _positive_int("micro_batch", micro_batch)
    _positive_int("num_microbatches", num_microbatches)
    if not 0 <= reserve < 1:
        raise PlanError(f"reserve={reserve!r} must be in [0, 1)")
    usable = cluster.gpu_memory_gb * GB * (1 - reserve)
    tried = []
    for recompute in ("selective", "full"):
        for lay, why in _ladder(model, cluster, recompute):
            mem = memory_per_gpu(model, lay, micro_batch=micro_batch)
            fits = mem["total"] <= usable
            tried.append((lay, mem, fits))
            if not fits:
                continue
            reasons = [why] if cluster.gpus > 1 else ["one GPU: plain training (a DDP of one) fits"]
            reasons += [
                f"{lay_.name()} would need {mem_['total'] / GB:.1f} GB per GPU (model states "
                f"{mem_['model_states'] / GB:.1f} + activations {mem_['activations'] / GB:.1f}) > "
                f"{usable / GB:.0f} GB usable"
                for lay_, mem_, _ in tried[:-1]
            ]
            if recompute == "full":
                reasons.append(
                    "full activation recompute: even with model parallelism the activations do not fit "
                    "otherwise; it costs one more forward per step (≈ +33 % compute)"
                )
            else:
                reasons.append(
                    "activations: selective recompute (FlashAttention-style attention keeps no s×s "
                    "scores), no full recompute needed"
                )
            plan = Plan(
                model, cluster, lay, mem, reasons, usable, tried, [], micro_batch, num_microbatches
            )
            if lay.tp > 1 and cluster.nodes > 1:
                alt = _three_d(model, cluster, usable, micro_batch, num_microbatches, recompute)
            else:
                alt = None
            if profile is not None:
                _rank_plan(plan, profile, global_batch, reserve)
            if alt:
                # the bubble at the m the ranking uses (a step of plan.global_batch sequences), so that
                # one layout has one m in the printout; without a ranking, num_microbatches
                p, g = alt[0].pp, plan.global_batch or global_batch
                m = g // (alt[0].dp * micro_batch) if g else num_microbatches
                where = f" (a step of {g} sequences)" if g else ""
                plan.alternatives.append(
                    (
                        *alt,
                        f"3D (Megatron-DeepSpeed): the pipeline crosses nodes with only "
                        f"boundary activations, ZeRO-1 data parallel; bubble "
                        f"(p−1)/(m+p−1) = {pipeline_bubble(p, m):.3f} at m = {m}{where}",
                    )
                )
            return plan
    raise PlanError(_missing(model, cluster, usable, micro_batch, reserve))


def _rank_plan(plan: Plan, profile: NodeProfile, global_batch: int | None, reserve: float):
    """Fill ``plan.ranking`` (or ``plan.unranked``) with :func:`rank` on ``profile``."""
    c, mb, m = plan.cluster, plan.micro_batch, plan.num_microbatches
    plan.profile = profile
    plan.global_batch = m * mb * c.gpus if global_batch is None else global_batch
    if profile.gpus_per_node != c.gpus_per_node:
        plan.unranked = (
            f"the profile's nodes ({profile.name}) have {profile.gpus_per_node} GPUs, this "
            f"cluster's {c.gpus_per_node}; pass profile= a NodeProfile of the cluster's node"
        )
        return
    plan.ranking = rank(
        plan.model,
        c,
        profile=profile,
        micro_batch=mb,
        global_batch=plan.global_batch,
        num_microbatches=m,
        reserve=reserve,
        recompute=plan.layout.recompute,
    )


def _missing(
    model: Model, cluster: Cluster, usable: float, micro_batch: int, reserve: float
) -> str:
    """What a model that fits nowhere needs: fewer activations, or how many GPUs."""
    t = _tp_size(model, cluster)
    acts = memory_per_gpu(model, Layout(tp=t, recompute="full"), micro_batch=micro_batch)[
        "activations"
    ]
    head = (
        f"{model.label()} does not fit on {cluster.label()} ({usable / GB:.0f} GB usable per GPU, "
        f"reserve {reserve:.0%}) with any layout, even ZeRO-3 with TP {t} and full recompute"
    )
    if acts >= usable:
        return (
            f"{head}: the activations alone need {acts / GB:.1f} GB per GPU — shorten seq_len or the "
            f"micro-batch, or split the sequence further (context parallelism)"
        )
    need = math.ceil(
        16 * model.params / (usable - acts)
    )  # ZeRO-3 over G GPUs: 16Ψ/G + activations ≤ usable
    nodes = math.ceil(need / cluster.gpus_per_node)
    return (
        f"{head}: the model states (16Ψ = {16 * model.params / GB:,.0f} GB in total, sharded) plus "
        f"{acts / GB:.1f} GB of activations per GPU (full recompute) need at least {need} GPUs of "
        f"{cluster.gpu_memory_gb:g} GB ({nodes} node{'s' if nodes > 1 else ''} of "
        f"{cluster.gpus_per_node}) instead of {cluster.gpus}; or offload "
        f"optimizer states and parameters to CPU/NVMe (ZeRO-Offload / ZeRO-Infinity)"
    )
