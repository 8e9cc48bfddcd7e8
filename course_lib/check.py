"""Exercise checker: run the learner's function on real ranks against the reference behaviour.

``check("ring_all_reduce")`` imports ``exercises.ch00_collectives.ring_all_reduce``, runs it
on real gloo/nccl ranks with :func:`course_lib.launch.spawn`, compares every rank's result
with the library collective, and returns a :class:`CheckResult` whose text says which rank,
which tensor and how large the error was. An exercise still raising ``NotImplementedError``
is reported as *unsolved* (with its hint), never as a crash of the checker.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .launch import RankError, RankTimeout, spawn

__all__ = ["check", "CheckResult", "EXERCISES", "Exercise"]


@dataclass
class CheckResult:
    name: str
    status: str  # "passed" | "failed" | "unsolved" | "error"
    message: str
    details: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def __str__(self) -> str:
        mark = {"passed": "PASS", "failed": "FAIL", "unsolved": "UNSOLVED", "error": "ERROR"}[self.status]
        return f"[{mark}] {self.name}: {self.message}"

    def _repr_pretty_(self, p, cycle) -> None:  # IPython shows the sentence, not the dataclass
        p.text(str(self))


@dataclass(frozen=True)
class Exercise:
    module: str  # file under exercises/ and solutions/
    function: str
    summary: str
    runner: Callable  # rank function(fn) -> list of failure strings on this rank (empty = ok)
    world_sizes: tuple = (2, 3)


# --------------------------------------------------------------------------- rank-side checks


def _check_ring_all_reduce(fn) -> list[str]:
    import torch
    import torch.distributed as dist

    from . import comm

    rank = dist.get_rank()
    problems = []
    for numel in (1, 10, 1003):
        gen = torch.Generator().manual_seed(1000 * rank + numel)
        x = torch.randn(numel, generator=gen)
        expected = x.clone()
        dist.all_reduce(expected)
        got = x.clone()
        with comm.CommLog() as log:
            out = fn(got)
        if out is None:
            out = got
        if out.shape != expected.shape:
            problems.append(f"rank {rank}, tensor of {numel} elements: returned shape {tuple(out.shape)}, "
                            f"expected {tuple(expected.shape)}")
            continue
        err = (out - expected).abs().max().item()
        if not err <= 1e-5 * max(1.0, expected.abs().max().item()):
            problems.append(f"rank {rank}, tensor of {numel} elements: max |error| {err:.3g} vs dist.all_reduce")
        if log.count(op="all_reduce"):
            problems.append(f"rank {rank}: used all_reduce; the exercise asks for send/recv only")
    return problems


def _check_count_model_state_bytes(fn) -> list[str]:
    import torch

    from .memory import model_state_bytes
    from .models import GPT, tiny_config

    problems = []
    for tie in (True, False):
        model = GPT(tiny_config(tie_weights=tie, n_layer=1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _, loss = model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
        loss.backward()
        opt.step()
        want = model_state_bytes(model, opt)
        got = fn(model, opt)
        for key in ("params", "grads", "optimizer"):
            if got.get(key) != want[key]:
                problems.append(f"tie_weights={tie}: {key} = {got.get(key)} bytes, expected {want[key]}")
    return problems


def _ddp_check_setup(rank: int, step: int):
    """A small equality GPT (tied weights, wpe frozen) and this rank's own batch for ``step``."""
    from .data import make_batch
    from .models import GPT, equality_config

    model = GPT(equality_config(vocab_size=32, block_size=16, n_layer=2, n_head=2, d_model=32), seed=0)
    model.wpe.weight.requires_grad_(False)
    x, y = make_batch(4, 16, 32, seed=100 * rank + step)
    return model, x, y


def _reference_grads(ref, x, y) -> dict:
    """Gradients of an identical, independent model, averaged with plain dist.all_reduce (not counted)."""
    import torch.distributed as dist

    ref.zero_grad(set_to_none=True)
    ref(x, y)[1].backward()
    out = {}
    for name, p in ref.named_parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            out[name] = p.grad / dist.get_world_size()
    return out


