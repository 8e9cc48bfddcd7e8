"""Chapter 04, part 3: FSDP2 in practice — clipping, activation checkpointing, meta-device init, checkpoints.

Rank functions (run with ``launch.spawn``; each returns a :class:`common.Result`):

* :func:`clip_grad_norm` — ``clip_grad_norm_`` on FSDP2's DTensor gradients equals one device;
* :func:`activation_checkpointing` — per-block checkpointing: what stays saved, measured with
  torch's ``FSDPMemTracker`` (a ``MemTracker``) against the formula, and what the recompute costs;
* :func:`meta_device_init` — build on ``torch.device("meta")``, shard, ``to_empty``, then load the
  weights broadcast from rank 0: no rank but the source ever allocates the full model;
* :func:`checkpoint_save` / :func:`checkpoint_load` — a DCP checkpoint saved at one world size
  loads at another (1, 4); a full state dict exported for one-device inference.

(Our ``SavedTensorMeter`` cannot measure checkpointing: non-reentrant checkpoint installs its own
saved-tensor hooks, which shadow ours, so it would read ≈0. A dispatch-mode tracker sees every
allocation regardless.)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..formulas import checkpointed_block_activation_bytes
from ..fsdp import (
    fsdp2_wrap,
    full_state_dict,
    full_training_state,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)
from ..fsdp_meters import tracker_bytes
from ..launch import device
from ..memory import model_state_bytes
from ..models import GPT, GPTConfig
from ..results import EXACT, SGD
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
)
from .fsdp import digest
from .fsdp_features import cpu_state, features_config

__all__ = [
    "clip_grad_norm",
    "activation_checkpointing",
    "meta_device_init",
    "checkpoint_save",
    "checkpoint_load",
    "eval_batch",
    "flat_vs_per_parameter",
]


# =========================================================================== clipping


@dataclass
class ClipResult(Result):
    world_size: int
    max_norm: float
    norms: list  # total gradient norm before clipping, each step (a full, replicated number)
    norm_type: str
    reference_norms: list
    max_abs_diff: float
    full_state: dict = field(repr=False, default_factory=dict)

    def add_rows(self, reference: dict) -> "ClipResult":
        """``reference``: one device's state dict after the same clipped steps."""
        self.condition(
            "clip_grad_norm_ returns the global norm (a DTensor, reduced over ranks)",
            self.norm_type,
            self.norm_type == "DTensor",
            "a DTensor",
        )
        self.condition(
            "every step clipped (norm > max_norm)",
            min(self.norms),
            all(v > self.max_norm for v in self.norms),
            ">",
            reference=self.max_norm,
            against="max_norm",
        )
        self.equal(
            "norms equal one device's (rel 1e-5)",
            self.norms,
            self.reference_norms,
            SGD,
            against="one device's clip_grad_norm_",
        )
        self.equal(
            "weights equal one device's (max |Δ| ≤ 1e-6, SGD)",
            self.full_state,
            reference,
            SGD,
            against="one device (full batch)",
        )
        return self


def clip_grad_norm(
    steps: int = 3, max_norm: float = 0.05, global_batch: int = 8, config: GPTConfig | None = None
) -> ClipResult:
    """Rank function: ``torch.nn.utils.clip_grad_norm_`` on FSDP2's sharded DTensor gradients.

    Each rank holds 1/N of every gradient; the norm is reduced over ranks inside DTensor (each
    rank's sum of squares, all-reduced), so every rank scales by the same global factor.
    """
    config = config or features_config()
    n, dev = dist.get_world_size(), device()
    model = fsdp2_wrap(GPT(config, seed=0).to(dev))
    opt = make_optimizer("sgd", model.parameters())
    norms, kind = [], []

    def clip():
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        kind.append(type(total).__name__)
        norms.append((total.full_tensor() if hasattr(total, "full_tensor") else total).item())

    for step in range(steps):
        train_step(
            model,
            opt,
            *shard_batch(*step_batch(step, config, global_batch, dev)),
            after_backward=clip,
        )
    reference, _, ref_norms = reference_run(
        config, steps, global_batch, "sgd", max_norm=max_norm, dev=dev
    )
    full = full_state_dict(model)
    result = ClipResult(
        n, max_norm, norms, kind[0], ref_norms, state_diff(full, reference), cpu_state(full)
    )
    return result.add_rows(reference.state_dict())


