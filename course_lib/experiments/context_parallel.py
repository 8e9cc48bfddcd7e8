"""The context-parallel chapter's measurements: ring, all-gather CP and Ulysses on real ranks.

Rank functions (run them with ``launch.spawn``), each returning a
:class:`~course_lib.results.Result`:

* :func:`attention_equality` — every variant (ring contiguous / zig-zag, all-gather both layouts,
  Ulysses), causal and not: the output and dq, dk, dv gathered from every rank against
  ``F.scaled_dot_product_attention`` on one device (:class:`EqualityResult`);
* :func:`attention_traffic` — the bytes each rank sends, forward and backward, counted by
  :class:`~course_lib.comm.CommLog` (Ulysses: by watching ``dist.all_to_all_single``, which
  ``comm`` has no wrapper for) against the formulas (:class:`TrafficResult`);
* :func:`attention_memory` — bytes saved for backward per rank at c = 1 and at c = world for the
  same full sequence: the ring's ∝ S/c, all-gather's extra full K and V (:class:`MemoryResult`);
* :func:`ring_timeline` — the ring's forward under the modelled accelerator clock: per ring step
  and rank the block's compute and the K/V transfer as wall-clock intervals (a Gantt), and the
  step time against the step-time model (:class:`RingTimeline`);
* :func:`zigzag_balance` — causal ring attention, contiguous vs zig-zag: per-rank work counted and
  per-rank compute time measured under the clock, step times raced (:class:`BalanceResult`);
* :func:`cp_gpt_training` — the tiny GPT under :class:`~course_lib.context_parallel.ContextParallelGPT`
  (ring, zig-zag) for a few AdamW steps against one device (:class:`CPTrainingResult`);
* :func:`notebook_suite` — all six in one spawn (``spawn(notebook_suite, 2)[0]``).

Parent-side: :func:`ring_gantt_rows` (a :class:`RingTimeline` as ``viz.gantt``'s arguments).

How compute is costed. The technique module holds the algorithm only, so the measurements attach
from outside (:class:`RingProbe`, a context manager): it replaces ``context_parallel.block_attention``
with one that computes the real block, then sleeps its FLOPs (counted as the clock counts them:
4·B·H·Sq·Sk·D) on an :class:`~course_lib.clock.AcceleratorClock`, and it wraps ``comm.isend`` /
``comm.irecv`` so that a helper thread does each transfer's one ``wait()`` and notes when it
completed. The numbers are untouched (the same calls run), CommLog still counts every byte.
Only the forward is costed: the backward's blocks are the same pairs (same balance, twice the FLOPs).
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from .. import context_parallel as cp
from .. import step_time as st
from ..clock import AcceleratorClock, count_flops
from ..launch import device
from ..memory import SavedTensorMeter
from ..models import GPT
from ..results import ADAMW, SGD, Result
from ..timing import AGREEMENT_BAND, Timings, time_steps
from .collectives import bandwidth_benchmark
from .common import make_optimizer, reference_run, small_config, step_batch, train_step

__all__ = [
    "BLOCK",
    "CASES",
    "EqualityResult",
    "attention_equality",
    "TrafficResult",
    "attention_traffic",
    "MemoryResult",
    "attention_memory",
    "RingProbe",
    "block_rate",
    "RingTimeline",
    "ring_timeline",
    "ring_gantt_rows",
    "BalanceResult",
    "zigzag_balance",
    "CPTrainingResult",
    "cp_gpt_training",
    "notebook_suite",
]

BLOCK = 256
"""Tokens per rank in the clocked experiments: a block's modelled compute (~80 ms at 40× its real
compute) dwarfs the per-step costs the step-time model leaves out (a barrier, threads, ~2 ms)."""

CASES = [
    (name, layout, causal)
    for name in ("ring", "allgather", "ulysses")
    for layout in cp.LAYOUTS
    for causal in (True, False)
    if not (name == "ulysses" and layout == "zigzag")  # Ulysses gathers in rank order
]


def _case_name(name: str, layout: str, causal: bool) -> str:
    where = "" if name == "ulysses" else f" {layout}"
    return f"{name}{where}, {'causal' if causal else 'full'}"


def _full_qkvw(shape, seed: int) -> list[torch.Tensor]:
    """The full-sequence q, k, v and output weights ``[B, H, S, D]``: the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(device()) for _ in range(4)]


