"""Mixture of experts (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021).

An MoE layer replaces the block's one MLP by E MLPs ("experts") and a router that sends every
token to k of them. Parameters grow E-fold, compute per token only k-fold. Read top to bottom:

1. **The router.** ``logits = x·Wᵀ`` (``router``: an ``nn.Linear(h, E, bias=False)``), softmax over
   the E experts in fp32, top-k: each token t gets experts ``e_t1 … e_tk`` and gates ``g_t1 … g_tk``.
   ``renormalize=True`` (Mixtral, Qwen3-MoE) divides the k gates by their sum, so they add to 1;
   ``False`` keeps the raw probabilities (Switch at k = 1: renormalised, its one gate would be
   the constant 1 and the router would learn from the auxiliary loss alone). :func:`route`.

2. **The experts.** Expert i is the tiny GPT's MLP (:class:`~course_lib.models.MLP`:
   ``c_proj(GELU(c_fc(x)))``). The layer's output for token t is ``Σ_j g_tj · expert_{e_tj}(x_t)``;
   the block adds it to the residual stream, as it adds the dense MLP's.

3. **Capacity and the drop rule.** An accelerator wants fixed-size buffers, so expert i takes at
   most ``C = ceil(capacity_factor · N · k / E)`` of the N·k assignments (:func:`expert_capacity`;
   ``capacity_factor=None``: no limit, nothing dropped). Which ones, when more arrive: the first C
   **in the global token order**. Tokens are numbered in the order of the flattened batch
   ``(B, T) → B·T``; under expert parallelism rank r holds batch chunk r, so that order is
   rank-major — every token of rank 0, then rank 1's, … Position of an assignment in its expert's
   queue = the number of earlier tokens routed to the same expert (a token picks an expert at most
   once, so the k choices of one token never compete): :func:`queue_positions`. An assignment at
   position ≥ C is **dropped**: it adds nothing to the token's output (the residual stream carries
   the token through unchanged) and its gate is not re-spread over the other k − 1. The rule needs
   only counts, so the expert-parallel layer (:mod:`course_lib.expert_parallel`) reproduces it
   exactly: each rank adds the counts of the ranks before it to its own positions. The order is a
   choice with a cost: the last ranks' tokens are the first dropped (GShard applies C per group of
   tokens instead, i.e. per rank; others drop the lowest gates first).

4. **The load-balancing loss** (Switch Transformer's): ``aux = E · Σ_i f_i · P_i`` with
   ``f_i`` = fraction of the N·k assignments routed to expert i (counted before drops; not
   differentiable) and ``P_i`` = mean router probability of expert i over the N tokens. It is 1
   when routing is uniform and grows as tokens crowd onto few experts; its gradient flows through
   ``P`` and pushes probability away from the crowded experts. The model's loss adds
   ``aux_loss_coef · Σ_layers aux`` to the cross-entropy. :func:`load_balancing_loss`.

5. **What the layer returns.** :class:`MoE` ``(x) → (y, aux, stats)``; ``stats``
   (:class:`RoutingStats`) holds tokens routed and kept per expert, the dropped assignments (a
   count and the (N, k) mask) and C.

6. **The tiny GPT with MoE blocks.** :class:`MoEGPT` is :class:`~course_lib.models.GPT` whose
   blocks' ``mlp`` is an :class:`MoE` (names stay ``blocks.{i}.mlp.router.weight``,
   ``blocks.{i}.mlp.experts.{j}.c_fc.weight``, …; initialised by ``GPT.init_weights``' rules).
   Its loss is cross-entropy + ``aux_loss_coef · Σ aux``.

7. **Imbalance and cost.** :func:`routing_history` trains a small MoE GPT and records tokens per
   expert and drops at every step (with and without the auxiliary loss, for the imbalance plot);
   :func:`expert_flops` is an expert's forward FLOPs for t tokens, and :func:`expert_parts` hands the
   experts to :class:`~course_lib.clock.AcceleratorClock` (``clock.apply(model, expert_parts(model))``)
   so each expert's modelled time follows the tokens routed to it: a hot expert slows its rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .configs import make_optimizer
from .models import MLP, GPT, Block, GPTConfig
from .train import step_batch, train_step

__all__ = [
    "MoEConfig",
    "RoutingStats",
    "route",
    "expert_capacity",
    "queue_positions",
    "dispatch_order",
    "load_balancing_loss",
    "MoE",
    "MoEBlock",
    "MoEGPT",
    "expert_flops",
    "expert_parts",
    "routing_history",
]


@dataclass
class MoEConfig:
    """E experts, top-k routing, capacity factor (None: no drops), the auxiliary loss's weight."""

    num_experts: int = 4
    top_k: int = 2
    capacity_factor: float | None = 1.25
    aux_loss_coef: float = 1e-2
    renormalize: bool = True  # gates of the k chosen experts divided by their sum

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first rule the config breaks."""
        for name in ("num_experts", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} exceeds num_experts={self.num_experts}: "
                "a token picks k different experts"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"capacity_factor={self.capacity_factor} must be > 0 (or None: no capacity, "
                "nothing dropped)"
            )
        if self.aux_loss_coef < 0:
            raise ValueError(f"aux_loss_coef={self.aux_loss_coef} must be >= 0")


@dataclass
class RoutingStats:
    """One MoE layer's routing in one forward (tensors detached, on the layer's device).

    ``tokens_per_expert`` / ``kept_per_expert``: assignments routed to / kept by each expert,
    over all the layer's tokens (under expert parallelism: the whole EP group's, the same on every
    rank); ``dropped``: assignments over capacity; ``dropped_mask``: (n, k), True where this
    rank's token t lost its j-th choice; ``capacity``: C. Under expert parallelism also
    ``kept_matrix`` (ep × E: kept per source rank and expert) and this rank's ``send_splits`` /
    ``recv_splits`` (tokens to / from each rank in the dispatch all-to-all).
    """

    tokens_per_expert: torch.Tensor
    kept_per_expert: torch.Tensor
    dropped: int
    dropped_mask: torch.Tensor
    capacity: int
    kept_matrix: torch.Tensor | None = None
    send_splits: list[int] | None = None
    recv_splits: list[int] | None = None


# =========================================================================== 1. the router


def route(
    x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(probs (N, E), gates (N, k), experts (N, k))`` for tokens ``x`` (N, h): softmax, then top-k."""
    probs = F.linear(x, router_weight).float().softmax(dim=-1)
    gates, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return probs, gates.to(x.dtype), experts