# =========================================================================== activation checkpointing


@dataclass
class CheckpointingResult(Result):
    world_size: int
    n_layer: int
    local_batch: int
    block_stack_activation_bytes: (
        dict  # {"none"/"per_block": Activation bytes the blocks add in forward}
    )
    activation_after_forward: dict  # {variant: all Activation bytes after the forward}
    peak: dict  # {variant: peak total bytes over forward + backward}
    formula_bytes: int  # formulas.checkpointed_block_activation_bytes: L block inputs
    step_s: dict  # {variant: median step seconds}
    forward_s: float  # median forward-only seconds (no checkpointing): what the recompute repeats
    same_gradients: bool
    step_s_rounds: dict = field(default_factory=dict, repr=False)  # {variant: seconds per round}

    @property
    def recompute_s(self) -> float:
        """Extra seconds per step that checkpointing cost (≈ one more forward of the blocks), measured."""
        return self.step_s["per_block"] - self.step_s["none"]

    def add_rows(self) -> "CheckpointingResult":
        got, peak = self.block_stack_activation_bytes, self.peak
        self.within(
            "with checkpointing the blocks keep only their inputs (formula, within 5 %)",
            got["per_block"],
            self.formula_bytes,
            0.05,
            against="formula L·b·s·h·4",
        )
        self.condition(
            "checkpointing keeps fewer activation bytes than no checkpointing",
            got["per_block"],
            got["per_block"] < got["none"],
            "<",
            reference=got["none"],
            against="no checkpointing",
        )
        self.condition(
            "and lowers the step's peak",
            peak["per_block"],
            peak["per_block"] < peak["none"],
            "<",
            reference=peak["none"],
            against="no checkpointing",
        )
        self.condition(
            "gradients are bit-identical with and without checkpointing",
            self.same_gradients,
            self.same_gradients,
            "torch.equal, every gradient",
        )
        return self


def activation_checkpointing(
    config: GPTConfig | None = None, global_batch: int = 8, rounds: int = 3
) -> CheckpointingResult:
    """Rank function: FSDP2 with and without ``checkpoint_wrapper`` on every block (non-reentrant).

    ZeRO shards model states, not activations. Checkpointing a block saves only its input for
    backward and reruns its forward there: the block stack then keeps L·b·s·h floats (the residual
    stream between blocks) instead of every intermediate. Measured with ``FSDPMemTracker``: the
    Activation bytes just before block 0 and just after block L−1 (forward hooks) — their
    difference is what the blocks leave behind. Also the whole step's peak, the time per step
    (interleaved rounds) and a forward alone (the recompute is one more block forward).
    """
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    config = config or features_config()
    n, dev = dist.get_world_size(), device()
    check_global_batch(global_batch, n)
    x, y = shard_batch(*step_batch(0, config, global_batch, dev))
    models, opts, stack, after, peak, grads = {}, {}, {}, {}, {}, {}
    for variant in ("none", "per_block"):
        model = GPT(config, seed=0).to(dev)
        if variant == "per_block":
            for i, block in enumerate(model.blocks):
                model.blocks[i] = checkpoint_wrapper(block)
        model = fsdp2_wrap(model)
        opt = make_optimizer("adamw", model.parameters())
        train_step(model, opt, x, y)
        opt.zero_grad(set_to_none=True)
        tracker, marks = FSDPMemTracker(model, opt), {}

        def mark(key, marks=marks, tracker=tracker):  # activation bytes held at this point
            marks[key] = tracker_bytes(tracker.get_tracker_snapshot(), dev).get("Activation", 0)

        handles = [
            model.blocks[0].register_forward_pre_hook(lambda m, a, mark=mark: mark("before")),
            model.blocks[-1].register_forward_hook(lambda m, a, o, mark=mark: mark("after")),
        ]
        tracker.track_inputs((x, y))
        with tracker:
            _, loss = model(x, y)
            after[variant] = tracker_bytes(tracker.get_tracker_snapshot(), dev).get("Activation", 0)
            loss.backward()
        for h in handles:
            h.remove()
        stack[variant] = marks["after"] - marks["before"]
        peak[variant] = tracker_bytes(tracker.get_tracker_snapshot("peak"), dev)["Total"]
        grads[variant] = [p.grad.to_local().clone() for p in model.parameters()]
        models[variant], opts[variant] = model, opt

    def forward_only():
        with torch.no_grad():
            models["none"](x, y)

    steps = {v: (lambda v=v: train_step(models[v], opts[v], x, y)) for v in models}
    rounds_s = race({**steps, "forward": forward_only}, rounds=rounds)
    times = median_times(rounds_s)
    same = all(torch.equal(a, b) for a, b in zip(grads["none"], grads["per_block"], strict=True))
    formula = checkpointed_block_activation_bytes(
        config.n_layer, x.shape[0], x.shape[1], config.d_model
    )
    return CheckpointingResult(
        n,
        config.n_layer,
        x.shape[0],
        stack,
        after,
        peak,
        formula,
        {v: times[v] for v in models},
        times["forward"],
        same,
        {v: rounds_s[v] for v in models},
    ).add_rows()