def _compare_grads(model, want: dict, rank: int, what: str) -> list[str]:
    problems = []
    for name, p in model.named_parameters():
        if name not in want:
            if p.grad is not None:
                problems.append(f"rank {rank}, {what}: {name} is frozen but got a gradient")
            continue
        if p.grad is None:
            problems.append(f"rank {rank}, {what}: {name}.grad is None")
            continue
        err = (p.grad - want[name]).abs().max().item()
        if not err <= 1e-6 + 1e-5 * want[name].abs().max().item():
            problems.append(f"rank {rank}, {what}: {name}.grad differs from the average over ranks "
                            f"by max |error| {err:.3g}")
    return problems


def _check_allreduce_gradients(fn) -> list[str]:
    import torch.distributed as dist

    from . import comm

    rank = dist.get_rank()
    model, x, y = _ddp_check_setup(rank, 0)
    want = _reference_grads(_ddp_check_setup(rank, 0)[0], x, y)
    model(x, y)[1].backward()
    with comm.CommLog() as log:
        fn(model)
    problems = _compare_grads(model, want, rank, "after allreduce_gradients")
    if not log.count(op="all_reduce", tag="grad"):
        problems.append(f"rank {rank}: CommLog saw no all-reduce tagged 'grad' — use "
                        "comm.all_reduce(p.grad, tag='grad') so the bytes are counted")
    return problems


def _check_bucketed_reducer(cls) -> list[str]:
    import torch.distributed as dist

    from . import comm

    rank = dist.get_rank()
    model, _, _ = _ddp_check_setup(rank, 0)
    ref = _ddp_check_setup(rank, 0)[0]
    reducer = cls(model, bucket_cap_mb=0.03)
    n_buckets = len(reducer.buckets)
    want_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    problems = []
    for step in range(3):  # several steps: the reducer must reset itself
        _, x, y = _ddp_check_setup(rank, step)
        want = _reference_grads(ref, x, y)
        model.zero_grad(set_to_none=True)
        with comm.CommLog() as log:
            model(x, y)[1].backward()
            launched = log.count(op="all_reduce", tag="grad")
            reducer.finish()
        if launched != n_buckets:
            problems.append(f"rank {rank}, step {step}: {launched} all-reduce(s) tagged 'grad' were launched "
                            f"during backward, expected one per bucket = {n_buckets} (launch each bucket from "
                            "the hook, as soon as it is complete)")
        sent = log.total("tensor_bytes", tag="grad")
        if sent != want_bytes:
            problems.append(f"rank {rank}, step {step}: all-reduced {sent} bytes tagged 'grad', expected the "
                            f"trainable parameters' {want_bytes} bytes (each gradient exactly once)")
        problems += _compare_grads(model, want, rank, f"step {step} after finish()")
        if problems:
            break
    return problems


def _close(got, want, rtol: float = 1e-5, atol: float = 1e-5) -> tuple[bool, float]:
    """(every element within atol + rtol·|want|, max |error|) — torch.testing.assert_close's rule."""
    diff = (got.detach() - want.detach()).abs()
    return bool((diff <= atol + rtol * want.detach().abs()).all()), diff.max().item()