# =========================================================================== 3. capacity


def expert_capacity(
    num_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None
) -> int:
    """C = ceil(capacity_factor · N · k / E); without a factor, N (a token picks an expert once)."""
    if capacity_factor is None:
        return num_tokens
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (or None: no drops)")
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def queue_positions(
    experts: torch.Tensor, num_experts: int, offset: torch.Tensor | None = None
) -> torch.Tensor:
    """(N, k): each assignment's place in its expert's queue, in token order, after ``offset``.

    ``offset`` (E,): assignments already queued by earlier tokens (under expert parallelism: the
    ranks before this one). Kept = position < C.
    """
    onehot = F.one_hot(experts, num_experts)  # (N, k, E)
    per_token = onehot.sum(dim=1)  # (N, E): 0 or 1
    before = per_token.cumsum(dim=0) - per_token  # earlier tokens routed to each expert
    if offset is not None:
        before = before + offset
    return before.gather(1, experts)


def dispatch_order(experts: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Indices into the flattened (N·k) assignments: the kept ones, by expert, in token order within each.

    Experts' ids are contiguous per rank, so under expert parallelism this order also groups the
    tokens by destination rank: the send buffer of the dispatch all-to-all.
    """
    flat = experts.flatten()
    kept = keep.flatten().nonzero().squeeze(1)
    return kept[flat[kept].argsort(stable=True)]


# =========================================================================== 4. the auxiliary loss


def load_balancing_loss(fractions: torch.Tensor, mean_probs: torch.Tensor) -> torch.Tensor:
    """Switch's ``E · Σ_i f_i · P_i``: 1 for uniform routing, up to E when one expert takes everything."""
    return fractions.numel() * (fractions.to(mean_probs.dtype) * mean_probs).sum()


# =========================================================================== 2., 5. the layer


def _run_experts(experts, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Expert i on its ``counts[i]`` consecutive rows of ``xs``; every expert runs (an empty one too)."""
    return torch.cat(
        [expert(chunk) for expert, chunk in zip(experts, xs.split(counts), strict=True)]
    )


class MoE(nn.Module):
    """The one-device MoE layer: ``forward(x (…, h)) → (y (…, h), aux, RoutingStats)``."""

    def __init__(self, config: GPTConfig, moe: MoEConfig):
        super().__init__()
        moe.validate()
        self.d_model, self.moe = config.d_model, moe
        self.router = nn.Linear(config.d_model, moe.num_experts, bias=False)
        self.experts = nn.ModuleList([MLP(config) for _ in range(moe.num_experts)])

    def forward(self, x: torch.Tensor):
        if x.shape[-1] != self.d_model:
            raise ValueError(
                f"input has last dimension {x.shape[-1]}, expected d_model={self.d_model}"
            )
        m, shape = self.moe, x.shape
        x = x.reshape(-1, shape[-1])
        n, E, k = x.shape[0], m.num_experts, m.top_k
        probs, gates, experts = route(x, self.router.weight, k, m.renormalize)
        routed = torch.bincount(experts.flatten(), minlength=E)
        C = expert_capacity(n, E, k, m.capacity_factor)
        keep = queue_positions(experts, E) < C
        order = dispatch_order(experts, keep)
        kept = torch.bincount(experts.flatten()[order], minlength=E)
        out = _run_experts(self.experts, x[order // k], kept.tolist())
        y = x.new_zeros(x.shape).index_add(0, order // k, out * gates.flatten()[order, None])
        aux = load_balancing_loss(routed / (n * k), probs.mean(dim=0))
        stats = RoutingStats(routed, kept, int(n * k - kept.sum()), ~keep, C)
        return y.view(shape), aux, stats

    def extra_repr(self) -> str:
        m = self.moe
        return f"experts={m.num_experts}, top_k={m.top_k}, capacity_factor={m.capacity_factor}"


# =========================================================================== 6. the tiny GPT with MoE blocks


class MoEBlock(Block):
    """:class:`~course_lib.models.Block` whose ``mlp`` is an MoE layer; keeps its last ``aux_loss`` and ``stats``."""

    def __init__(self, config: GPTConfig, moe: MoEConfig):
        super().__init__(config)
        self.mlp = MoE(config, moe)
        self.aux_loss, self.stats = None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        y, self.aux_loss, self.stats = self.mlp(self.ln_2(x))
        return x + y


class MoEGPT(GPT):
    """The tiny GPT with an MoE layer in every block; loss = cross-entropy + ``aux_loss_coef · Σ aux``.

    Built as :class:`~course_lib.models.GPT` (same seed rules: a private generator, the caller's
    RNG untouched), then its blocks are replaced by :class:`MoEBlock` and every weight is drawn
    again by ``init_weights`` — the router and ``c_fc`` ~ N(0, 0.02), ``c_proj`` ~ N(0, 0.02/√2L).
    """

    def __init__(self, config: GPTConfig, moe: MoEConfig, *, seed: int | None = 0):
        super().__init__(config, seed=seed)
        moe.validate()
        self.moe = moe
        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            self.blocks = nn.ModuleList([MoEBlock(config, moe) for _ in range(config.n_layer)])
        self.init_weights(seed)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        logits, loss = super().forward(idx, targets)
        if loss is not None:
            loss = loss + self.moe.aux_loss_coef * sum(b.aux_loss for b in self.blocks)
        return logits, loss

    def routing_stats(self) -> list[RoutingStats]:
        """Each block's :class:`RoutingStats` from the last forward."""
        return [b.stats for b in self.blocks]


# =========================================================================== 7. imbalance and cost


def expert_flops(tokens: int, d_model: int, hidden: int) -> int:
    """One expert's forward FLOPs for ``tokens`` rows: c_fc 2·t·d·hidden, c_proj the same (as the clock counts)."""
    return 2 * 2 * tokens * d_model * hidden


def expert_parts(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(name, expert, "block")`` of every expert this process holds, for ``AcceleratorClock.apply``.

    Names are the experts' global ids (``blocks.0.mlp.experts.5``), on one device and under expert
    parallelism alike. Cost the experts alone: costed modules do not nest, so with the blocks
    costed too the block's (outer) cost would take the experts' FLOPs at the block's output.
    """
    parts = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if isinstance(module, nn.Module) and isinstance(experts, (nn.ModuleList, nn.ModuleDict)):
            items = experts.items() if isinstance(experts, nn.ModuleDict) else enumerate(experts)
            prefix = f"{name}.experts" if name else "experts"
            parts += [(f"{prefix}.{i}", e, "block") for i, e in items]
    if not parts:
        raise ValueError(f"{type(model).__name__} holds no MoE experts")
    return parts


def routing_history(
    config: GPTConfig,
    moe: MoEConfig,
    steps: int,
    batch_size: int,
    optimizer: str = "adamw",
    *,
    seed: int = 0,
    dev=None,
    router_std: float | None = None,
    **optimizer_overrides,
) -> dict:
    """Train an :class:`MoEGPT` on one device for ``steps`` steps; record its routing at every step.

    Returns ``{"tokens_per_expert": (steps, L, E), "dropped": (steps, L), "capacity": C,
    "loss": [steps]}`` (counts of the forward of each step, before its update). Run it with
    ``moe.aux_loss_coef = 0`` and > 0 to see what the auxiliary loss does to the balance.
    ``router_std`` draws the routers again ~ N(0, router_std) (seeded by ``seed + 1``: the same
    in every run), wider than the GPT's 0.02 init, so routing starts decided.
    """
    model = MoEGPT(config, moe, seed=seed)
    if router_std is not None:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for block in model.blocks:
                w = block.mlp.router.weight
                w.copy_(torch.randn(w.shape, generator=gen) * router_std)
    if dev is not None:
        model = model.to(dev)
    dev = model.wte.weight.device
    opt = make_optimizer(optimizer, model.parameters(), **optimizer_overrides)
    tokens, dropped, losses = [], [], []
    for step in range(steps):
        losses.append(train_step(model, opt, *step_batch(step, config, batch_size, dev)))
        stats = model.routing_stats()
        tokens.append(torch.stack([s.tokens_per_expert.cpu() for s in stats]))
        dropped.append(torch.tensor([s.dropped for s in stats]))
    return {
        "tokens_per_expert": torch.stack(tokens),
        "dropped": torch.stack(dropped),
        "capacity": stats[0].capacity,
        "loss": losses,
    }