# =========================================================================== meta-device initialisation


@dataclass
class MetaInitResult(Result):
    world_size: int
    rank: int
    full_model_bytes: int  # 4Ψ: what a plain construction allocates on every rank
    construction_peak: int  # meta build + fully_shard + to_empty, measured (MemTracker)
    load_peak: int  # set_model_state_dict(broadcast_from_rank0) on this rank, measured (rank 0: + its source)
    shard_bytes: int  # parameters held after loading
    meta_before_to_empty: bool
    max_abs_diff: float  # vs GPT(seed=0), on the rank
    full_state: dict = field(repr=False, default_factory=dict)

    def add_rows(self, reference: dict) -> "MetaInitResult":
        """``reference``: the one-device init's state dict (``GPT(seed=0)``)."""
        full, peak, shards = self.full_model_bytes, self.construction_peak, self.shard_bytes
        self.condition(
            "parameters stay on the meta device until to_empty",
            self.meta_before_to_empty,
            self.meta_before_to_empty,
            "every parameter is_meta",
        )
        self.condition(
            "constructing allocates only this rank's shards (< full model)",
            peak,
            peak < full,
            "<",
            reference=full,
            against="4Ψ, the full model",
        )
        self.condition(
            "the construction peak is this rank's shards (≤ 1.2 × shard bytes), not the model",
            peak,
            peak <= 1.2 * shards,
            "≤ 1.2 ×",
            reference=shards,
            against="this rank's shard bytes",
        )
        self.condition(
            "after loading a rank holds only its shards",
            shards,
            shards < full,
            "<",
            reference=full,
            against="4Ψ, the full model",
        )
        self.equal(
            "the broadcast weights equal the one-device init exactly",
            self.full_state,
            reference,
            EXACT,
            against="GPT(seed=0) on one device",
        )
        return self


def meta_device_init(config: GPTConfig | None = None) -> MetaInitResult:
    """Rank function: ``torch.device("meta")`` + ``fully_shard`` + ``to_empty`` + broadcast from rank 0.

    On the meta device a module has shapes and no storage: construction costs nothing, and
    ``fully_shard`` shards the (meta) parameters. ``to_empty`` then allocates only the local
    shards, uninitialised. The values come from a full state dict that only rank 0 holds (loaded
    from a file, here built with the one-device init), loaded with ``set_model_state_dict(...,
    StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))``: rank 0 broadcasts each
    tensor, every rank keeps its shard. (Initialising a DTensor's shard with a random init on
    each rank would not equal the one-device init: the generator would run per rank, per shard.)
    """
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    config = config or features_config()
    n, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    tracker = MemTracker()
    with tracker:
        with torch.device("meta"):
            model = GPT(config, seed=0)  # init_weights skips meta tensors
        model = fsdp2_wrap(model)
        on_meta = all(p.is_meta for p in model.parameters())
        model.to_empty(device=dev)
    construction = tracker_bytes(tracker.get_tracker_snapshot("peak"), dev).get("Total", 0)
    reference = GPT(config, seed=0).to(dev)
    source = reference.state_dict() if rank == 0 else {}
    tracker = MemTracker()
    with tracker:
        set_model_state_dict(
            model, source, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        )
    full = full_state_dict(model)
    result = MetaInitResult(
        n,
        rank,
        4 * reference.num_params(),
        construction,
        tracker_bytes(tracker.get_tracker_snapshot("peak"), dev).get("Total", 0),
        model_state_bytes(model)["params"],
        on_meta,
        state_diff(full, reference),
        cpu_state(full),
    )
    return result.add_rows(reference.state_dict())