def _check_zero1_step(cls) -> list[str]:
    """ZeRO-1 on N ranks, each on 1/N of the batch, == AdamW on one device over the whole batch."""
    import torch
    import torch.distributed as dist

    from . import comm
    from .data import make_batch
    from .models import GPT, equality_config

    rank, world = dist.get_rank(), dist.get_world_size()
    # Ψ = 26,272: not a multiple of 3, so the padding is exercised at N = 3
    config = equality_config(vocab_size=32, block_size=16, n_layer=2, n_head=2, d_model=32)
    model, ref = GPT(config, seed=0), GPT(config, seed=0)
    options = dict(lr=1e-2, weight_decay=0.1, eps=1e-6)  # eps: see COURSE_DESIGN's note on Adam and ~0 gradients
    zero1 = cls(model, torch.optim.AdamW, **options)
    ref_opt = torch.optim.AdamW(ref.parameters(), **options)
    padded, shard = zero1.flat_params.numel(), zero1.shard.numel()
    problems = []
    for step in range(3):
        x, y = make_batch(6, 16, 32, seed=step)  # the global batch; rank r trains on its 1/N of it
        ref(x, y)[1].backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model(x.chunk(world)[rank], y.chunk(world)[rank])[1].backward()
        with comm.CommLog() as log:
            zero1.step()
        zero1.zero_grad()
        where = f"rank {rank}, step {step}"
        if log.count(op="all_reduce"):
            problems.append(f"{where}: used all_reduce; ZeRO-1 replaces it by its two halves, "
                            "comm.reduce_scatter(tag='grad') and comm.all_gather(tag='param')")
        scattered = [r.numel for r in log.select(op="reduce_scatter", tag="grad")]
        if scattered != [padded]:
            problems.append(f"{where}: expected one reduce_scatter tagged 'grad' of the whole flat gradient "
                            f"({padded} elements); CommLog saw {scattered or 'none'}")
        gathered = [r.numel for r in log.select(op="all_gather", tag="param")]
        if gathered != [padded]:
            problems.append(f"{where}: expected one all_gather tagged 'param' into flat_params ({padded} "
                            f"elements); CommLog saw {gathered or 'none'}")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            ok, err = _close(p, q)
            if not ok:
                problems.append(f"{where}: parameter {name} differs from single-device AdamW on the whole batch "
                                f"by max |error| {err:.3g} (did you divide the reduce-scattered sum by N?)")
        if problems:
            return problems
    state = sum(t.numel() for st in zero1.optimizer.state.values() for t in st.values()
                if torch.is_tensor(t) and t.dim() > 0)
    if state != 2 * shard:
        problems.append(f"rank {rank}: the optimizer state holds {state} elements, expected 2 × {shard} "
                        "(AdamW's two moments for this rank's shard only)")
    return problems


