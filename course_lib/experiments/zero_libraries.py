"""Chapter 03, the libraries: torch's ``ZeroRedundancyOptimizer`` and DeepSpeed ZeRO beside our own ZeRO.

``course_lib/zero.py`` and ``zero3.py`` build ZeRO-1/2/3 from scratch. This file runs the two libraries a learner
meets in practice on the same tiny GPT, and measures them with the same ruler
(``memory.model_state_bytes``'s rule: bytes of every *unique storage* a rank holds), so that the
numbers can be put next to the ZeRO formulas (Rajbhandari et al. 2019, arXiv:1910.02054) and
next to ours. Both are rank functions: run them with ``launch.spawn(fn, 2, kwargs=...)``; they build
their models and batches on ``launch.device()``. DeepSpeed's set-up and the walk that finds each of
its bytes are in :mod:`course_lib.experiments.zero_deepspeed`.

``torch_zero1_memory``
    ``torch.distributed.optim.ZeroRedundancyOptimizer`` is ZeRO-1 (optimizer states only) in
    plain PyTorch. It partitions at **parameter granularity**: whole tensors are dealt out to
    ranks greedily (largest first, to the rank with the fewest elements so far). A tensor is
    never split, so when one tensor is bigger than Ψ/N (an embedding, typically) its owner holds
    more than its share. We measure each rank's optimizer-state bytes and report the imbalance
    ``max/mean``; our ZeRO (flat, padded, evenly split buffers) has imbalance 1 by construction.

``deepspeed_zero`` / ``deepspeed_zero_stages``
    DeepSpeed (``deepspeed.initialize``) on CPU with gloo, ZeRO stages 0-3. It prints more than it
    should (silenced here) and JIT-compiles a C++ op on first use (cached, see
    ``torch_extensions_dir``). Its config sets ``gradient_clipping`` to 0: DeepSpeed's default
    is 1.0, which clips the global gradient norm of chapter 03's model (vocabulary 512, norm
    above 1 in its first steps) and so moved every stage, 0 included, about one AdamW step
    (lr) away from an unclipped device; the tests' model (vocabulary 32) stays below 1 and
    never showed it. Unclipped, every stage trains like one device within ``ADAMW``.
    It is measured per rank against the course's fp32 formula on
    the padded count Ψ: stage 0 16Ψ, stage 1 8Ψ + 8Ψ/N, stage 2 4Ψ + 12Ψ/N, stage 3 16Ψ/N.
    DeepSpeed holds **more**, and every byte of the difference has a name in its source
    (``deepspeed/runtime/zero/stage_1_and_2.py``, ``stage3.py``; see ``deepspeed_decomposition``):

    1. an **fp32 master partition** (``single_partition_of_fp32_groups`` in stages 1/2,
       ``fp32_partitioned_groups_flat`` in stage 3) -- a ``.clone()`` of this rank's slice of
       the weights, kept even when the model already is fp32. In mixed precision that copy *is*
       the 4 of K = 12; in fp32 it is pure extra: **+4Ψ/N** in stages 1, 2 and 3. So stage 1
       measures 8Ψ + 12Ψ/N and stage 3, between backward and step, 20Ψ/N (1.25 x the formula).
    2. **gradients not yet partitioned** (stages 2/3, at the peak of backward): a gradient waits
       in its bucket until the bucket is reduced, and stage 2's partition buffer spans the whole
       tensors at both ends of its slice. Both are bounded by a few tensors: large next to the
       tiny GPT's Ψ/N, negligible for a real model.
    3. **buffers** (reported apart, not model states): a reduction bucket of
       ``reduce_bucket_size`` elements (the default, 5e8 elements, is a 2 GB fp32 buffer -- so we
       set it small) and, in stage 3, the gathered full weights of the module that is running.

    Padding: DeepSpeed pads the flat parameter group to a multiple of 2N elements (stages 1/2,
    ``nccl_start_alignment_factor * N``); stage 3 splits every tensor into N equal pieces, padding
    each to a multiple of N. Ψ_pad is that padded count.

``offload_optimizer`` (ZeRO-Offload, Ren et al. 2021, arXiv:2101.06840)
    DeepSpeed's answer to "the optimizer states do not fit in GPU memory": keep the fp32 master
    weights and Adam's moments in CPU memory and run the optimizer step on the CPU
    (``DeepSpeedCPUAdam``, a vectorised C++ Adam), so the GPU holds only the 16-bit weights and
    gradients. ``deepspeed_zero(stage, offload_optimizer=True)`` turns it on (stages 1-3). On a
    CPU-only machine there is nothing to save -- the "device" already is the CPU -- and the first
    call compiles ``cpu_adam`` (about 45 s), so the tests do not run it.

Everything here degrades gracefully: ``deepspeed_available()`` says whether DeepSpeed can run
(importable, a C++ compiler, Python headers for its JIT build) and why not.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..configs import small_config
from ..data import make_batch
from ..formulas import zero_model_state_breakdown
from ..launch import device
from ..memory import model_state_bytes, storage_bytes, tensors_in
from ..models import GPT, GPTConfig, tiny_config
from ..results import ADAMW, FieldAccess, Result
from ..train import shard_batch, train_step
from .zero_deepspeed import (
    deepspeed_available,
    full_params,
    import_deepspeed,
    psi_padded,
    snapshot,
    torch_extensions_dir,
)

__all__ = [
    "torch_zero1_memory",
    "zero1_partition",
    "deepspeed_available",
    "torch_extensions_dir",
    "deepspeed_zero",
    "deepspeed_zero_stages",
    "deepspeed_config",
    "deepspeed_expected_bytes",
    "deepspeed_decomposition",
    "deepspeed_table",
    "zero1_table",
    "reference_training",
    "Zero1Memory",
    "DeepSpeedZero",
]

# This section's AdamW: lr 3e-3, weight decay 0.1 (the libraries' runs predate configs.OPTIMIZERS),
# and the course's eps = 1e-6 (see configs.py): with torch's 1e-8, an element whose gradient is
# ~1e-8 turns the 1e-10 rounding difference between one device and N ranks into an update
# difference of up to lr * 1e-10 / eps -- 3e-5 measured on chapter 03's model, next to ADAMW's 5e-5
LR, WEIGHT_DECAY, EPS = 3e-3, 0.1, 1e-6
SEQ_LEN = 16


def _mean_loss(local: float) -> float:
    """The loss of the whole global batch, as one device would see it: the ranks' mean, in fp32."""
    total = torch.tensor(local, device=device())  # fp32, as the loss itself
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _batch(step: int, config: GPTConfig, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step`` (global batch = micro_batch * N), on its device."""
    x, y = make_batch(
        micro_batch * dist.get_world_size(),
        min(SEQ_LEN, config.block_size),
        config.vocab_size,
        seed=step,
    )
    x, y = shard_batch(x, y)
    return x.to(device()), y.to(device())


# =========================================================================== torch ZeRO-1


def zero1_partition(sizes: list[int], world_size: int) -> list[list[int]]:
    """The greedy rule ``ZeroRedundancyOptimizer`` uses to deal parameters out to ranks.

    Sort by size, largest first; give each tensor to the rank with the fewest elements so far
    (the "longest processing time first" heuristic). Returns the indices into ``sizes`` per rank.
    No tensor is ever split: a tensor bigger than ``sum(sizes) / world_size`` makes its owner
    hold more than an even share, whatever the others get.
    """
    owned: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(
        range(len(sizes)), key=lambda i: sizes[i], reverse=True
    ):  # stable, like torch's sort
        r = load.index(min(load))
        owned[r].append(i)
        load[r] += sizes[i]
    return owned


@dataclass
class Zero1Memory(FieldAccess, Result):
    """torch's ``ZeroRedundancyOptimizer`` on one rank, with every rank's optimizer bytes."""

    rank: int
    world_size: int
    psi: int
    losses: list  # mean over the global batch, per step
    per_rank: list  # [{"rank", "param_numel", "n_tensors", "optimizer_bytes", "names"}, ...]
    total_optimizer_bytes: int
    ideal_bytes: float  # 8Ψ/N: fp32 AdamW split evenly
    imbalance: float  # max / mean of optimizer_bytes
    max_over_ideal: float
    model_state: dict  # this rank's model-state bytes (memory.model_state_bytes)


def torch_zero1_memory(
    config: GPTConfig | None = None, steps: int = 2, micro_batch: int = 4
) -> Zero1Memory:
    """Rank function: torch's ``ZeroRedundancyOptimizer`` (ZeRO-1) on the tiny GPT; per-rank optimizer bytes.

    Gradients are averaged by torch DDP (``gradient_as_bucket_view=True``: each ``.grad`` is a
    view into DDP's bucket, so no second copy); the optimizer is
    ``ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW)``: each rank runs a
    local AdamW over the parameters it owns and broadcasts them after its step.

    ``config`` defaults to ``tiny_config(vocab_size=2048)``: an embedding of 2048 x 64 = 131k
    elements, more than half of the model's 233k -- the common case in language models, where the
    embedding is the largest single tensor (GPT-2 small: 38M of 124M). Pass ``tiny_config()``
    to see the default model, whose 28 tensors split almost evenly at N = 2.

    Measured after ``steps`` steps (so AdamW's state exists), on every rank:
    ``optimizer_bytes`` = unique storages in the local optimizer's state (``exp_avg``,
    ``exp_avg_sq`` and a 4-byte ``step`` per tensor), ``param_numel`` / ``n_tensors`` owned.
    Every rank returns the whole table (gathered with ``all_gather_object``). Rows: the ranks'
    optimizer bytes add up to one device's AdamW state exactly (8Ψ + 4 B per tensor), and each
    rank owns what the greedy rule :func:`zero1_partition` predicts.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    config = config or tiny_config(vocab_size=2048)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = GPT(config, seed=0).to(device())
    names = {id(p): n for n, p in model.named_parameters()}
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = ZeroRedundancyOptimizer(
        ddp.parameters(),
        optimizer_class=torch.optim.AdamW,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        eps=EPS,
    )
    losses = []
    for step in range(steps):
        losses.append(_mean_loss(train_step(ddp, opt, *_batch(step, config, micro_batch))))

    local = opt.optim  # this rank's AdamW, over the parameters it owns
    owned = [p for g in local.param_groups for p in g["params"]]
    mine = {
        "rank": rank,
        "param_numel": sum(p.numel() for p in owned),
        "n_tensors": len(owned),
        "optimizer_bytes": storage_bytes(tensors_in(local.state)),
        "names": [names[id(p)] for p in owned],
    }
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, mine)
    sizes = [p.numel() for p in model.parameters()]
    psi = sum(sizes)
    total = sum(r["optimizer_bytes"] for r in per_rank)
    ideal = 8 * psi / world
    result = Zero1Memory(
        rank=rank,
        world_size=world,
        psi=psi,
        losses=losses,
        per_rank=per_rank,
        total_optimizer_bytes=total,
        ideal_bytes=ideal,
        imbalance=max(r["optimizer_bytes"] for r in per_rank) / (total / world),
        max_over_ideal=max(r["optimizer_bytes"] for r in per_rank) / ideal,
        model_state=model_state_bytes(model, local),
        title=f"torch ZeroRedundancyOptimizer (ZeRO-1), N = {world}, Ψ = {psi:,}",
    )
    result.exact(
        "optimizer bytes, summed over ranks",
        total,
        8 * psi + 4 * len(sizes),
        against="one device's AdamW: 8Ψ + 4 B per tensor",
    )
    predicted = sorted(sum(sizes[i] for i in owned) for owned in zero1_partition(sizes, world))
    result.exact(
        "elements owned per rank (sorted)",
        sorted(r["param_numel"] for r in per_rank),
        predicted,
        against="zero1_partition: largest first, to the least loaded",
    )
    return result