# =========================================================================== sharded checkpoints


def eval_batch(config: GPTConfig, dev=None):
    """The fixed batch whose logits are compared after a checkpoint (step 1000's, 4 sequences)."""
    return step_batch(1000, config, 4, dev)


@dataclass
class CheckpointResult(Result):
    world_size: int
    path: str
    digest: dict  # SHA-256 per tensor of the full training state (model and AdamW state)
    logits: torch.Tensor = field(repr=False)  # FSDP2 logits on eval_batch (CPU)
    local_shapes: dict = field(default_factory=dict)
    inference_path: str | None = None  # rank 0: the full model state dict, torch.save'd

    def add_rows(self) -> "CheckpointResult":
        kinds = {k.split(".")[0] for k in self.digest}
        self.condition(
            "the checkpoint holds model and optimizer state",
            sorted(kinds),
            kinds == {"model", "optim"},
            "model.* and optim.* tensors",
        )
        return self


def checkpoint_save(
    tmp_dir: str, steps: int = 2, global_batch: int = 8, config: GPTConfig | None = None
) -> CheckpointResult:
    """Rank function: train ``steps`` AdamW steps, save a sharded DCP checkpoint, export a full state dict.

    ``fsdp.save_sharded_checkpoint``: every rank writes its own shards. For one-device inference
    ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` gathers full tensors to rank 0
    (a collective: every rank calls it), which writes them with ``torch.save``: the file loads into a
    plain ``GPT`` with ``load_state_dict``.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    config = config or features_config()
    n, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    check_global_batch(global_batch, n)
    model = fsdp2_wrap(GPT(config, seed=0).to(dev))
    opt = make_optimizer("adamw", model.parameters())
    for step in range(steps):
        train_step(model, opt, *shard_batch(*step_batch(step, config, global_batch, dev)))
    path = os.path.join(os.fspath(tmp_dir), f"dcp_w{n}")
    save_sharded_checkpoint(model, opt, path)
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    inference = None
    if rank == 0:
        inference = os.path.join(os.fspath(tmp_dir), f"model_w{n}.pt")
        torch.save(full, inference)
    dist.barrier()  # every file complete before anyone reads
    return CheckpointResult(
        n,
        path,
        digest(full_training_state(model, opt)),
        _logits(model, config, dev),
        {k: tuple(p.to_local().shape) for k, p in model.named_parameters()},
        inference,
    ).add_rows()


def _logits(model, config, dev) -> torch.Tensor:
    x, _ = eval_batch(config, dev)
    with torch.no_grad():
        return model(x)[0].cpu()


def checkpoint_load(path: str, config: GPTConfig | None = None) -> CheckpointResult:
    """Rank function: load a DCP checkpoint saved at any world size into a fresh FSDP2 model (other init).

    DCP reshards on load: each rank reads the global slice its new shard covers from whichever
    files hold it — ``torch.chunk`` rows at this world size, e.g. a 189-row weight as 48/48/48/45
    rows at N = 4 after 95/94 at N = 2. ``fsdp.load_sharded_checkpoint`` checks the keys and shapes first.
    """
    config = config or features_config()
    dev = device()
    model = fsdp2_wrap(GPT(config, seed=123).to(dev))
    opt = make_optimizer("adamw", model.parameters())
    load_sharded_checkpoint(model, opt, path)
    return CheckpointResult(
        dist.get_world_size(),
        path,
        digest(full_training_state(model, opt)),
        _logits(model, config, dev),
        {k: tuple(p.to_local().shape) for k, p in model.named_parameters()},
    ).add_rows()


# =========================================================================== why FSDP2: FSDP1's FlatParameter


@dataclass
class FlatVsPerParameterResult(Result):
    world_size: int
    fsdp1_flat_params: dict  # {unit: (local FlatParameter shape, numel incl. padding, parameters flattened into it)}
    fsdp1_param_shapes: (
        dict  # {parameter: shape the optimizer sees} — 1-D views into the flat shard
    )
    fsdp2_param_shapes: dict  # {parameter: (global shape, local shape)} — DTensor Shard(0)
    cpu_offload_error: (
        str  # what CPUOffloadPolicy says on a machine without an accelerator ("" if it worked)
    )

    def add_rows(self) -> "FlatVsPerParameterResult":
        flat = [s for s, _, _ in self.fsdp1_flat_params.values()]
        self.condition(
            "FSDP1 keeps one 1-D FlatParameter per unit",
            flat,
            all(len(s) == 1 for s in flat),
            "every unit's shard 1-D",
        )
        shapes = self.fsdp2_param_shapes
        own = [n for n, (g, loc) in shapes.items() if len(g) == len(loc) and g[1:] == loc[1:]]
        self.condition(
            "FSDP2 keeps every parameter with its own shape (dim 0 sharded)",
            f"{len(own)} of {len(shapes)}",
            len(own) == len(shapes),
            "all parameters",
        )
        cut = [
            n
            for n, (numel,) in self.fsdp1_param_shapes.items()
            if numel % math.prod(shapes[n][0][1:])
        ]
        self.condition(
            "FSDP1's shard cuts some weight in the middle of a row", cut, bool(cut), "at least one"
        )
        return self


def flat_vs_per_parameter(config: GPTConfig | None = None) -> FlatVsPerParameterResult:
    """Rank function: the same model under FSDP1 (``FullyShardedDataParallel``) and FSDP2 (``fully_shard``).

    FSDP1 flattens each unit's parameters into one ``FlatParameter``, pads it and keeps 1/N of the
    flat vector: a rank's shard can end in the middle of a weight, per-parameter settings (frozen
    weights, another dtype, a per-tensor optimizer) fight the flattening, and a checkpoint needs
    the flat layout's metadata. FSDP2 shards each parameter on dim 0 as a ``DTensor``: the optimizer
    sees parameters with their own shapes, and state dicts are DTensors that DCP reshards.
    Also tries ``CPUOffloadPolicy`` (keeping shards in pinned host memory): it needs an accelerator.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if dist.get_world_size() < 2:  # FSDP1 keeps whole (unflattened-shape) parameters on one rank
        raise ValueError(
            f"flat_vs_per_parameter compares shards: it needs world_size >= 2, got {dist.get_world_size()}"
        )

    from ..models import Block

    config = config or features_config(n_layer=2)
    dev = device()
    fsdp1 = FullyShardedDataParallel(
        GPT(config, seed=0).to(dev),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        device_id=dev,
        use_orig_params=True,
    )
    flat = {}
    for name, m in fsdp1.named_modules():
        if isinstance(m, FullyShardedDataParallel) and m._handle is not None:
            fp = m._handle.flat_param
            flat[name.replace("_fsdp_wrapped_module.", "") or "<root>"] = (
                tuple(fp.shape),
                fp.numel(),
                [n.replace("_fsdp_wrapped_module.", "") for n in fp._fqns],
            )
    fsdp1_shapes = {
        n.replace("_fsdp_wrapped_module.", ""): tuple(p.shape) for n, p in fsdp1.named_parameters()
    }
    fsdp2 = fsdp2_wrap(GPT(config, seed=0).to(dev))
    fsdp2_shapes = {
        n: (tuple(p.shape), tuple(p.to_local().shape)) for n, p in fsdp2.named_parameters()
    }
    error = ""
    try:
        fully_shard(GPT(config, seed=0).to(dev), offload_policy=CPUOffloadPolicy())
    except Exception as exc:  # noqa: BLE001 - shown in the notebook
        error = f"{type(exc).__name__}: {exc}"
    return FlatVsPerParameterResult(
        dist.get_world_size(), flat, fsdp1_shapes, fsdp2_shapes, error
    ).add_rows()