def _attend(name: str, q, k, v, causal: bool, layout: str, group=None):
    kw = {} if name == "ulysses" else {"layout": layout}
    return cp.ATTENTIONS[name](q, k, v, group=group, causal=causal, **kw)


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` (CPU copies, in rank order)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, t.detach().cpu())
    return out


# =========================================================================== 1. equality


@dataclass
class EqualityResult(Result):
    """Every CP variant's output and q/k/v gradients, un-sharded from all ranks, vs one device."""

    cp_size: int
    shape: tuple  # full [B, H, S, D]


def attention_equality(
    batch: int = 2, heads: int = 4, seq_per_rank: int = 8, head_dim: int = 8, seed: int = 0
) -> EqualityResult:
    """Rank function: each of :data:`CASES` on this rank's chunk, then un-sharded and compared.

    The full q, k, v (``[B, H, c·seq_per_rank, D]``, from ``seed``) and a fixed output weight ``w``
    are drawn on every rank; each rank attends over its chunk in the case's layout and takes the
    gradients of ``Σ (y · w)``. The shards of every rank are gathered and un-sharded
    (:func:`~course_lib.context_parallel.unshard_sequence`), so each rank's table covers the whole
    sequence; one row per case, measured = max |Δ| over out, dq, dk, dv, within
    :data:`~course_lib.results.SGD` (only the order of fp32 sums differs; no update yet).
    """
    c, r = dist.get_world_size(), dist.get_rank()
    shape = (batch, heads, c * seq_per_rank, head_dim)
    full = _full_qkvw(shape, seed)
    want = {}
    for causal in (True, False):
        q, k, v = (t.clone().requires_grad_(True) for t in full[:3])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        grads = torch.autograd.grad((y * full[3]).sum(), (q, k, v))
        want[causal] = dict(zip(("out", "dq", "dk", "dv"), (y, *grads), strict=True))
    res = EqualityResult(
        c, shape, title=f"context-parallel attention vs one device, c={c}, [B, H, S, D]={shape}"
    )
    for name, layout, causal in CASES:
        q, k, v, w = (cp.shard_sequence(t, r, c, layout) for t in full)
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        y = _attend(name, q, k, v, causal, layout)
        grads = torch.autograd.grad((y * w).sum(), (q, k, v))
        got = {
            key: cp.unshard_sequence(_gather(t), c, layout)
            for key, t in zip(("out", "dq", "dk", "dv"), (y, *grads), strict=True)
        }
        res.equal(
            f"{_case_name(name, layout, causal)}: out, dq, dk, dv",
            got,
            want[causal],
            SGD,
            against="F.scaled_dot_product_attention, one device",
        )
    return res


# =========================================================================== 2. traffic


@contextmanager
def _watch_all_to_all(sent: list):
    """Count what ``dist.all_to_all_single`` sends ((c−1)/c of its input leaves the rank); it still runs.

    ``comm`` has no all-to-all wrapper, so CommLog does not see Ulysses (the tests count it so too).
    """
    real = dist.all_to_all_single

    def watched(output, input, *args, **kwargs):
        c = dist.get_world_size(kwargs.get("group"))
        sent.append(input.numel() * input.element_size() * (c - 1) // c)
        return real(output, input, *args, **kwargs)

    dist.all_to_all_single = watched
    try:
        yield sent
    finally:
        dist.all_to_all_single = real


@dataclass
class TrafficResult(Result):
    """Bytes per rank per layer: ``measured[variant][phase]`` (one value per rank) vs ``formula``."""

    cp_size: int
    shape: tuple
    measured: dict = field(default_factory=dict)  # variant -> {"forward": [per rank], ...}
    calls: dict = field(default_factory=dict)  # variant -> {"forward": calls, "backward": calls}
    formula: dict = field(default_factory=dict)  # variant -> {"forward": bytes, "backward": bytes}


_TRAFFIC = (  # (row name, variant, layout, formula)
    ("ring contiguous", "ring", "contiguous", cp.ring_attention_traffic),
    ("ring zigzag", "ring", "zigzag", cp.ring_attention_traffic),
    ("allgather zigzag", "allgather", "zigzag", cp.allgather_attention_traffic),
    ("ulysses", "ulysses", "contiguous", cp.ulysses_attention_traffic),
)


def attention_traffic(
    batch: int = 2, heads: int = 4, seq_per_rank: int = 8, head_dim: int = 8, seed: int = 0
) -> TrafficResult:
    """Rank function: one causal forward and backward per variant, the bytes each rank sent.

    Ring and all-gather go through :mod:`course_lib.comm`, so :class:`~course_lib.comm.CommLog`
    counts them (ring bytes: a send counts its tensor, an all-gather / reduce-scatter (c−1)/c of the
    full one); Ulysses' all-to-alls are counted by watching ``dist.all_to_all_single``. Rows: each
    variant's forward and backward bytes on every rank EXACTly the formula, and the calls.
    """
    c, r = dist.get_world_size(), dist.get_rank()
    shape = (batch, heads, c * seq_per_rank, head_dim)
    full = _full_qkvw(shape, seed)
    res = TrafficResult(c, shape, title=f"bytes each rank sends per layer, c={c}, shape {shape}")
    mine = {}
    for key, name, layout, formula in _TRAFFIC:
        q, k, v, w = (cp.shard_sequence(t, r, c, layout) for t in full)
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        a2a_fwd, a2a_bwd = [], []
        with comm.CommLog() as fwd, _watch_all_to_all(a2a_fwd):
            y = _attend(name, q, k, v, True, layout)
        with comm.CommLog() as bwd, _watch_all_to_all(a2a_bwd):
            torch.autograd.grad((y * w).sum(), (q, k, v))
        if name == "ulysses":
            got = {"forward": sum(a2a_fwd), "backward": sum(a2a_bwd)}
            res.calls[key] = {"forward": len(a2a_fwd), "backward": len(a2a_bwd)}
        else:
            ops = ("send", "send") if name == "ring" else ("all_gather", "reduce_scatter")
            got = {
                "forward": round(fwd.total("ring_bytes", op=ops[0])),
                "backward": round(bwd.total("ring_bytes", op=ops[1])),
            }
            res.calls[key] = {"forward": len(fwd.records), "backward": len(bwd.records)}
        mine[key] = got
        res.formula[key] = formula(batch, heads, c * seq_per_rank, head_dim, c)
    everyone = [None] * c
    dist.all_gather_object(everyone, mine)
    want_calls = {
        "ring contiguous": {"forward": 2 * (c - 1), "backward": 4 * (c - 1)},
        "ring zigzag": {"forward": 2 * (c - 1), "backward": 4 * (c - 1)},
        "allgather zigzag": {"forward": 1, "backward": 1},
        "ulysses": {"forward": 4, "backward": 4},
    }
    calls_why = {
        "ring contiguous": "c−1 isend + irecv of K/V; backward K/V and dK/dV",
        "ring zigzag": "c−1 isend + irecv of K/V; backward K/V and dK/dV",
        "allgather zigzag": "one all-gather forward, one reduce-scatter backward",
        "ulysses": "four all-to-alls each way (q, k, v, out)",
    }
    for key, _, _, formula in _TRAFFIC:
        res.measured[key] = {ph: [e[key][ph] for e in everyone] for ph in ("forward", "backward")}
        for phase in ("forward", "backward"):
            res.exact(
                f"{key}: {phase} bytes sent, every rank",
                res.measured[key][phase],
                [res.formula[key][phase]] * c,
                f"formula {formula.__name__}",
            )
        res.exact(
            f"{key}: calls (forward, backward)", res.calls[key], want_calls[key], calls_why[key]
        )
    return res


# =========================================================================== 3. memory


@dataclass
class MemoryResult(Result):
    """Bytes saved for backward on this rank: ``saved[variant][c]`` for c = 1 and c = world, same S."""

    cp_size: int
    shape: tuple
    saved: dict = field(default_factory=dict)  # variant -> {1: bytes, c: bytes}
    formula: dict = field(default_factory=dict)  # c -> ring_attention_saved_bytes


def attention_memory(
    batch: int = 2, heads: int = 4, seq_len: int = 32, head_dim: int = 8, seed: int = 0
) -> MemoryResult:
    """Rank function: :class:`~course_lib.memory.SavedTensorMeter` around each variant's forward.

    The same full sequence (``[B, H, seq_len, D]``) twice: at c = 1 (each rank alone, in a group of
    its own, the whole sequence) and at c = world (this rank's S/c tokens). Rows: the ring's saved
    bytes EXACTly :func:`~course_lib.context_parallel.ring_attention_saved_bytes` at both, so c = 1
    saves c× what one of c ranks saves; all-gather keeps the gathered K and V: its extra over the
    ring is the other ranks' K and V, 2·B·H·(S − S/c)·D·4 bytes, plus the causal mask it passes
    to SDPA, which SDPA's CPU kernel saves converted to fp32 ((S/c)·S·4 bytes).
    """
    c, r = dist.get_world_size(), dist.get_rank()
    shape = (batch, heads, seq_len, head_dim)
    full = _full_qkvw(shape, seed)
    alone = [dist.new_group([j]) for j in range(c)]  # every rank creates every group
    res = MemoryResult(
        c, shape, title=f"bytes saved for backward per rank, S={seq_len}, c=1 vs {c}"
    )
    for size, group in ((1, alone[r]), (c, None)):
        rank = 0 if size == 1 else r
        q, k, v = (cp.shard_sequence(t, rank, size).requires_grad_(True) for t in full[:3])
        for name in cp.ATTENTIONS:
            with SavedTensorMeter() as meter:
                _attend(name, q, k, v, True, "contiguous", group)
            res.saved.setdefault(name, {})[size] = meter.bytes
        res.formula[size] = cp.ring_attention_saved_bytes(batch, heads, seq_len, head_dim, size)
    ring = res.saved["ring"]
    for size in (1, c):
        res.exact(
            f"ring: saved bytes per rank at c={size}",
            ring[size],
            res.formula[size],
            "formula ring_attention_saved_bytes (q, k, v, out, lse of S/c tokens)",
        )
    res.exact(f"ring: saved at c=1 / at c={c}", ring[1] / ring[c], float(c), "c (∝ S/c)")
    kv_elsewhere = 2 * batch * heads * (seq_len - seq_len // c) * head_dim * 4
    mask = (seq_len // c) * seq_len * 4  # SDPA saves the bool mask as an fp32 additive one
    extra = res.saved["allgather"][c] - ring[c]
    res.exact(
        f"all-gather's extra over the ring at c={c}",
        extra,
        kv_elsewhere + mask,
        "the other ranks' K and V 2·B·H·(S−S/c)·D·4 + the fp32 mask (S/c)·S·4",
    )
    u = res.saved["ulysses"]
    res.exact(
        f"ulysses: saved at c=1 / at c={c}", u[1] / u[c], float(c), "c (H/c heads of S tokens)"
    )
    return res


# =========================================================================== the probe and the clock


class _TimedWork:
    """A Work whose one real ``wait()`` runs on a helper thread, which notes when it completed.

    The main thread's ``wait()`` waits for that helper: the algorithm sees an ordinary Work, and
    the transfer's end is its own, not the moment the algorithm got round to waiting.
    """

    def __init__(self, work, pool):
        self.issued, self.done = time.perf_counter(), None
        self._future = pool.submit(self._finish, work)

    def _finish(self, work) -> None:
        work.wait()
        self.done = time.perf_counter()

    def wait(self, *args) -> bool:
        self._future.result()  # re-raises what the real wait() raised
        return True


class RingProbe:
    """Costs ring attention's blocks on a clock and records when each block and transfer ran.

    Inside ``with RingProbe(clock) as probe:``, every ``context_parallel.block_attention`` call
    computes the real block and then sleeps its FLOPs on ``clock`` (``clock.spend``), and every
    ``comm.isend`` / ``comm.irecv`` returns a Work whose real ``wait()`` a helper thread does.
    ``probe.events()`` lists
    ``(kind, step, piece, start, end)`` in ``perf_counter`` seconds: kind ``"compute"`` (a block
    pair; ``piece`` numbers the pairs of one step) or ``"send/recv"`` (one K/V exchange, issue to
    the later completion of its send and its receive). The ring step is the number of K/V blocks
    received so far. ``probe.scores`` counts the query–key scores computed (``Sq · Sk`` per pair).
    """

    def __init__(self, clock: AcceleratorClock | None):
        self.clock = clock
        self.reset()

    def reset(self) -> None:
        self.received, self.scores = 0, 0
        self._compute: list[tuple] = []
        self._transfers: list[tuple] = []  # (step, [works])
        self._piece = {}

    def _block(self, q, k, v, allowed=None, scale=None):
        t0 = time.perf_counter()
        (out, lse), flops = count_flops(self._real_block, q, k, v, allowed, scale)
        if self.clock is not None:
            self.clock.spend(flops, "block attention")
        step = self.received
        piece = self._piece.get(step, 0)
        self._piece[step] = piece + 1
        self._compute.append(("compute", step, piece, t0, time.perf_counter()))
        self.scores += q.shape[-2] * k.shape[-2]
        return out, lse

    def _isend(self, tensor, dst, *, group=None, tag=None):
        work = _TimedWork(self._real_isend(tensor, dst, group=group, tag=tag), self._pool)
        if tag == "cp_kv":
            self._transfers.append((self.received, [work]))
        return work

    def _irecv(self, tensor, src, *, group=None, tag=None):
        work = _TimedWork(self._real_irecv(tensor, src, group=group, tag=tag), self._pool)
        if tag != "cp_kv":
            return work
        if self._transfers and len(self._transfers[-1][1]) == 1:
            self._transfers[-1][1].append(work)  # the send of this exchange went first
        else:
            self._transfers.append((self.received, [work]))
        probe = self

        class _Received:  # the K/V block is in: the next ring step begins after this wait
            def wait(self, *args):
                work.wait()
                probe.received += 1
                return True

        return _Received()

    def __enter__(self) -> "RingProbe":
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ring-probe")
        self._real_block, self._real_isend, self._real_irecv = (
            cp.block_attention,
            comm.isend,
            comm.irecv,
        )
        cp.block_attention, comm.isend, comm.irecv = self._block, self._isend, self._irecv
        return self

    def __exit__(self, *exc) -> None:
        cp.block_attention, comm.isend, comm.irecv = (
            self._real_block,
            self._real_isend,
            self._real_irecv,
        )
        self._pool.shutdown(wait=True)

    def events(self) -> list[tuple]:
        """Every compute and transfer interval so far, ``(kind, step, piece, start, end)``, by start."""
        transfers = [
            ("send/recv", step, 0, min(w.issued for w in works), max(w.done for w in works))
            for step, works in self._transfers
        ]
        return sorted(self._compute + transfers, key=lambda e: e[3])

    def busy(self) -> float:
        """Seconds spent in block compute (real + modelled) so far."""
        return sum(e[4] - e[3] for e in self._compute)


def _block_qkv(batch, heads, block, head_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(batch, heads, block, head_dim, generator=gen).to(device()) for _ in range(3)
    ]


def block_rate(
    batch: int, heads: int, block: int, head_dim: int, ratio: float = 20.0, margin: float = 2.0
) -> float:
    """Rank function piece: a rate (FLOP/s) at which one ``block × block`` attention sleeps ≥ ``ratio``
    × ``margin`` × its real compute, the same on every rank (the smallest).

    20 × 2 by default, as the step-time experiment chooses: the real compute (and the probe's
    bookkeeping) runs *besides* the sleeps, and is what the step-time model leaves out.

    :func:`~course_lib.clock.calibrate`'s rule, for a function that is not a module: the median of
    5 timed calls after a warm-up; FLOPs as the clock counts them (:func:`~course_lib.clock.count_flops`).
    """
    q, k, v = _block_qkv(batch, heads, block, head_dim)
    times = []
    for i in range(6):
        t0 = time.perf_counter()
        _, flops = count_flops(cp.block_attention, q, k, v)
        if i:
            times.append(time.perf_counter() - t0)
    rate = torch.tensor(
        [flops / (ratio * margin * statistics.median(times))], dtype=torch.float64, device=device()
    )
    dist.all_reduce(rate, op=dist.ReduceOp.MIN)
    return float(rate.item())


def _from_barrier(events: list[tuple], t0: float) -> list[list[tuple]]:
    """Every rank's events, in seconds from the earliest rank's ``t0`` (one perf_counter per machine)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (t0, events))
    start = min(t for t, _ in everyone)
    return [[(k, s, p, a - start, b - start) for k, s, p, a, b in ev] for _, ev in everyone]


# =========================================================================== 4. the ring's timeline


@dataclass
class RingTimeline(Result):
    """The ring's forward under the clock: every rank's events and the step time vs the model.

    ``events[r]``: rank r's ``(kind, step, piece, start, end)``, seconds from the barrier before
    the recorded forward; kind ``"compute"`` (one block) or ``"send/recv"`` (the K/V block
    travelling to the next rank while this one computes). ``prediction``: the step-time model's
    parts; ``timings``: the measured rounds.
    """

    cp_size: int
    shape: tuple  # this rank's [B, H, S/c, D]
    rate: float
    clock: str
    block_s: float  # modelled seconds of one block
    transfer_s: float  # α–β seconds of one K/V exchange
    kv_bytes: int
    alpha_beta: str
    events: list = field(default_factory=list, repr=False)
    prediction: st.Prediction | None = field(default=None, repr=False)
    timings: Timings | None = field(default=None, repr=False)


def ring_timeline(
    batch: int = 1,
    heads: int = 4,
    block: int = BLOCK,
    head_dim: int = 32,
    ratio: float = 20.0,
    rounds: int = 5,
    rate: float | None = None,
) -> RingTimeline:
    """Rank function: the ring's forward (not causal: one full block per step) under the clock.

    1. α–β of one ring step (``send_recv``: isend right, recv left), fitted on the spot from a short
       :func:`~course_lib.experiments.collectives.bandwidth_benchmark` sweep (1 KiB … 4 MiB).
    2. A rate at which a ``block × block`` attention sleeps ≥ ``ratio`` × 2 its real compute
       (:func:`block_rate`), unless ``rate`` is given.
    3. The prediction (:mod:`course_lib.step_time`'s way, a Prediction): c blocks of FLOPs / rate,
       plus per exchange the transfer the block does not hide, max(0, α–β(K/V) − block).
    4. One recorded forward after a barrier (the Gantt), then ``rounds`` interleaved timed rounds
       (:func:`~course_lib.timing.time_steps`) against the prediction, within AGREEMENT_BAND.
    """
    c, r = dist.get_world_size(), dist.get_rank()
    rows = bandwidth_benchmark(
        (2**10, 2**12, 2**20, 2**22), ops=("send_recv",), iters=2, warmup=1, repeats=3
    )
    ab = st.fit_alpha_beta(list(rows))
    rate = rate or block_rate(batch, heads, block, head_dim, ratio)
    clock = AcceleratorClock(rate, force=True)  # the blocks' cost, on any device
    q, k, v = _block_qkv(batch, heads, block, head_dim, seed=1 + r)
    kv_bytes = 2 * q.numel() * q.element_size()
    block_s = clock.seconds_for(4 * q.numel() * block)  # q·kᵀ and p·v: 4·B·H·Sq·Sk·D
    transfer_s = ab.predict("send_recv", kv_bytes)
    exposed = (c - 1) * max(0.0, transfer_s - block_s)
    prediction = st.Prediction(
        f"ring attention forward, c={c}",
        {"compute": c * block_s, "exposed send_recv": exposed},
        "each K/V block travels while the block before it is attended to",
        {"send_recv": (c - 1) * transfer_s - exposed},
    )
    with RingProbe(clock) as probe:

        def forward():
            cp.ring_attention(q, k, v, causal=False)

        forward()  # warm-up
        probe.reset()
        dist.barrier()
        t0 = time.perf_counter()
        forward()
        events = _from_barrier(probe.events(), t0)
        timings = time_steps(
            {"ring forward": forward},
            rounds=rounds,
            clock=clock,
            predicted={"ring forward": prediction.total},
            title="ring attention forward: measured under the clock vs the step-time model",
        )
    res = RingTimeline(
        c,
        tuple(q.shape),
        rate,
        clock.name,
        block_s,
        transfer_s,
        kv_bytes,
        ab.table(),
        events,
        prediction,
        timings,
        title=f"ring attention under the {clock.name}, c={c}, [B, H, S/c, D]={tuple(q.shape)}",
    )
    res.checked += timings.checks()
    for rank, ev in enumerate(events):
        steps = sorted(s for kind, s, *_ in ev if kind == "compute")
        res.exact(f"rank {rank}: blocks computed, one per ring step", steps, list(range(c)), "c")
        sends = [e for e in ev if e[0] == "send/recv"]
        res.exact(f"rank {rank}: K/V exchanges", len(sends), c - 1, "c − 1")
        ends = {}  # step -> when its last block ended
        for kind, step, _, _, end in ev:
            if kind == "compute":
                ends[step] = max(end, ends.get(step, end))
        hidden = all(end <= ends[step] for _, step, _, _, end in sends)
        res.condition(
            f"rank {rank}: each K/V transfer done before its step's block",
            hidden,
            hidden,
            "hidden: the next step never waits for it",
        )
    return res


def ring_gantt_rows(timeline: RingTimeline, transfer_kind: str = "wait") -> dict:
    """Parent-side: ``viz.gantt(**ring_gantt_rows(t))`` — two rows per rank, compute and transfer.

    Compute bars are kind ``"F"`` (forward), transfers ``transfer_kind`` (default ``"wait"``: the
    receive in flight, grey); each bar is labelled with its ring step.
    """
    rows, names = [], []
    for rank, events in enumerate(timeline.events):
        rows.append([("F", s, p, a, b) for kind, s, p, a, b in events if kind == "compute"])
        names.append(f"rank {rank} compute")
        rows.append(
            [(transfer_kind, s, 0, a, b) for kind, s, _, a, b in events if kind != "compute"]
        )
        names.append(f"rank {rank} K/V send/recv")
    return {"timelines": rows, "row_names": names}


# =========================================================================== 5. zig-zag balance


@dataclass
class BalanceResult(Result):
    """Causal ring attention per layout: per-rank work (counted, formula), compute time, step time."""

    cp_size: int
    seq_len: int
    rate: float
    clock: str
    work: dict = field(default_factory=dict)  # layout -> scores per rank, counted by the probe
    formula: dict = field(default_factory=dict)  # layout -> attention_work per rank
    busy: dict = field(default_factory=dict)  # layout -> compute seconds per rank (median)
    timings: Timings | None = field(default=None, repr=False)


def zigzag_balance(
    batch: int = 1,
    heads: int = 4,
    seq_per_rank: int = BLOCK,
    head_dim: int = 32,
    ratio: float = 20.0,
    rounds: int = 5,
    rate: float | None = None,
) -> BalanceResult:
    """Rank function: the causal ring forward with contiguous and zig-zag chunks under the clock.

    Each pair of query and key pieces the ring computes sleeps its FLOPs (:class:`RingProbe`), so a
    rank's compute time follows its work. Per layout: the scores each rank computed (counted) vs
    :func:`~course_lib.context_parallel.attention_work`; each rank's compute time per forward
    (median over rounds); the two layouts timed in interleaved rounds (``time_steps``: the max over
    ranks is the step). Rows: work EXACTly the formula; the last rank's compute time over the
    first's within AGREEMENT_BAND of the work ratio (contiguous: c, zig-zag: 1); the step time ratio
    contiguous / zig-zag within the band of the busiest ranks' work ratio, c / ((2c+1)/4), and the
    ranges separate.
    """
    c, r = dist.get_world_size(), dist.get_rank()
    s = c * seq_per_rank
    rate = rate or block_rate(batch, heads, seq_per_rank, head_dim, ratio)
    clock = AcceleratorClock(rate, force=True)
    full = _full_qkvw((batch, heads, s, head_dim), seed=2)
    res = BalanceResult(c, s, rate, clock.name, title=f"causal ring attention, c={c}, S={s}")
    busy = {layout: [] for layout in cp.LAYOUTS}
    steps = {}
    with RingProbe(clock) as probe:
        for layout in cp.LAYOUTS:
            q, k, v = (cp.shard_sequence(t, r, c, layout) for t in full[:3])

            def forward(q=q, k=k, v=v, layout=layout):
                probe.reset()
                cp.ring_attention(q, k, v, causal=True, layout=layout)
                busy[layout].append(probe.busy())
                return probe.scores

            steps[layout] = forward
        scores = {layout: steps[layout]() for layout in cp.LAYOUTS}  # also the warm-up
        for layout in cp.LAYOUTS:
            busy[layout].clear()
        timings = time_steps(
            steps, rounds=rounds, warmup=0, clock=clock, title="causal ring forward, by layout"
        )
    everyone = [None] * c
    mine = {lay: (scores[lay], statistics.median(busy[lay])) for lay in cp.LAYOUTS}
    dist.all_gather_object(everyone, mine)
    res.timings = timings
    for layout in cp.LAYOUTS:
        res.work[layout] = [e[layout][0] for e in everyone]
        res.busy[layout] = [e[layout][1] for e in everyone]
        res.formula[layout] = [cp.attention_work(j, c, s, layout) for j in range(c)]
        res.exact(
            f"{layout}: query–key scores per rank",
            res.work[layout],
            res.formula[layout],
            "formula attention_work",
        )
        want = res.formula[layout][-1] / res.formula[layout][0]
        res.within(
            f"{layout}: last rank's compute time / first rank's",
            res.busy[layout][-1] / res.busy[layout][0],
            want,
            AGREEMENT_BAND,
            "their work ratio",
        )
    ratio_want = max(res.formula["contiguous"]) / max(res.formula["zigzag"])
    res.within(
        "step time contiguous / zig-zag",
        timings.compare("zigzag", "contiguous").ratio,
        ratio_want,
        AGREEMENT_BAND,
        "busiest rank's work ratio c / ((2c+1)/4)",
    )
    res.checked.append(timings.compare_row("zigzag", "contiguous", "faster"))
    return res


# =========================================================================== 6. the CP GPT


@dataclass
class CPTrainingResult(Result):
    """The CP GPT after AdamW steps: losses and the (replicated) weights vs one device."""

    cp_size: int
    attention: str
    layout: str
    losses: list
    state: dict = field(repr=False)


def cp_gpt_training(
    steps: int = 3,
    batch_size: int = 4,
    attention: str = "ring",
    layout: str = "zigzag",
    config=None,
) -> CPTrainingResult:
    """Rank function: :func:`~course_lib.context_parallel.context_parallel_gpt` trained with AdamW.

    Every rank holds the whole model and its S/c tokens of each sequence of ``step_batch(k)``;
    after backward the replicated weights' partial gradients are summed over the group
    (:func:`~course_lib.context_parallel.allreduce_cp_grads`). Rows: the losses and the weights
    against one device trained on the full sequences (``reference_run``, here on the rank), within
    :data:`~course_lib.results.ADAMW`.
    """
    config = config or small_config()
    c, r, dev = dist.get_world_size(), dist.get_rank(), device()
    model = cp.context_parallel_gpt(GPT(config, seed=0).to(dev), None, attention, layout)
    opt = make_optimizer("adamw", model.parameters())
    losses = []
    for step in range(steps):
        x, y = (
            cp.shard_sequence(t, r, c, layout, dim=1)
            for t in step_batch(step, config, batch_size, dev)
        )
        losses.append(
            train_step(model, opt, x, y, after_backward=lambda: cp.allreduce_cp_grads(model))
        )
    ref, ref_losses, _ = reference_run(config, steps, batch_size, "adamw", dev=dev)
    state = {n: t.detach().cpu() for n, t in model.state_dict().items()}
    res = CPTrainingResult(
        c,
        attention,
        layout,
        losses,
        state,
        title=f"CP GPT ({attention}, {layout}, c={c}) vs one device, {steps} AdamW steps",
    )
    res.equal(f"losses of {steps} steps", torch.tensor(losses), torch.tensor(ref_losses), ADAMW)
    res.equal(f"weights after {steps} steps", state, ref.state_dict(), ADAMW)
    return res


# =========================================================================== one spawn for the notebook


def notebook_suite(timed_rounds: int = 5) -> dict:
    """Rank function: what the chapter's context-parallel half measures, in one spawn.

    One rate for the clocked parts (:func:`block_rate` on the :data:`BLOCK`-token block both use). Returns
    ``{"equality", "traffic", "memory", "timeline", "balance", "training", "seconds"}``;
    ``seconds`` is each part's wall time on this rank.
    """
    seconds, out = {}, {}

    def run(name, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out[name] = fn(*args, **kwargs)
        seconds[name] = time.perf_counter() - t0

    run("equality", attention_equality)
    run("traffic", attention_traffic)
    run("memory", attention_memory)
    run("rate", block_rate, 1, 4, BLOCK, 32)
    run("timeline", ring_timeline, rounds=timed_rounds, rate=out["rate"])
    run("balance", zigzag_balance, rounds=timed_rounds, rate=out["rate"])
    run("training", cp_gpt_training)
    out["seconds"] = seconds
    return out
