"""torch.compile against eager on one device: compile time, step time, equal losses, graph breaks.

    eager, twin = twins()               # the tiny GPT twice, the same initial weights
    run = compile_vs_eager(eager, torch.compile(twin))   # inductor on the CPU
    print(run)                          # equal losses (named tolerances), compile time, timing
    run.timings                         # course_lib.timing's interleaved rounds: eager vs compiled
    explain_breaks(with_item_break, x)  # {"graphs": 2, "breaks": 1, "reasons": [...]}

What is compared. Two copies of one GPT (same initial weights), each with its own AdamW, train
on the same batches through :func:`course_lib.train.train_step`; one of them is wrapped in
``torch.compile`` (the model only: forward and, through AOTAutograd, its backward; the optimizer
stays eager). The first loss comes before any update — the same forward computed by other code —
and must agree within :data:`~course_lib.results.REORDERED`; the later losses, after AdamW steps
that amplify rounding on near-zero gradients, within :data:`~course_lib.results.ADAMW`.

The compile cache. Inductor writes its generated C++ and Python under ``TORCHINDUCTOR_CACHE_DIR``;
:func:`use_project_cache` points it at the project's ``.cache/inductor`` (not committed) unless the
environment already names one. A clean clone compiles cold (the time printed); a second run reads
the cache.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..configs import make_optimizer
from ..data import make_batch
from ..models import GPT, tiny_config
from ..results import ADAMW, REORDERED, FieldAccess, Result
from ..timing import Timings, time_steps
from ..train import train_step

__all__ = [
    "CACHE_DIR",
    "use_project_cache",
    "quiet_dynamo",
    "CompileRun",
    "twins",
    "compile_vs_eager",
    "with_item_break",
    "explain_breaks",
]

CACHE_DIR = Path(__file__).resolve().parents[2] / ".cache" / "inductor"


def use_project_cache() -> str:
    """Point inductor's cache at ``.cache/inductor``; returns the directory in use.

    A directory the environment names is kept, except inductor's own default
    (``<tmp>/torchinductor_<user>``), which inductor writes into ``TORCHINDUCTOR_CACHE_DIR`` the
    first time anything asks for its cache (importing some torch modules does)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if named is None or os.path.abspath(named) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(CACHE_DIR)
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


@contextmanager
def quiet_dynamo():
    """Dynamo logs each graph break as a warning (with the user's source line); while the break is
    the lesson, :func:`explain_breaks` returns the reasons instead. Only errors pass meanwhile."""
    log = logging.getLogger("torch._dynamo")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@dataclass
class CompileRun(FieldAccess, Result):
    """Eager against compiled: per-step losses, the first steps' seconds, the interleaved timing.

    ``compile_s``: the first compiled step (Dynamo traces, AOTAutograd derives the backward,
    the backend generates and compiles kernels, then the step runs); ``cold``: the cache directory
    was empty before it (a clean clone's first run); ``first_eager_s``: the first eager step.
    ``timings``: :func:`course_lib.timing.time_steps` of later steps."""

    backend: str = ""
    cold: bool = True
    compile_s: float = 0.0
    first_eager_s: float = 0.0
    losses: dict = field(default_factory=dict)
    timings: Timings | None = None

    def table(self) -> str:
        text = super().table() + (
            f"\nfirst step: eager {self.first_eager_s * 1e3:.1f} ms, compiled "
            f"{self.compile_s:.1f} s (tracing + compiling + one step, backend {self.backend!r}, "
            + ("cold cache)" if self.cold else "the cache held earlier runs' code)")
        )
        return text + ("\n\n" + str(self.timings) if self.timings is not None else "")


def twins(config=None, seed: int = 0) -> tuple[GPT, GPT]:
    """Two GPTs with the same initial weights (``config``: default :func:`tiny_config`)."""
    cfg = tiny_config() if config is None else config
    torch.manual_seed(seed)
    eager = GPT(cfg)
    twin = GPT(cfg)
    twin.load_state_dict(eager.state_dict())
    return eager, twin


def compile_vs_eager(
    eager: torch.nn.Module,
    compiled: torch.nn.Module,
    batch_size: int = 32,
    steps: int = 5,
    rounds: int = 5,
    steps_per_round: int = 2,
    backend: str = "inductor",
) -> CompileRun:
    """Train ``eager`` and ``compiled`` (``torch.compile`` of its twin, :func:`twins`) on the same
    batches; compare their losses and time their steps.

    Each gets its own AdamW (:func:`course_lib.configs.make_optimizer`). ``steps`` training steps
    give the compared losses (batch ``i`` is ``make_batch(..., seed=i)``); the first compiled
    step also compiles. Then ``rounds`` interleaved rounds of ``steps_per_round`` steps on one
    batch time both. ``backend``: the name ``compiled`` was compiled with, for the table
    (``"aot_eager"`` traces and derives the backward but generates no kernels: a quick check of
    the harness)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1 (the first loss is compared), got {steps}")
    cache = Path(use_project_cache())
    cold = not (cache.is_dir() and any(cache.iterdir()))
    cfg = eager.config
    opt_e = make_optimizer("adamw", eager.parameters())
    opt_c = make_optimizer("adamw", compiled.parameters())
    losses = {"eager": [], "compiled": []}
    seconds = {}
    for i in range(steps):
        x, y = make_batch(batch_size, cfg.block_size, cfg.vocab_size, seed=i)
        for name, m, o in (("eager", eager, opt_e), ("compiled", compiled, opt_c)):
            t0 = time.perf_counter()
            losses[name].append(train_step(m, o, x, y))
            seconds.setdefault(name, time.perf_counter() - t0)
    timings = time_steps(
        {
            "eager": lambda: train_step(eager, opt_e, x, y),
            "compiled": lambda: train_step(compiled, opt_c, x, y),
        },
        rounds=rounds,
        steps_per_round=steps_per_round,
        title=f"one AdamW step of the GPT, b={batch_size}: eager vs torch.compile ({backend})",
    )
    res = CompileRun(
        title=f"torch.compile ({backend}) against eager, b={batch_size}, {steps} AdamW steps",
        backend=backend,
        cold=cold,
        compile_s=seconds["compiled"],
        first_eager_s=seconds["eager"],
        losses=losses,
        timings=timings,
    )
    res.equal(
        "loss of step 1 (before any update)",
        losses["compiled"][0],
        losses["eager"][0],
        REORDERED,
        "eager",
    )
    res.equal(
        f"losses of steps 1–{steps}",
        losses["compiled"],
        losses["eager"],
        ADAMW,
        "eager",
    )
    return res


def with_item_break(logits: torch.Tensor) -> torch.Tensor:
    """A forward tail with one graph break: ``.item()`` turns a tensor into a Python number, and
    the branch on it is Python control flow that no graph can hold."""
    scale = logits.abs().max().item()
    if scale > 1.0:
        logits = logits / scale
    return torch.softmax(logits, dim=-1)


def explain_breaks(fn, *args) -> dict:
    """``torch._dynamo.explain(fn)(*args)`` in short: ``{graphs, breaks, reasons}`` (each reason's
    first line), with Dynamo's per-break warnings kept out of the output."""
    with quiet_dynamo():
        ex = torch._dynamo.explain(fn)(*args)
    return {
        "graphs": ex.graph_count,
        "breaks": ex.graph_break_count,
        "reasons": [r.reason.strip().splitlines()[0] for r in ex.break_reasons],
    }
