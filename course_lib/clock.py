"""A modelled accelerator clock: the model's compute costs modelled time, as a sleep.

Why. On a 2-core laptop the ranks' compute and gloo's communication threads fight for the same
cores, so what the course teaches — overlap hides the all-reduce, buckets trade latency for
overlap, prefetch hides the all-gather, TP's all-reduces sit on the critical path, recomputation
costs a forward — is at or below the noise. On a GPU node the accelerator computes while the
communication threads and the network are free. The clock models that: every costed module of
the model also *sleeps* its modelled compute time, while the real (small, CPU) computation still
produces the exact numbers every equality test checks. During the sleep gloo's threads run.

    clock = AcceleratorClock(2e9)      # 2 GFLOP/s of modelled accelerator
    clock.apply(model)                 # before DDP / Zero3 / fully_shard / a pipeline split
    with clock.paused(): ...           # real time for a while; or clock.enabled = False

The contract
------------
* What costs. ``apply(model)`` wraps the MODEL, never a technique: its blocks (``model.blocks``,
  a ModuleList or ModuleDict; a Sequential's layers), its embeddings (``wte``, ``wpe``) and its
  head (``lm_head``), which also carries the loss on its logits. Our DDP / ZeRO / Zero3 /
  pipeline / TP and torch DDP / FSDP2 then run under the same clock, because they run the model.
* Where it lands. Each costed call adds one identity ``torch.autograd.Function`` on the module's
  output: its forward sleeps the forward cost, its backward sleeps the backward cost (2× the
  forward FLOPs) — so the costs land where autograd runs them. Backward sleeps *before* the
  module's own backward ops, so its gradients become ready after its modelled backward, as on
  a GPU. Activation checkpointing (``torch.utils.checkpoint``, ``use_reentrant=False``) re-runs
  the module and sleeps its forward again: the Function saves one empty tensor, so checkpoint's
  early stop recomputes up to it, and unpacking it in backward is what triggers the recompute.
* What it costs. FLOPs counted as the module runs, from the shapes this rank really computes
  with (a ``TorchFunctionMode`` sees every matmul): ``F.linear`` and ``@`` cost
  2 · (output elements) · (contracted length); attention (``scaled_dot_product_attention``)
  2·2·B·a·T·S·hd, i.e. 2·2·B·T²·d for self-attention, causal mask not discounted (as Megatron
  counts); an embedding lookup one per output element; the loss 3 per logit (exp, sum, log).
  A tensor-parallel shard computes 1/t of the columns, so it costs 1/t; a pipeline stage costs
  only its blocks; under ZeRO-3 / FSDP the weights are whole while the module runs, so it costs
  the whole layer. Seconds = FLOPs / rate. ``spend(flops)`` costs an algorithm step that is not
  a module (a ring step, an expert, a zero-bubble W step). ``backward_factor`` (default 2) is
  what a backward sleeps per forward FLOP: a zero-bubble schedule's B sets 1 (input gradient).
* How it sleeps. Until a deadline kept across calls: each ``time.sleep`` wakes ~0.1 ms late, and
  the next sleep is shortened by that overshoot, so 1000 sleeps of 1 ms take 1 s, not 1.1 s.
  The Python thread is blocked while it sleeps — unlike a real host, which runs ahead and
  enqueues more kernels, it cannot issue the next collective early. The sleeps are excluded
  from compiled regions (``torch.compiler.disable``) and labelled for the profiler
  (``clock: blocks.0 fwd``).
* Which rate. :func:`calibrate` measures the real forward+backward time of each block at a batch
  and returns a rate at which every block sleeps ≥ ``ratio`` (default 10) × its real compute.
* One switch. Off on CUDA (real time: the GPU's own clock) unless ``force=True``; ``clock.name``
  is ``"modelled accelerator clock, 2.0 GFLOP/s"`` or ``"real clock"`` for tables and plots.
  ``clock.slept`` is this rank's modelled seconds so far (``forward``, ``backward``, ``spent``),
  ``clock.seconds`` / ``clock.calls`` the same per label; ``reset()`` zeros them.
* Numerics. The Functions are identities: losses and gradients are bit-for-bit the same with
  the clock on and off.

Don't toggle the clock between a checkpointed forward and its backward (the recompute would add
a Function the forward did not have).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "AcceleratorClock",
    "Calibration",
    "calibrate",
    "costed_parts",
    "count_flops",
    "models_time",
    "format_rate",
]

BACKWARD_FACTOR = 2  # backward = grad of the input + grad of the weights: 2× the forward's matmuls
LOSS_FLOPS_PER_LOGIT = 3  # softmax cross-entropy: exp, sum, log


def models_time(device_type: str, force: bool = False) -> bool:
    """Does the clock sleep on this device type? Not on ``"cuda"`` (real time) unless forced."""
    return force or device_type != "cuda"


def format_rate(flops_per_s: float) -> str:
    """``2e9`` → ``"2.0 GFLOP/s"``, ``5e8`` → ``"0.5 GFLOP/s"``, ``3e13`` → ``"30.0 TFLOP/s"``,
    ``6.4e3`` → ``"6.4 kFLOP/s"`` (the tiny stages of chapter 05 sleep milliseconds on a few FLOPs)."""
    if flops_per_s >= 1e12:
        return f"{flops_per_s / 1e12:.1f} TFLOP/s"
    if flops_per_s >= 1e8:
        g = flops_per_s / 1e9
        return f"{g:.1f} GFLOP/s" if g >= 1 else f"{g:.2g} GFLOP/s"
    for scale, unit in ((1e6, "MFLOP/s"), (1e3, "kFLOP/s")):
        if flops_per_s >= scale:
            return f"{flops_per_s / scale:.2g} {unit}"
    return f"{flops_per_s:.2g} FLOP/s"


# --------------------------------------------------------------------------- counting FLOPs


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank computes with (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _matmul_flops(out, a, *_):
    return 2 * _local(out).numel() * _local(a).shape[-1]


def _linear_flops(out, x, *_):
    return 2 * _local(out).numel() * _local(x).shape[-1]


def _attention_flops(out, q, k, *_):
    # q·kᵀ and p·v: 2·2·B·a·T·S·hd; out is (B, a, T, hd), k is (B, a, S, hd)
    return 2 * 2 * _local(out).numel() * _local(k).shape[-2]


def _embedding_flops(out, *_):
    return _local(out).numel()


_FLOPS = {
    F.linear: _linear_flops,
    torch.matmul: _matmul_flops,
    torch.Tensor.matmul: _matmul_flops,
    torch.Tensor.__matmul__: _matmul_flops,
    torch.mm: _matmul_flops,
    torch.bmm: _matmul_flops,
    F.scaled_dot_product_attention: _attention_flops,
    F.embedding: _embedding_flops,
}


class _FlopCounter(TorchFunctionMode):
    """Adds up the FLOPs of the matmuls, attentions and lookups that run while it is active."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        rule = _FLOPS.get(func)
        if rule is not None:
            self.flops += rule(out, *args)
        return out