# =========================================================================== DeepSpeed


def deepspeed_config(
    stage: int,
    micro_batch: int = 4,
    *,
    offload_optimizer: bool = False,
    bucket_elements: int = 1024,
) -> dict:
    """The DeepSpeed config used here (a plain dict; DeepSpeed also accepts a JSON file path).

    Bucket sizes are set to ``bucket_elements`` instead of DeepSpeed's defaults of 5e8 elements
    (a 2 GB fp32 reduction buffer -- sized for billion-parameter models, allocated in full even
    for ours). ``gradient_clipping=0.0``: DeepSpeed clips the gradients' global norm at 1.0
    by default (``GRADIENT_CLIPPING_DEFAULT``), one device here does not clip.
    ``stage3_param_persistence_threshold=0``: by default stage 3 does *not*
    partition parameters smaller than 1e5 elements (it keeps them whole on every rank, to save
    all-gathers) -- that would be every tensor of the tiny GPT -- and
    ``stage3_max_reuse_distance=0`` releases a module's gathered weights right after use (by
    default a weight needed again soon, i.e. in backward, stays gathered).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r} must be 0, 1, 2 or 3")
    zero = {"stage": stage}
    if stage > 0:
        zero.update(
            reduce_bucket_size=bucket_elements,
            allgather_bucket_size=bucket_elements,
            overlap_comm=False,
            contiguous_gradients=True,
        )
    if stage == 3:
        zero.update(
            stage3_param_persistence_threshold=0,
            stage3_prefetch_bucket_size=bucket_elements,
            stage3_max_live_parameters=bucket_elements,
            stage3_max_reuse_distance=0,
        )
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        # DeepSpeed clips the global gradient norm at 1.0 unless told otherwise; one device does not
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "steps_per_print": 10**9,  # never print throughput
        "wall_clock_breakdown": False,
    }
    if offload_optimizer:
        if stage == 0:
            raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        # ZeRO-Offload steps on the CPU with DeepSpeedCPUAdam: let DeepSpeed build it from the config
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "eps": EPS},
        }
    return config


def deepspeed_expected_bytes(psi_pad: int, world_size: int, stage: int) -> dict:
    """Course formula (fp32 AdamW) and what DeepSpeed adds to it, per rank, in bytes.

    ``formula``: 16Ψ / 8Ψ+8Ψ/N / 4Ψ+12Ψ/N / 16Ψ/N for stages 0-3. ``master``: the fp32 master
    partition DeepSpeed keeps in stages 1-3 even for an fp32 model, 4Ψ/N. ``expected`` = their
    sum: the model states DeepSpeed holds at the peak, before its buffers.
    """
    formula = zero_model_state_breakdown(psi_pad, world_size, stage, precision="fp32")
    master = 4 * psi_pad / world_size if stage > 0 else 0.0
    return dict(
        formula=formula["total"],
        formula_breakdown=formula,
        master=master,
        expected=formula["total"] + master,
    )


@dataclass
class DeepSpeedZero(FieldAccess, Result):
    """DeepSpeed ZeRO at one stage on one rank: bytes decomposed; training vs one device."""

    stage: int
    world_size: int
    rank: int
    psi: int
    psi_pad: int
    losses: list  # mean over the global batch, per step
    optimizer_type: str
    held: dict  # snapshot after the last engine.backward, before engine.step
    peak: dict  # the largest snapshot during the last backward
    measured: dict  # the peak's model states: params, grads, master, optimizer, total
    buffers: int
    buffers_detail: dict
    formula: float
    formula_breakdown: dict
    fp32_master: int
    master_expected: float
    expected: float
    grad_overhang: int
    in_flight_grads: int
    adam_step: int
    rest: float
    bounds: dict
    ratio: float  # measured / formula
    ratio_expected: float  # measured / (formula + 4Ψ_pad/N)
    params: dict | None = None  # full weights by name (with return_params)


def _deepspeed_rows(r: DeepSpeedZero, reference: dict, params: dict) -> None:
    """Every byte named (formula, master, overhang, in-flight, Adam steps); = one device."""
    m, f = r.measured, r.formula_breakdown
    if r.stage > 0:
        r.exact(
            "fp32 master partition (B)",
            r.fp32_master,
            4 * r.psi_pad // r.world_size,
            against="4Ψ_pad/N, kept even for an fp32 model",
        )
    r.exact("parameter bytes", m["params"], f["params"], against="formula")
    r.exact(
        "optimizer bytes",
        m["optimizer"],
        f["optimizer"] + r.adam_step,
        against="formula + Adam step counters",
    )
    r.condition(
        "gradient overhang (B)",
        r.grad_overhang,
        0 <= r.grad_overhang <= r.bounds["grad_overhang"],
        f"0 … {r.bounds['grad_overhang']:,} (2 × largest tensor)",
    )
    r.condition(
        "in-flight gradients (B)",
        r.in_flight_grads,
        0 <= r.in_flight_grads <= r.bounds["in_flight_grads"],
        f"0 … {r.bounds['in_flight_grads']:,} (bucket + largest tensor)",
    )
    pad = 4 * (r.psi_pad - r.psi)
    r.condition("unexplained bytes", r.rest, abs(r.rest) <= pad, f"|rest| ≤ {pad} (4 B × padding)")
    r.equal("mean loss per step", r.losses, reference["losses"], ADAMW)
    r.equal(f"weights after {len(r.losses)} steps", params, reference["params"], ADAMW)


def deepspeed_zero(
    stage: int,
    config: GPTConfig | None = None,
    steps: int = 3,
    offload_optimizer: bool = False,
    *,
    micro_batch: int = 4,
    bucket_elements: int = 1024,
    return_params: bool = False,
) -> DeepSpeedZero:
    """Rank function: train the tiny GPT with DeepSpeed ZeRO ``stage`` (0-3); measure what each rank holds.

    The process group our launcher created is reused: ``deepspeed.initialize(...,
    dist_init_required=False)`` finds ``torch.distributed`` initialised and wraps it (its
    ``init_distributed`` creates a ``TorchBackend`` without calling ``init_process_group``);
    on CPU it picks its CPU accelerator and gloo. The optimizer is a plain
    ``torch.optim.AdamW`` that DeepSpeed's ZeRO optimizer wraps (with ``offload_optimizer``,
    DeepSpeed builds ``DeepSpeedCPUAdam`` from the config instead; see the module docstring).

    Each rank trains on its slice of ``make_batch(micro_batch * N, seed=step)`` -- the same data a
    single device would see as one batch (``reference_training``). ``config`` defaults to
    ``experiments.common.small_config()`` (26k params).

    What is measured (unique storages, per rank), in the last step, category by category:

    * ``params``: the module's weights (stages 1/2: views into ``bit16_groups_flat``, one flat
      buffer; stage 3: each parameter's ``ds_tensor`` slice, views into
      ``fp16_partitioned_groups_flat`` -- the "fp16" names are historical, here they are fp32);
    * ``grads``: ``.grad`` of the module's params, the gradients DeepSpeed keeps for its partition
      (``averaged_gradients``, ``grads_in_partition``, ``grad_partitions_flat_buffer``);
    * ``master``: the fp32 master partition (``single_partition_of_fp32_groups`` /
      ``fp32_partitioned_groups_flat``);
    * ``optimizer``: the torch AdamW's state (it steps the master partition: 8Ψ/N + 4-byte step);
    * ``buffers``: any other tensor reachable from the ZeRO optimizer (reduction buckets, the
      stage-3 gather buffer, ...) and, in stage 3, gathered full weights; ``buffers_detail`` names them.

    ``peak`` is the largest (in total bytes) such snapshot over the last backward pass: one is taken in a hook as
    each parameter's gradient arrives (before DeepSpeed's own hook moves it), one after backward.
    ZeRO-1 holds every full gradient until the end of backward; ZeRO-2 and 3 reduce them bucket by
    bucket as they arrive -- only the peak shows that difference. ``held`` is the snapshot after
    ``engine.backward`` (before ``engine.step``), when every category exists.

    Returns (per rank) a :class:`DeepSpeedZero`: ``stage``, ``world_size``, ``rank``, ``psi``,
    ``psi_pad``, ``losses`` (mean over the global batch), ``optimizer_type``, ``held``, ``peak``,
    plus
    ``deepspeed_decomposition``'s keys (``measured``, ``formula``, ``fp32_master``,
    ``in_flight_grads``, ``rest``, ``ratio`` ...) and, with ``return_params``, ``params``: the full
    weights by name after training. Rows: the master partition is 4Ψ_pad/N, parameter and
    optimizer bytes are the formula's (+ Adam's step counters), overhang and in-flight gradients
    within their bounds, nothing unexplained beyond padding, and losses and weights equal
    :func:`reference_training` (one device, ``ADAMW``).

    What the tiny GPT shows at N = 2 (Ψ = 26,272): stage 1 measures formula + 4Ψ/N + 4 bytes
    (ratio 1.17 = 14/12); stage 3 ``held`` is exactly 20Ψ/N (ratio 1.25); stages 2/3 add
    in-flight gradients of at most a few tensors at the peak, large here only because the model
    is tiny (one 4096-element MLP weight is almost a third of Ψ/N = 13,136).
    """
    if steps < 2:
        raise ValueError(
            f"steps={steps}: need >= 2 (AdamW's state exists only after the first step)"
        )
    deepspeed = import_deepspeed()
    config = config or small_config()
    world, rank = dist.get_world_size(), dist.get_rank()
    model = GPT(config, seed=0).to(device())
    psi = model.num_params()
    ds_config = deepspeed_config(
        stage, micro_batch, offload_optimizer=offload_optimizer, bucket_elements=bucket_elements
    )
    optimizer = (
        None
        if offload_optimizer
        else torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS)
    )
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints build and config messages
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config, dist_init_required=False
        )

    peak: dict = {"total": -1}

    def on_grad(grad):  # runs as a gradient arrives, before it is accumulated into .grad
        nonlocal peak
        snap = snapshot(engine, extra_grads=[grad])
        if snap["total"] > peak["total"]:
            peak = snap
        return None

    losses, held, hooks = [], None, []
    for step in range(steps):
        if step == steps - 1:
            hooks = [
                p.register_hook(on_grad) for p in engine.module.parameters() if p.requires_grad
            ]
        x, y = _batch(step, config, micro_batch)
        _, loss = engine(x, y)
        engine.backward(loss)
        if step == steps - 1:
            held = snapshot(engine)
            if held["total"] > peak["total"]:
                peak = held
            for h in hooks:
                h.remove()
        engine.step()
        losses.append(_mean_loss(loss.item()))

    psi_pad = psi_padded(engine, psi, stage, world)
    largest = max(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    params = full_params(engine, deepspeed, stage)
    result = DeepSpeedZero(
        stage=stage,
        world_size=world,
        rank=rank,
        psi=psi,
        psi_pad=psi_pad,
        losses=losses,
        optimizer_type=type(engine.optimizer).__name__,
        held=held,
        peak=peak,
        **deepspeed_decomposition(
            peak, psi_pad, world, stage, bucket_elements=bucket_elements, largest_numel=largest
        ),
        params=params if return_params else None,
        title=f"DeepSpeed ZeRO stage {stage}, N = {world}, rank {rank} "
        "(bytes at the peak of backward)",
    )
    engine.destroy()
    _deepspeed_rows(result, reference_training(config, steps, micro_batch * world), params)
    return result


def deepspeed_decomposition(
    peak: dict,
    psi_pad: int,
    world_size: int,
    stage: int,
    *,
    bucket_elements: int,
    largest_numel: int,
) -> dict:
    """Split DeepSpeed's measured peak into the course formula and four named extras.

    ``measured`` (the peak without ``buffers``) = ``formula`` + ``fp32_master`` + ``grad_overhang``
    + ``in_flight_grads`` + ``adam_step`` + ``rest``, where

    * ``formula``: the course's fp32 formula on Ψ_pad (``zero_model_state_breakdown``);
    * ``fp32_master``: the master partition DeepSpeed keeps in stages 1-3 (measured; 4Ψ_pad/N);
    * ``grad_overhang`` (stage 2): DeepSpeed's gradient partition (``grads_in_partition``) spans
      every tensor that *overlaps* this rank's slice, whole -- up to one tensor too many at each end
      of the slice (bound: 2 x the largest tensor). Stage 3 partitions each tensor, so no overhang;
    * ``in_flight_grads`` (stages 2/3): gradients that arrived but wait for their bucket to be
      reduced. A bucket is reduced when the next gradient would overflow it, so while one gradient
      arrives at most ``max(bucket, largest tensor)`` elements wait: bound
      4 * (max(bucket_elements, largest) + largest) bytes. (Stage 1 holds all gradients anyway.)
    * ``adam_step``: AdamW's 0-d ``step`` tensor, 4 bytes per tensor it steps (one flat partition
      in stages 1-3, every parameter in stage 0);
    * ``rest``: what is left unexplained -- 0 bytes on the runs in this course.

    ``ratio`` = measured / formula; ``ratio_expected`` = measured / (formula + 4Ψ_pad/N master).
    ``bounds`` holds the two bounds above.
    """
    exp = deepspeed_expected_bytes(psi_pad, world_size, stage)
    measured = {c: peak[c] for c in ("params", "grads", "master", "optimizer")}
    measured["total"] = sum(measured.values())
    share = int(exp["formula_breakdown"]["grads"])  # 4Ψ/N in stages 2/3
    overhang = (
        max(0, peak["grad_partition"] - share) if stage == 2 and peak["grad_partition"] else 0
    )
    in_flight = max(0, peak["grads"] - share - overhang) if stage >= 2 else 0
    rest = (
        measured["total"]
        - exp["formula"]
        - peak["master"]
        - overhang
        - in_flight
        - peak["adam_step"]
    )
    bounds = {
        "grad_overhang": 4 * 2 * largest_numel if stage == 2 else 0,
        "in_flight_grads": 4 * (max(bucket_elements, largest_numel) + largest_numel)
        if stage >= 2
        else 0,
    }
    return dict(
        measured=measured,
        buffers=peak["buffers"],
        buffers_detail=peak["buffers_detail"],
        formula=exp["formula"],
        formula_breakdown=exp["formula_breakdown"],
        fp32_master=peak["master"],
        master_expected=exp["master"],
        expected=exp["expected"],
        grad_overhang=overhang,
        in_flight_grads=in_flight,
        adam_step=peak["adam_step"],
        rest=rest,
        bounds=bounds,
        ratio=measured["total"] / exp["formula"],
        ratio_expected=measured["total"] / exp["expected"],
    )


def deepspeed_zero_stages(
    stages=(0, 1, 2, 3), config: GPTConfig | None = None, steps: int = 3, **kwargs
) -> list[DeepSpeedZero]:
    """Rank function: ``deepspeed_zero`` for several stages in one process (one spawn, one DeepSpeed import).

    Each stage builds a fresh model and engine (``engine.destroy()`` after each); returns the
    list of ``deepspeed_zero`` results in ``stages`` order. ``kwargs`` go to ``deepspeed_zero``.
    """
    return [deepspeed_zero(stage, config=config, steps=steps, **kwargs) for stage in stages]


def reference_training(
    config: GPTConfig | None = None, steps: int = 3, global_batch: int = 8
) -> dict:
    """Single-device AdamW on the full batch -- what ``deepspeed_zero`` at any stage should equal.

    Returns ``{"losses", "params"}``; needs no ranks (``deepspeed_zero`` runs it for its equality
    rows, a notebook or test may run it in its own process).
    """
    config = config or small_config()
    model = GPT(config, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS)
    losses = []
    for step in range(steps):
        x, y = make_batch(
            global_batch, min(SEQ_LEN, config.block_size), config.vocab_size, seed=step
        )
        losses.append(train_step(model, opt, x, y))
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


# =========================================================================== printing (parent side)


def deepspeed_table(results: list[dict]) -> str:
    """One row per stage from ``deepspeed_zero`` results (one rank's dict per stage), bytes per rank.

    ``measured = formula + fp32 master + grad overhang + in-flight grads + Adam step + rest``
    (see ``deepspeed_decomposition``); ``buffers`` are extra working memory, not model states.
    """
    if not results:
        return "(no results)"
    r0 = results[0]
    lines = [
        f"DeepSpeed ZeRO, fp32 AdamW, N = {r0['world_size']}, Ψ = {r0['psi']:,} parameters "
        f"(bytes per rank at the peak of a backward pass)",
        f"{'stage':>5} {'Ψ_pad':>7} {'formula':>9} {'measured':>9} {'ratio':>6} | {'fp32 master':>11} "
        f"{'overhang':>8} {'in-flight':>9} {'step':>4} {'rest':>4} | {'buffers':>8}",
    ]
    for r in results:
        lines.append(
            f"{r['stage']:>5} {r['psi_pad']:>7,} {r['formula']:>9,.0f} {r['measured']['total']:>9,} "
            f"{r['ratio']:>6.3f} | {r['fp32_master']:>11,} {r['grad_overhang']:>8,} "
            f"{r['in_flight_grads']:>9,} {r['adam_step']:>4} {r['rest']:>4,.0f} | "
            f"{r['buffers']:>8,}"
        )
    return "\n".join(lines)


def zero1_table(result: dict) -> str:
    """Per-rank table from ``torch_zero1_memory`` (any rank's result: each holds the whole table)."""
    lines = [
        f"torch ZeroRedundancyOptimizer (ZeRO-1), N = {result['world_size']}, Ψ = {result['psi']:,}: "
        f"optimizer state per rank (ideal even split 8Ψ/N = {result['ideal_bytes']:,.0f} B)",
        f"{'rank':>4} {'tensors':>7} {'params':>8} {'optimizer B':>11} {'/ ideal':>7}  largest tensor",
    ]
    for r in result["per_rank"]:
        lines.append(
            f"{r['rank']:>4} {r['n_tensors']:>7} {r['param_numel']:>8,} {r['optimizer_bytes']:>11,} "
            f"{r['optimizer_bytes'] / result['ideal_bytes']:>7.3f}  {r['names'][0] if r['names'] else '-'}"
        )
    lines.append(f"imbalance max/mean = {result['imbalance']:.3f}")
    return "\n".join(lines)