def _check_sharded_linear(cls) -> list[str]:
    """Outputs, input gradients and shard gradients == a full nn.Linear's; the full weight is freed in between."""
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from . import comm

    rank, world = dist.get_rank(), dist.get_world_size()
    in_f, out_f = 7, 5  # 35 weight elements: padded at N = 2 and 3
    full = nn.Linear(in_f, out_f, bias=False)
    with torch.no_grad():
        full.weight.copy_(torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(0)))
    layer = cls(copy.deepcopy(full))
    size = -(-full.weight.numel() // world)  # S
    if layer.shard.numel() != size:
        return [f"rank {rank}: shard has {layer.shard.numel()} elements, expected ceil(35 / {world}) = {size}"]
    problems = []
    for step in range(2):  # twice: the freed storage must be refillable
        where = f"rank {rank}, step {step}"
        # every rank's input and loss weights (known everywhere, so each rank can build the reference)
        gens = [torch.Generator().manual_seed(100 * step + q) for q in range(world)]
        xs = [torch.randn(2, 3, in_f, generator=g) for g in gens]  # a (batch, time, features) input
        gs = [torch.randn(2, 3, out_f, generator=g) for g in gens]  # loss = Σ y · g, so dL/dy = g
        x = xs[rank].clone().requires_grad_()
        layer.shard.grad = None
        with comm.CommLog() as log:
            y = layer(x)
        held = layer.full_weight.untyped_storage().size()
        if held:
            problems.append(f"{where}: after forward full_weight still holds {held} bytes; free it "
                            "(untyped_storage().resize_(0)) as soon as F.linear has run")
        if log.count(op="all_gather", tag="param") != 1:
            problems.append(f"{where}: forward issued {log.count(op='all_gather', tag='param')} all_gather(s) "
                            "tagged 'param', expected exactly 1")
        x_ref = xs[rank].clone().requires_grad_()
        y_ref = full(x_ref)
        if y.shape != y_ref.shape:
            return problems + [f"{where}: output has shape {tuple(y.shape)}, nn.Linear's {tuple(y_ref.shape)}"]
        ok, err = _close(y, y_ref)
        if not ok:
            return problems + [f"{where}: output differs from nn.Linear's by max |error| {err:.3g}"]
        with comm.CommLog() as log:
            (y * gs[rank]).sum().backward()
        held = layer.full_weight.untyped_storage().size()
        if held:
            problems.append(f"{where}: after backward full_weight still holds {held} bytes; free it again")
        counts = (log.count(op="all_gather", tag="param"), log.count(op="reduce_scatter", tag="grad"))
        if counts != (1, 1):
            problems.append(f"{where}: backward issued {counts[0]} all_gather(s) tagged 'param' and {counts[1]} "
                            "reduce_scatter(s) tagged 'grad', expected 1 and 1 (re-gather W, scatter dL/dW)")
        (y_ref * gs[rank]).sum().backward()
        if x.grad is None:
            problems.append(f"{where}: the input got no gradient (return grad_x from backward)")
        else:
            ok, err = _close(x.grad, x_ref.grad)
            if not ok:
                problems.append(f"{where}: input gradient differs from nn.Linear's by max |error| {err:.3g}")
        # the weight gradient data parallelism wants: the average over ranks of each rank's dL/dW
        want = sum(g.reshape(-1, out_f).T @ xq.reshape(-1, in_f) for g, xq in zip(gs, xs)) / world
        want = torch.cat([want.reshape(-1), torch.zeros(size * world - want.numel())])[rank * size:(rank + 1) * size]
        if layer.shard.grad is None:
            problems.append(f"{where}: shard.grad is None after backward (return the reduce-scattered gradient "
                            "as the shard's gradient)")
        else:
            ok, err = _close(layer.shard.grad, want)
            if not ok:
                problems.append(f"{where}: shard.grad differs from slice {rank} of the rank-averaged full weight "
                                f"gradient by max |error| {err:.3g}")
        if problems:
            return problems
    return problems



def _check_fsdp2_wrap_blocks(fn) -> list[str]:
    """One FSDP2 unit per block plus the root: L+1 all-gathers per pass, and one SGD step == one device."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from .data import make_batch
    from .fsdp import CollectiveCounter, fsdp_config, full_state_dict
    from .launch import device
    from .models import GPT

    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    config = fsdp_config(n_layer=3)
    units = config.n_layer + 1
    problems = []
    for reshard in (True, False):
        where = f"rank {rank}, reshard_after_forward={reshard}"
        model = GPT(config, seed=0).to(dev)
        out = fn(model, init_device_mesh(dev.type, (world,)), reshard_after_forward=reshard)
        model = out if out is not None else model
        if not isinstance(model, FSDPModule):
            return problems + [f"{where}: the root is not wrapped — call fully_shard(model, mesh=mesh, ...) "
                               f"after the blocks"]
        unwrapped = [i for i, b in enumerate(model.blocks) if not isinstance(b, FSDPModule)]
        if unwrapped:
            return problems + [f"{where}: block(s) {unwrapped} are not wrapped — call fully_shard on every "
                               f"block of model.blocks before the root"]
        reference = GPT(config, seed=0).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        x, y = make_batch(2 * world, config.block_size, config.vocab_size, seed=0)
        x, y = x.to(dev), y.to(dev)
        with CollectiveCounter() as cc:
            _, loss = model(x.chunk(world)[rank], y.chunk(world)[rank])
            cc.phase = "backward"
            loss.backward()
        opt.step()
        reference(x, y)[1].backward()
        ref_opt.step()
        fwd, bwd = cc.count("all_gather", "forward"), cc.count("all_gather", "backward")
        scatters = cc.count("reduce_scatter")
        want_bwd = units if reshard else 0
        if fwd != units:
            problems.append(f"{where}: {fwd} all-gather(s) in forward, expected {units} (one per block and one "
                            f"for the root)" + (" — one unit gathers the whole model at once: wrap each block "
                                                "before the root" if fwd == 1 else ""))
        if bwd != want_bwd:
            why = "the forward freed the gathered weights" if reshard else "the forward kept them"
            problems.append(f"{where}: {bwd} all-gather(s) in backward, expected {want_bwd} ({why}; pass "
                            f"reshard_after_forward to every fully_shard call, the root's too)")
        if scatters != units:
            problems.append(f"{where}: {scatters} reduce-scatter(s), expected {units} (one per unit)")
        full, ref = full_state_dict(model), reference.state_dict()
        err = max((full[k] - ref[k]).abs().max().item() for k in ref)
        if not err <= 1e-6:
            problems.append(f"{where}: after one SGD step the weights differ from one device's (full batch) by "
                            f"max |error| {err:.3g}")
        if problems:
            return problems
    return problems


def _check_sharded_checkpoint(cls) -> list[str]:
    """DCP save writes one file per rank; load into a fresh model restores everything; resume is bit-exact."""
    import os
    import shutil
    import tempfile

    import torch
    import torch.distributed as dist

    from .data import make_batch
    from .fsdp import full_training_state, fsdp2_wrap, fsdp_config, full_state_dict
    from .launch import device
    from .models import GPT

    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    config = fsdp_config()
    box = [tempfile.mkdtemp(prefix="course_ckpt_") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    path = os.path.join(box[0], "ckpt")

    def build(seed):
        model = fsdp2_wrap(GPT(config, seed=seed).to(dev))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def train(model, opt, steps):
        for step in steps:
            x, y = make_batch(2 * world, config.block_size, config.vocab_size, seed=step)
            opt.zero_grad(set_to_none=True)
            model(x.chunk(world)[rank].to(dev), y.chunk(world)[rank].to(dev))[1].backward()
            opt.step()

    problems = []
    try:
        model, opt = build(0)
        train(model, opt, range(2))
        saved = full_training_state(model, opt)
        cls.save(model, opt, path)
        dist.barrier()
        files = sorted(os.listdir(path)) if os.path.isdir(path) else []
        want = [".metadata"] + [f"__{r}_0.distcp" for r in range(world)]
        if files != want:
            problems.append(f"rank {rank}: the checkpoint at path holds {files}, expected {want} — dcp.save(..., "
                            f"checkpoint_id=path) on every rank writes one file per rank and .metadata")
        fresh, fresh_opt = build(123)  # other weights, no optimizer state
        cls.load(fresh, fresh_opt, path)
        restored = full_training_state(fresh, fresh_opt)
        wrong = [k for k in saved if k not in restored or not torch.equal(restored[k], saved[k])]
        if wrong:
            problems.append(f"rank {rank}: after load, {len(wrong)} of {len(saved)} tensors differ from the saved "
                            f"ones, e.g. {wrong[0]} (load the optimizer state too, with set_state_dict)")
        train(model, opt, range(2, 4))
        train(fresh, fresh_opt, range(2, 4))
        a, b = full_state_dict(model), full_state_dict(fresh)
        err = max((a[k] - b[k]).abs().max().item() for k in a)
        if err != 0.0:
            problems.append(f"rank {rank}: two steps after resuming, the weights differ from the uninterrupted "
                            f"run by max |error| {err:.3g} (expected bit-for-bit equal)")
        dist.barrier()
    finally:
        if rank == 0:
            shutil.rmtree(box[0], ignore_errors=True)
    return problems

EXERCISES: dict[str, Exercise] = {
    "ring_all_reduce": Exercise("ch00_collectives", "ring_all_reduce",
                                "ch00: sum a tensor over ranks with send/recv around a ring",
                                _check_ring_all_reduce),
    "count_model_state_bytes": Exercise("ch01_memory", "count_model_state_bytes",
                                        "ch01: bytes of params, grads and optimizer state over unique storages",
                                        _check_count_model_state_bytes, world_sizes=(1,)),
    "allreduce_gradients": Exercise("ch02_ddp", "allreduce_gradients",
                                    "ch02: average every gradient over ranks after backward (naive DDP)",
                                    _check_allreduce_gradients),
    "bucketed_reducer": Exercise("ch02_ddp", "BucketedReducer",
                                 "ch02: async all-reduce of gradient buckets launched during backward",
                                 _check_bucketed_reducer),
    "zero1_step": Exercise("ch03_zero", "Zero1Step",
                           "ch03: ZeRO-1 step: reduce-scatter gradients, step own shard, all-gather parameters",
                           _check_zero1_step),
    "sharded_linear": Exercise("ch03_zero", "ShardedLinear",
                               "ch03: ZeRO-3 for one nn.Linear: gather before use, free after, reduce-scatter "
                               "the weight gradient", _check_sharded_linear),
    "fsdp2_wrap_blocks": Exercise("ch04_fsdp", "wrap_blocks",
                                  "ch04: FSDP2 units — fully_shard every block, then the root",
                                  _check_fsdp2_wrap_blocks),
    "sharded_checkpoint": Exercise("ch04_fsdp", "ShardedCheckpoint",
                                   "ch04: save and restore FSDP2 model + optimizer shards with DCP",
                                   _check_sharded_checkpoint),
}


# --------------------------------------------------------------------------- parent side


def _course_root() -> Path:
    """The folder holding exercises/ and solutions/ (the repository root)."""
    return Path(__file__).resolve().parents[1]


def _load(package: str, ex: Exercise) -> Callable:
    root = str(_course_root())
    if root not in sys.path:
        sys.path.insert(0, root)
    module = importlib.import_module(f"{package}.{ex.module}")
    module = importlib.reload(module)  # pick up the learner's latest edit
    import cloudpickle

    cloudpickle.register_pickle_by_value(module)  # ranks run exactly this code, whatever their sys.path
    return getattr(module, ex.function)


def check(name: str, package: str = "exercises", timeout: float = 120) -> CheckResult:
    """Check exercise ``name`` (from ``exercises/``, or ``package="solutions"``) on real ranks."""
    if name not in EXERCISES:
        raise ValueError(f"unknown exercise {name!r}; available: {', '.join(sorted(EXERCISES))}")
    if package not in ("exercises", "solutions"):
        raise ValueError(f"package must be 'exercises' or 'solutions', got {package!r}")
    ex = EXERCISES[name]
    try:
        fn = _load(package, ex)
    except Exception as exc:  # noqa: BLE001 - a syntax error in the learner's file is a result, not a crash
        return CheckResult(name, "error", f"could not import {package}/{ex.module}.py: {type(exc).__name__}: {exc}")
    details = []
    for world in ex.world_sizes:
        try:
            per_rank = spawn(ex.runner, world, args=(fn,), timeout=timeout)
        except RankError as err:
            if err.exc_type == "NotImplementedError":
                hint = str(err.__cause__ or "").strip() or "still a TODO"
                return CheckResult(name, "unsolved", f"not implemented yet — {hint}")
            return CheckResult(name, "error", f"world_size={world}: rank {err.rank} raised {err.exc_type}: "
                                              f"{str(err.__cause__ or err).splitlines()[0]}")
        except RankTimeout as err:
            return CheckResult(name, "error", f"world_size={world}: {str(err).splitlines()[0]} "
                                              "(a send without a matching recv?)")
        problems = [p for rank_problems in per_rank for p in rank_problems]
        if problems:
            return CheckResult(name, "failed", f"world_size={world}: {problems[0]}", problems)
        details.append(world)
    return CheckResult(name, "passed", f"matches the reference on world sizes {', '.join(map(str, details))}")