def count_flops(fn, *args, **kwargs) -> tuple[object, int]:
    """``(fn(*args, **kwargs), forward FLOPs)`` counted the way the clock counts them."""
    with _FlopCounter() as counter:
        out = fn(*args, **kwargs)
    return out, counter.flops


def costed_parts(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(name, module, kind)`` for what the clock costs: blocks, embeddings, head (+ the loss).

    A GPT-shaped model (``blocks``, ``wte``, ``wpe``, ``lm_head``, also the TP GPT and a pipeline
    stage) or a ``Sequential`` (each layer a block).
    """
    parts = []
    for name in ("wte", "wpe"):
        if isinstance(getattr(model, name, None), nn.Module):
            parts.append((name, getattr(model, name), "embedding"))
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        parts += [(f"blocks.{i}", b, "block") for i, b in enumerate(blocks)]
    elif isinstance(blocks, nn.ModuleDict):
        parts += [(f"blocks.{k}", b, "block") for k, b in blocks.items()]
    elif isinstance(model, nn.Sequential):
        parts += [(str(i), layer, "block") for i, layer in enumerate(model)]
    if isinstance(getattr(model, "lm_head", None), nn.Module):
        parts.append(("lm_head", model.lm_head, "head"))
    if not any(kind == "block" for _, _, kind in parts):
        raise ValueError(
            f"{type(model).__name__} has no blocks to cost: the clock wraps a model "
            "with `blocks` (ModuleList / ModuleDict) or an nn.Sequential"
        )
    return parts


# --------------------------------------------------------------------------- the clock


class _Cost(torch.autograd.Function):
    """Identity on a costed module's outputs: forward sleeps its forward cost, backward 2× that."""

    @staticmethod
    def forward(ctx, clock, label, flops, anchor, *outputs):
        ctx.clock, ctx.label, ctx.flops = clock, label, flops
        ctx.save_for_backward(anchor)  # empty: checkpoint's recompute runs up to here
        clock.sleep(flops, f"{label} fwd", "forward")
        return tuple(o.view_as(o) for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        (_anchor,) = ctx.saved_tensors  # under checkpoint: re-runs the forward (and its sleep)
        ctx.clock.sleep(ctx.clock.backward_factor * ctx.flops, f"{ctx.label} bwd", "backward")
        return (None, None, None, None, *grads)


class AcceleratorClock:
    """Modelled compute time at ``rate_flops_per_s``; see the module docstring for the contract.

    ``device`` (default: this rank's, :func:`course_lib.launch.device`) decides whether it sleeps:
    not on CUDA unless ``force``.
    """

    def __init__(self, rate_flops_per_s: float, *, device=None, force: bool = False):
        if not rate_flops_per_s > 0:
            raise ValueError(f"rate_flops_per_s={rate_flops_per_s!r} must be > 0")
        if device is None:
            from .launch import device as rank_device

            device = rank_device()
        self.rate = float(rate_flops_per_s)
        # × the forward's FLOPs that a backward through a costed module sleeps; a zero-bubble B
        # (input gradient only) sets 1 and costs the weight gradient W with ``spend``
        self.backward_factor = BACKWARD_FACTOR
        self.enabled = models_time(torch.device(device).type, force)
        self._late = 0.0  # how far the last sleep overran its deadline (s): the next is shorter
        self._open = None  # the costed module running now, with its FLOP counter
        self._handles, self._modules = [], []
        self.reset()

    @property
    def name(self) -> str:
        if not self.enabled:
            return "real clock"
        return f"modelled accelerator clock, {format_rate(self.rate)}"

    @property
    def late(self) -> float:
        """How far the last sleep overran its deadline (s): the next sleep is that much shorter."""
        return self._late

    def __repr__(self) -> str:
        return f"AcceleratorClock({self.name})"

    def reset(self) -> None:
        """Zero the record: ``slept`` by phase, ``seconds`` and ``calls`` by label."""
        self.slept = {"forward": 0.0, "backward": 0.0, "spent": 0.0}
        self.seconds: Counter = Counter()
        self.calls: Counter = Counter()

    @contextmanager
    def paused(self):
        """Real time inside the block (nothing sleeps, nothing is counted)."""
        was, self.enabled = self.enabled, False
        try:
            yield self
        finally:
            self.enabled = was

    # ------------------------------------------------------------------ sleeping

    def seconds_for(self, flops: float) -> float:
        return flops / self.rate

    @torch.compiler.disable
    def sleep(self, flops: float, label: str, phase: str) -> None:
        """Sleep ``flops / rate`` seconds (less the last overrun); record it under ``label``."""
        if not self.enabled or flops <= 0:
            return
        seconds = self.seconds_for(flops)
        deadline = time.perf_counter() + seconds - self._late
        with torch.profiler.record_function(f"clock: {label}"):
            while (now := time.perf_counter()) < deadline:
                time.sleep(deadline - now)
        self.slept[phase] += seconds
        self.seconds[label] += seconds
        self.calls[label] += 1
        self._late = time.perf_counter() - deadline  # this call's overshoot and overhead: paid next

    def spend(self, flops: float, label: str = "spent") -> None:
        """Cost an algorithm step that is not a module (a ring step, an expert, a B or W step)."""
        self.sleep(flops, label, "spent")

    # ------------------------------------------------------------------ wrapping the model

    def apply(self, model: nn.Module, parts=None) -> nn.Module:
        """Cost ``model``'s blocks, embeddings and head (``parts``: default :func:`costed_parts`).

        Apply it to the model before a technique wraps or splits it; returns the model."""
        for name, module, kind in costed_parts(model) if parts is None else parts:
            if getattr(module, "_accelerator_clock", None) is not None:
                raise ValueError(f"{name} is already under a clock")
            module._accelerator_clock = self
            self._modules.append(module)
            self._handles += [
                module.register_forward_pre_hook(self._start),
                module.register_forward_hook(self._finisher(name, kind), always_call=True),
            ]
        return model

    def remove(self) -> None:
        """Take the clock off every module it was applied to."""
        for handle in self._handles:
            handle.remove()
        for module in self._modules:
            module._accelerator_clock = None
        self._handles, self._modules = [], []

    @torch.compiler.disable
    def _start(self, module, args) -> None:
        if self.enabled and self._open is None:  # costed modules do not nest: the outer one counts
            counter = _FlopCounter()
            counter.__enter__()
            self._open = (module, counter)

    def _finisher(self, name: str, kind: str):
        @torch.compiler.disable
        def finish(module, args, output):
            if self._open is None or self._open[0] is not module:
                return None
            counter = self._open[1]
            counter.__exit__(None, None, None)
            self._open = None
            if output is None:  # the forward raised: always_call closes the counter, nothing else
                return None
            outs = [output] if isinstance(output, torch.Tensor) else list(output)
            at = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor)]
            flops = counter.flops
            if kind == "head":  # the loss reads the head's logits
                flops += LOSS_FLOPS_PER_LOGIT * _local(outs[at[0]]).numel()
            anchor = torch.empty(0, device=outs[at[0]].device)
            timed = _Cost.apply(self, name, flops, anchor, *[outs[i] for i in at])
            for i, t in zip(at, timed, strict=True):
                outs[i] = t
            if isinstance(output, torch.Tensor):
                return outs[0]
            return tuple(outs) if isinstance(output, tuple) else outs

        return finish


