"""Pipeline parallelism from scratch: stages, schedules (GPipe, 1F1B, interleaved 1F1B), a runner.

Read top to bottom:

1. **Stages** — :func:`balanced_split` and :func:`split_gpt` cut the course GPT into ``p`` stages of
   consecutive blocks (the first stage also holds the embeddings, the last ``ln_f`` + ``lm_head``),
   each a :class:`GPTStage` whose parameters keep their names in the full model. The model must be
   **untied** (``experiments.common.parallel_config``): with tied weights the embedding (first
   stage) and the output head (last stage) are one tensor on two ranks, and its two gradient halves
   would have to be all-reduced between those ranks after every step (what Megatron does). Untied,
   every parameter lives on exactly one stage and nothing but activations crosses stages.
2. **Schedules** (``pipeline_schedules.py``, re-exported here) — a schedule is one stage's ordered
   list of :class:`Action` ``(op, microbatch, chunk)``: ``op`` "F" (forward), "B" (backward) or "W"
   (zero bubble's weight gradient). :func:`gpipe` runs all forwards, then all backwards (Huang et al.
   2019); :func:`one_f_one_b` warms up with ``p − 1 − stage`` forwards, then alternates one forward and
   one backward (PipeDream-Flush, Narayanan et al. 2021), so at most ``p − stage`` micro-batches are
   alive; :func:`interleaved_one_f_one_b` gives each rank ``v`` chunks (virtual stages ``chunk·p +
   rank``) and cuts the bubble to ``(p−1)/(v·m+p−1)`` (Megatron-LM, Narayanan et al. 2021 §2.2.2);
   :func:`zero_bubble` (ZB-H1, Qi et al. 2023) splits backward into "B" (input gradient) and "W"
   (weight gradient) and fills idle time with the W's (:func:`backward_input`,
   :func:`backward_weight`). :func:`check_schedule` (one stage's rules) and :func:`simulate` (the
   dependencies across stages, with unit costs) reject a schedule that cannot run.
3. **The runner** — :class:`PipelineRunner` executes a schedule with real activations sent forward
   and gradients sent backward, accumulates gradients over micro-batches and divides them by ``m``
   (torch's ``scale_grads=True``). Before each action it posts the previous action's send and this
   action's receive **together** (``dist.batch_isend_irecv``, as Megatron-LM does), through
   ``comm``'s wrappers so that :class:`~course_lib.comm.CommLog` counts the bytes. It measures
   nothing itself.
4. **Observers** — what measures a step attaches from outside through :class:`PipelineObserver`
   (hooks around every F, B and wait, and a context around every forward): :class:`Timeline`
   (:class:`Event` s, for :func:`bubble_fractions` and Gantt charts), :class:`LiveMicrobatches` and
   :class:`LiveActivationMeter` — the bytes autograd saved for backward and has *not yet released*
   (a saved tensor leaves the count when the backward that used it has run), so GPipe's ``m`` live
   micro-batches and 1F1B's ``≤ p`` show up in bytes. :func:`measured_step` runs a step with all
   three and returns a :class:`StepStats`.

Why sends are asynchronous and posted with the next receive: on gloo a blocking ``send`` returns
only once the receiver has posted its ``recv``. In 1F1B stage 0 sends micro-batch 1's activation
while stage 1 sends micro-batch 0's gradient back — both blocking, each waiting for the other: a
deadlock. With ``isend`` a stage never waits for its own sends until the end of the step. On NCCL
even an ``isend`` of a large tensor runs as a kernel that waits for the peer's receive, and a receive
posted after it queues behind it on the same stream: the two crossing messages of 1F1B can still
hang. Posting the send and the receive as one batch (``batch_isend_irecv``: one NCCL group) lets
both progress at once. On gloo (no coalescing) the batch is the same ``isend`` / ``irecv`` calls in
the same order, so nothing changes there. NCCL also requires one collective on the group before the
first batched p2p: the runner runs a one-element all-reduce when it is built on such a backend.

Why receives are posted in the sender's order: p2p messages between two ranks are matched in the
order they were posted (there is no message tag in ``comm``'s wrappers). In interleaved 1F1B both
activations and gradients flow in both directions between two ranks; the receiver therefore reads
the sender's schedule (schedules are deterministic) and posts its receives from that peer in exactly
the sender's order, each as late as possible.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from . import comm
from .pipeline_schedules import (
    SCHEDULES,
    Action,
    Event,
    bubble_fractions,
    check_microbatches,
    check_schedule,
    gpipe,
    interleaved_one_f_one_b,
    make_schedules,
    one_f_one_b,
    peak_live_microbatches,
    simulate,
    zero_bubble,
)

__all__ = [
    "Action",
    "Event",
    "balanced_split",
    "GPTStage",
    "split_gpt",
    "split_layers",
    "split_microbatches",
    "gpt_loss",
    "gpipe",
    "one_f_one_b",
    "interleaved_one_f_one_b",
    "zero_bubble",
    "weight_outputs",
    "backward_input",
    "backward_weight",
    "make_schedules",
    "check_schedule",
    "check_microbatches",
    "simulate",
    "peak_live_microbatches",
    "bubble_fractions",
    "PipelineRunner",
    "post_together",
    "PipelineObserver",
    "Timeline",
    "LiveMicrobatches",
    "LiveActivationMeter",
    "StepStats",
    "measured_step",
    "SCHEDULES",
]


# =========================================================================== stages


def balanced_split(n_items: int, n_parts: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: ``n_items`` consecutive items in ``n_parts`` runs whose sizes differ by ≤ 1."""
    if n_parts < 1:
        raise ValueError(f"num_stages={n_parts} must be >= 1")
    if n_parts > n_items:
        raise ValueError(
            f"more stages than layers: {n_parts} stages for {n_items} layers "
            "(every stage needs at least one layer)"
        )
    base, extra = divmod(n_items, n_parts)
    bounds, start = [], 0
    for i in range(n_parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def split_layers(layers: Sequence[nn.Module], num_stages: int) -> list[nn.Sequential]:
    """Any stack of layers as ``num_stages`` balanced ``nn.Sequential`` stages."""
    return [nn.Sequential(*layers[a:b]) for a, b in balanced_split(len(layers), num_stages)]


class GPTStage(nn.Module):
    """Consecutive pieces of ``models.GPT``, under the names they have in the full model.

    ``blocks`` is a ``ModuleDict`` keyed by the block's index in the full model, so
    ``stage.state_dict()`` keys (``blocks.2.attn.c_attn.weight``) are a subset of
    ``GPT.state_dict()``'s: the stages' dicts together are the full model's.
    Input: token ids (first stage) or the hidden state ``(b, s, h)``; output: the hidden state, or the
    logits ``(b, s, V)`` on the last stage.
    """

    def __init__(self, model, first_block: int, end_block: int, *, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = model.wte, model.wpe
        self.blocks = nn.ModuleDict(
            {str(i): model.blocks[i] for i in range(first_block, end_block)}
        )
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.wte(x) + self.wpe(pos)
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


def split_gpt(model, num_stages: int, num_chunks: int = 1) -> list[GPTStage]:
    """The GPT as ``num_stages · num_chunks`` stages of balanced consecutive blocks, in pipeline order.

    With ``num_chunks = v > 1`` (interleaved 1F1B) stage ``k`` of the returned list is virtual
    stage ``k``; rank ``r`` holds virtual stages ``r, r + p, …, r + (v−1)·p``.
    """
    config = model.config
    if config.tie_weights:
        raise ValueError(
            "tied weights: lm_head.weight is wte.weight, which would live on the first and the last "
            "stage at once; use an untied model (experiments.common.parallel_config()) — Megatron "
            "instead all-reduces that one gradient between the first and last stage"
        )
    if num_chunks < 1:
        raise ValueError(f"num_chunks={num_chunks} must be >= 1")
    total = num_stages * num_chunks
    if num_chunks > 1 and total > config.n_layer:
        raise ValueError(
            f"v·p > layers: {num_chunks} chunks × {num_stages} stages = {total} virtual stages for "
            f"{config.n_layer} layers (each virtual stage needs at least one block)"
        )
    bounds = balanced_split(config.n_layer, total)
    return [
        GPTStage(model, a, b, first=(k == 0), last=(k == total - 1))
        for k, (a, b) in enumerate(bounds)
    ]


def split_microbatches(x: torch.Tensor, num_microbatches: int) -> list[torch.Tensor]:
    """``x`` cut along the batch dimension into ``num_microbatches`` equal micro-batches."""
    check_microbatches(num_microbatches)
    if x.shape[0] % num_microbatches:
        raise ValueError(
            f"batch of {x.shape[0]} is not divisible into num_microbatches={num_microbatches} equal "
            "micro-batches"
        )
    return list(x.chunk(num_microbatches))


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's loss on the last stage: mean cross-entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


# =========================================================================== split backward (zero bubble)


@contextlib.contextmanager
def weight_outputs(module: nn.Module):
    """``[(output, its layer's own parameters)]`` of every submodule that owns parameters (Linear,
    LayerNorm, Embedding) as ``module`` runs forward: what W starts from (:func:`backward_weight`)."""
    outputs, handles = [], []

    def keep(sub, args, out):
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{type(sub).__name__} owns parameters but returns {type(out)}")
        outputs.append((out, list(sub.parameters(recurse=False))))

    for sub in module.modules():
        if next(sub.parameters(recurse=False), None) is not None:
            # prepend: before a clock's hook, so the output is the raw one (no cost node below it)
            handles.append(sub.register_forward_hook(keep, prepend=True))
    try:
        yield outputs
    finally:
        for h in handles:
            h.remove()


def backward_input(out, x, grad, outputs):
    """B: one autograd walk from ``out`` down to the stage input ``x`` — no weight gradient.

    The walk also returns the gradients of ``outputs`` (:func:`weight_outputs`: each layer's output,
    which the walk passes on its way to ``x``) and keeps them with their layer's parameters. The
    graph is retained for W. Returns ``(dx, saved)``; ``dx`` None on the first stage (token ids).
    """
    wants_x = x.requires_grad
    inputs = ([x] if wants_x else []) + [y for y, _ in outputs]
    grads = torch.autograd.grad(
        out, inputs, grad_outputs=grad, retain_graph=True, allow_unused=True
    )
    saved = [
        (y, g, ps) for (y, ps), g in zip(outputs, grads[wants_x:], strict=True) if g is not None
    ]
    return (grads[0] if wants_x else None), saved


def backward_weight(saved) -> None:
    """W: from each layer's saved output gradient to that layer's own parameters; into ``.grad``.

    One short walk per layer (as torch's ``stage_backward_weight`` walks per parameter group): a
    single walk from every layer's output to every parameter would pass down through the layers
    below again — the input gradients B already computed. Nothing downstream waits for W.
    """
    for y, g, params in saved:
        for q, dw in zip(params, torch.autograd.grad(y, params, g), strict=True):
            q.grad = dw if q.grad is None else q.grad + dw


# =========================================================================== the runner


class _Counted:
    """What a ``dist.P2POp`` calls, posting through ``comm`` (so :class:`~course_lib.comm.CommLog` counts it).

    ``dist.batch_isend_irecv`` calls each op's ``.op(tensor, group=, tag=, group_src= | group_dst=)``
    inside one coalescing group on NCCL, one call after another on gloo. ``P2POp`` accepts only
    ``dist.isend`` / ``dist.irecv`` when it is built, so :func:`post_together` builds it with those
    and then swaps in this callable, which turns the group peer back into a global rank and calls
    ``comm.isend`` or ``comm.irecv`` (which call ``dist.isend`` / ``dist.irecv``) with its label.
    """

    def __init__(self, kind: str, label: str):
        self.kind, self.label = kind, label

    def __call__(self, tensor, group=None, tag=0, group_dst=None, group_src=None):
        peer = group_dst if group_dst is not None else group_src
        peer = dist.get_global_rank(group, peer) if group is not None else peer
        post = comm.isend if self.kind == "send" else comm.irecv
        return post(tensor, peer, tag=self.label)


def _p2p_op(kind: str, tensor: torch.Tensor, peer: int, label: str) -> dist.P2POp:
    op = dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer)
    op.op = _Counted(kind, label)
    return op


def post_together(messages: Sequence[tuple[str, torch.Tensor, int, str]]) -> list:
    """Post ``(kind "send" | "recv", tensor, global rank, label)`` messages as one batch.

    ``dist.batch_isend_irecv`` of one ``P2POp`` per message: one NCCL group (sends and receives
    progress together, in any order), or on gloo the same ``isend`` / ``irecv`` in list order.
    Returns one entry per message: the works to wait on before its buffer may be read (one shared
    work for a coalesced batch, the message's own on gloo).
    """
    if not messages:
        return []
    ops = [_p2p_op(kind, t, peer, label) for kind, t, peer, label in messages]
    works = dist.batch_isend_irecv(ops)
    if len(works) == len(messages):
        return [[w] for w in works]
    return [list(works) for _ in messages]


class PipelineObserver:
    """What a :class:`PipelineRunner` tells the outside while it runs a step (here: nothing).

    * ``begin(kind, microbatch, chunk)`` / ``end(...)`` bracket every forward (``kind`` "F"),
      backward ("B"; with zero bubble the input gradient), weight gradient ("W") and wait for
      a peer's message ("wait", chunk −1): ``end`` comes after the computation and before its
      result is sent;
    * ``forward()`` is a context manager entered around every forward (and the loss on the last
      stage): the place for saved-tensor hooks.
    """

    def begin(self, kind: str, microbatch: int, chunk: int) -> None:
        pass

    def end(self, kind: str, microbatch: int, chunk: int) -> None:
        pass

    def forward(self):
        return contextlib.nullcontext()


class _Fanout(PipelineObserver):
    """Several observers as one, in order."""

    def __init__(self, observers: Sequence[PipelineObserver]):
        self.observers = list(observers)

    def begin(self, kind, microbatch, chunk):
        for o in self.observers:
            o.begin(kind, microbatch, chunk)

    def end(self, kind, microbatch, chunk):
        for o in self.observers:
            o.end(kind, microbatch, chunk)

    def forward(self):
        stack = contextlib.ExitStack()
        for o in self.observers:
            stack.enter_context(o.forward())
        return stack


class PipelineRunner:
    """Run one rank's share of a pipeline schedule: real forwards, backwards, and p2p transfers.

    * ``chunks`` — this rank's stage modules: ``[stage module]``, or ``v`` modules for interleaving
      (chunk ``c`` is virtual stage ``c·p + stage``);
    * ``schedules`` — every stage's action list (:func:`make_schedules`): this rank runs
      ``schedules[stage]`` and reads the others' to know the order its peers send in;
    * ``activation_shape`` / ``dtype`` — one micro-batch's activation at a stage boundary;
    * ``ranks`` — the global rank of each pipeline stage (default ``0 … p−1``; PP × DP passes its
      replica's ranks);
    * ``weight_cost`` — called as ``weight_cost(microbatch, chunk)`` inside every W step after its
      walk (a clock's ``spend``: the W walk runs no costed module).

    A schedule with W's (:func:`zero_bubble`) runs each B as :func:`backward_input` and each W as
    :func:`backward_weight`; without, B is one ``torch.autograd.backward``.

    :meth:`step` takes the whole batch (``inputs`` used by the first stage, ``targets`` by the last),
    splits it into ``m`` micro-batches, runs the schedule and leaves the gradients of the mean loss
    over the batch in ``.grad`` (accumulated, then divided by ``m``).
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        stage: int,
        schedules: Sequence[Sequence[Action]],
        num_microbatches: int,
        *,
        activation_shape: Sequence[int],
        dtype=torch.float32,
        loss_fn: Callable = gpt_loss,
        ranks: Sequence[int] | None = None,
        device=None,
        weight_cost: Callable[[int, int], None] | None = None,
    ):
        self.chunks = list(chunks)
        self.p, self.v, self.m, self.stage = (
            len(schedules),
            len(self.chunks),
            num_microbatches,
            stage,
        )
        self.ranks = list(range(self.p)) if ranks is None else list(ranks)
        if len(self.ranks) != self.p:
            raise ValueError(
                f"ranks={self.ranks} must name one global rank per stage ({self.p} stages)"
            )
        simulate(
            schedules, num_microbatches, self.v
        )  # every stage's rules and the cross-stage dependencies
        self.schedules = [[Action(*a) for a in acts] for acts in schedules]
        self.split = any(a.op == "W" for a in self.schedules[stage])  # B and W: zero bubble
        self.weight_cost = weight_cost
        self.loss_fn, self.shape, self.dtype = loss_fn, tuple(activation_shape), dtype
        self.device = device if device is not None else next(self.chunks[0].parameters()).device
        self.params = [q for c in self.chunks for q in c.parameters()]
        if self.p > 1 and dist.get_backend() != "gloo":
            # NCCL: batched p2p must not be the first call on the group (torch's batch_isend_irecv)
            dist.all_reduce(torch.zeros(1, device=self.device))
        # The order in which each peer sends to this rank: (kind, microbatch, virtual stage it is for).
        self._incoming = {
            peer: [msg for msg, dst in self._sends_of(peer) if dst == stage]
            for peer in range(self.p)
            if peer != stage
        }

    def _virtual(self, chunk: int, stage: int | None = None) -> int:
        return chunk * self.p + (self.stage if stage is None else stage)

    def _sends_of(self, peer: int) -> list[tuple[tuple, int]]:
        """Messages ``peer`` sends, in its order: ((kind, microbatch, destination virtual stage), dst stage)."""
        last, out = self.p * self.v - 1, []
        for a in self.schedules[peer]:
            s = self._virtual(a.chunk, peer)
            if a.op == "F" and s < last:
                out.append((("act", a.microbatch, s + 1), (s + 1) % self.p))
            elif a.op == "B" and s > 0:
                out.append((("grad", a.microbatch, s - 1), (s - 1) % self.p))
        return out

    def _receives(self, key: tuple, peer: int, posted: dict, cursor: dict) -> list:
        """The receives from ``peer`` still to post for ``key``: its messages to this rank in its
        send order, up to ``key`` (none if ``key`` is posted already), each with a fresh buffer."""
        out, queue = [], self._incoming[peer]
        while key not in posted and (not out or out[-1][0] != key):
            msg = queue[cursor[peer]]
            cursor[peer] += 1
            out.append((msg, torch.empty(self.shape, dtype=self.dtype, device=self.device)))
        return out

    def _needs(self, a: Action) -> tuple | None:
        """The message action ``a`` waits for, ``(key, peer stage)``, or None."""
        s, last = self._virtual(a.chunk), self.p * self.v - 1
        if a.op == "F" and s > 0:
            return ("act", a.microbatch, s), (s - 1) % self.p
        if a.op == "B" and s < last:
            return ("grad", a.microbatch, s), (s + 1) % self.p
        return None

    def step(
        self,
        inputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        observers: Sequence[PipelineObserver] = (),
    ) -> list[float]:
        """One step's forwards and backwards; returns the loss per micro-batch (last stage; else [])."""
        p, m, last = self.p, self.m, self.p * self.v - 1
        x_mb = split_microbatches(inputs, m) if self.stage == 0 else None
        y_mb = split_microbatches(targets, m) if (last % p) == self.stage else None
        obs = _Fanout(observers)
        posted, cursor = {}, {peer: 0 for peer in self._incoming}
        stage_in, stage_out, sends, losses = {}, {}, [], []
        layer_outs, saved = {}, {}  # zero bubble: layer outputs (F → B), their gradients (B → W)
        pending = []  # the last action's send: [("send", tensor, global rank, label)]

        def post(recvs):
            """The pending send and these receives as one batch."""
            msgs = pending + [
                ("recv", buf, self.ranks[peer], "activation" if msg[0] == "act" else "grad")
                for msg, buf, peer in recvs
            ]
            works = post_together(msgs)
            sent, got = works[: len(pending)], works[len(pending) :]
            sends.extend((w, t) for (_, t, _, _), w in zip(pending, sent, strict=True))
            for (msg, buf, _), w in zip(recvs, got, strict=True):
                posted[msg] = (w, buf)
            pending.clear()

        def wait_for(key):
            obs.begin("wait", key[1], -1)
            works, buf = posted.pop(key)
            for w in works:
                w.wait()
            obs.end("wait", key[1], -1)
            return buf

        for a in self.schedules[self.stage]:
            s, mod, key = self._virtual(a.chunk), self.chunks[a.chunk], (a.microbatch, a.chunk)
            try:
                need = self._needs(a)
                recvs = [] if need is None else self._receives(*need, posted, cursor)
                post([(msg, buf, need[1]) for msg, buf in recvs])
                if a.op == "F":
                    x = x_mb[a.microbatch] if s == 0 else wait_for(need[0]).requires_grad_()
                    obs.begin("F", a.microbatch, a.chunk)
                    kept = weight_outputs(mod) if self.split else contextlib.nullcontext()
                    with obs.forward(), kept as outputs:
                        out = mod(x)
                        if s == last:
                            out = self.loss_fn(out, y_mb[a.microbatch])
                    obs.end("F", a.microbatch, a.chunk)
                    if self.split:
                        layer_outs[key] = outputs
                    del outputs, kept  # W frees its micro-batch's graph: hold no reference here
                    stage_in[key], stage_out[key] = x, out
                    if s == last:
                        losses.append(out.item())
                    else:
                        pending.append(
                            ("send", out.detach(), self.ranks[(s + 1) % p], "activation")
                        )
                elif a.op == "W":
                    obs.begin("W", a.microbatch, a.chunk)
                    backward_weight(saved.pop(key))
                    if self.weight_cost is not None:
                        self.weight_cost(a.microbatch, a.chunk)
                    obs.end("W", a.microbatch, a.chunk)
                else:
                    grad = None if s == last else wait_for(need[0])
                    obs.begin("B", a.microbatch, a.chunk)
                    out, x = stage_out.pop(key), stage_in.pop(key)
                    if self.split:
                        dx, saved[key] = backward_input(out, x, grad, layer_outs.pop(key))
                    else:
                        torch.autograd.backward(out, grad_tensors=grad)
                        dx = x.grad
                    obs.end("B", a.microbatch, a.chunk)
                    if s > 0:
                        pending.append(("send", dx, self.ranks[(s - 1) % p], "grad"))
                    del out, x
            except Exception as exc:
                raise RuntimeError(
                    f"pipeline stage {s} (rank {self.ranks[self.stage]}) failed in {a!r}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        post([])  # the last action's send
        for works, _ in sends:  # keep each sent tensor alive until its send completed
            for w in works:
                w.wait()
        for q in self.params:  # accumulated over m micro-batches of mean losses → the batch mean
            if q.grad is not None:
                q.grad.div_(m)
        return losses


# =========================================================================== observers


class Timeline(PipelineObserver):
    """Every F, B, W and wait of a step as an :class:`Event` (``perf_counter`` seconds)."""

    def __init__(self):
        self.events: list[Event] = []
        self._start = 0.0

    def begin(self, kind, microbatch, chunk):
        self._start = time.perf_counter()

    def end(self, kind, microbatch, chunk):
        self.events.append(Event(kind, microbatch, chunk, self._start, time.perf_counter()))


class LiveMicrobatches(PipelineObserver):
    """Micro-batches whose forward ran and whose backward (B) has not: ``live`` now, ``peak`` at most."""

    def __init__(self):
        self.live = self.peak = 0

    def end(self, kind, microbatch, chunk):
        self.live += {"F": 1, "B": -1}.get(kind, 0)
        self.peak = max(self.peak, self.live)


class _Saved:
    """What autograd keeps for one saved tensor while a :class:`LiveActivationMeter` is active."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class LiveActivationMeter(PipelineObserver):
    """Bytes saved for backward and not yet released, counted as they come and go.

    Inside ``with meter.saving():`` (the runner enters it around every forward) every tensor
    autograd saves is wrapped in a small holder that autograd owns; once the backward that used it
    has run (``retain_graph=False``), autograd drops the holder and it leaves the count.
    :meth:`live_bytes` sums the unique storages of the holders still alive, leaving out ``exclude``
    (the stage's parameters: a Linear saves its weight, a model state). As an observer it samples
    the count after every F and B: ``trace`` [(time, bytes)] and ``peak``.
    """

    def __init__(self, exclude=()):
        self._excluded = {p.untyped_storage().data_ptr() for p in exclude}
        self._alive: weakref.WeakSet = weakref.WeakSet()
        self.trace: list[tuple[float, int]] = []
        self.peak = 0

    def _pack(self, t: torch.Tensor):
        # detached: a tensor saved by its own node would otherwise hold that node (a cycle that
        # outlives a retained graph — zero bubble's B — until the garbage collector runs)
        holder = _Saved(t.detach())
        self._alive.add(holder)
        return holder

    @staticmethod
    def _unpack(holder: _Saved) -> torch.Tensor:
        return holder.tensor

    def saving(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def live_bytes(self) -> int:
        storages = {}
        for h in list(self._alive):
            st = h.tensor.untyped_storage()
            if st.data_ptr() not in self._excluded:
                storages[st.data_ptr()] = st.nbytes()
        return sum(storages.values())

    # -- as an observer
    def forward(self):
        return self.saving()

    def end(self, kind, microbatch, chunk):
        if kind in ("F", "B", "W"):
            nbytes = self.live_bytes()
            self.trace.append((time.perf_counter(), nbytes))
            self.peak = max(self.peak, nbytes)


class StepStats(NamedTuple):
    """What one :func:`measured_step` measured on this rank."""

    losses: list  # per micro-batch (last stage only; else empty)
    events: list  # Event(kind, microbatch, chunk, start, end), perf_counter seconds
    peak_live_microbatches: int
    peak_live_bytes: int
    live_bytes: list  # (time, live activation bytes) after every F and B


def measured_step(
    runner: PipelineRunner, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None
) -> StepStats:
    """``runner.step`` observed by a :class:`Timeline`, :class:`LiveMicrobatches` and a
    :class:`LiveActivationMeter`: what one step measured, as :class:`StepStats`."""
    timeline, live = Timeline(), LiveMicrobatches()
    meter = LiveActivationMeter(exclude=runner.params)
    losses = runner.step(inputs, targets, observers=(timeline, live, meter))
    return StepStats(losses, timeline.events, live.peak, meter.peak, meter.trace)