# --------------------------------------------------------------------------- calibration


@dataclass
class Calibration:
    """A rate at which each block sleeps ≥ ``ratio`` × its measured real forward+backward time."""

    rate: float  # FLOP/s
    ratio: float  # modelled / real for the worst block at that rate
    real_s: list  # each block's real forward+backward seconds (median)
    flops: list  # each block's forward FLOPs

    def __str__(self) -> str:
        return (
            f"{format_rate(self.rate)}: every block sleeps ≥ {self.ratio:.1f}× its real "
            f"compute ({max(self.real_s) * 1e3:.2f} ms at most)"
        )


def _time_block(block: nn.Module, x: torch.Tensor, repeats: int) -> tuple[float, int]:
    """Median real forward (FLOPs counted, as under the clock) + backward seconds of one block."""
    times, flops = [], 0
    for i in range(repeats + 1):  # the first is a warm-up
        xi = x.detach().requires_grad_(True)
        t0 = time.perf_counter()
        y, flops = count_flops(block, xi)
        y.backward(torch.ones_like(y))
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), flops


def calibrate(
    model: nn.Module, *inputs, ratio: float = 10.0, margin: float = 2.0, repeats: int = 5
) -> Calibration:
    """Measure each block's real forward+backward at ``model(*inputs)``; rate for ``ratio`` × that.

    ``margin`` (default 2) leaves room for timing noise: the rate is chosen for ``ratio · margin``.
    A clock already on the model is paused meanwhile; the blocks are left without gradients.
    """
    parts = costed_parts(model)
    blocks = [(name, m) for name, m, kind in parts if kind == "block"]
    clocks = {getattr(m, "_accelerator_clock", None) for _, m, _ in parts} - {None}
    seen = {}

    def keep(name):
        return lambda module, args: seen.setdefault(name, args[0].detach())

    with ExitStack() as paused:
        for clock in clocks:
            paused.enter_context(clock.paused())
        handles = [m.register_forward_pre_hook(keep(n)) for n, m in blocks]
        try:
            with torch.no_grad():
                model(*inputs)
        finally:
            for h in handles:
                h.remove()
        real, flops = zip(*[_time_block(m, seen[n], repeats) for n, m in blocks], strict=True)
    for _, m in blocks:  # the timing runs left gradients on the blocks' parameters
        for p in m.parameters():
            p.grad = None
    modelled_at_1 = [(1 + BACKWARD_FACTOR) * f for f in flops]  # seconds at 1 FLOP/s
    rate = min(m / (ratio * margin * r) for m, r in zip(modelled_at_1, real, strict=True))
    worst = min(m / rate / r for m, r in zip(modelled_at_1, real, strict=True))
    return Calibration(rate, worst, list(real), list(flops))
