"""Chapter 03: DeepSpeed set-up (is it usable here, its JIT cache, a quiet import) and where it keeps each byte.

:mod:`course_lib.experiments.zero_libraries` runs DeepSpeed ZeRO and tells its story; this module holds
the plumbing it needs: :func:`deepspeed_available` (and why not), :func:`torch_extensions_dir` (its
C++ build cache), :func:`import_deepspeed` (inside a rank: CPU accelerator, silenced), and
:func:`snapshot` — the bytes of unique storages a rank holds, by category (params, grads, fp32
master, optimizer, buffers), found by walking DeepSpeed's ZeRO optimizer (attribute names of
deepspeed 0.19, ``runtime/zero/stage_1_and_2.py`` and ``stage3.py``) and counted with
:func:`course_lib.memory.unique_storage_bytes`.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from ..memory import storage_bytes, tensors_in, unique_storage_bytes

__all__ = [
    "deepspeed_available",
    "torch_extensions_dir",
    "import_deepspeed",
    "snapshot",
    "CATEGORIES",
    "psi_padded",
    "full_params",
]


# =========================================================================== set-up


def _cache_dir() -> Path:
    """``$COURSE_LIB_CACHE``, else ``<repo>/.cache`` (the Makefile sets the former to the latter)."""
    env = os.environ.get("COURSE_LIB_CACHE")
    return Path(env) if env else Path(__file__).resolve().parents[2] / ".cache"


def torch_extensions_dir() -> str:
    """Where DeepSpeed's JIT-built C++ ops are cached: ``<cache>/torch_extensions``.

    DeepSpeed's first use on a CPU machine compiles ``deepspeed_shm_comm`` (~30 s; its
    shared-memory all-reduce) with torch's ``cpp_extension``, which caches the build under
    ``$TORCH_EXTENSIONS_DIR``. Keeping that inside the project makes the second run fast and
    ``make clean`` remove it.
    """
    return str(_cache_dir() / "torch_extensions")


@functools.lru_cache(maxsize=1)
def deepspeed_available() -> tuple[bool, str]:
    """``(True, "DeepSpeed 0.19.8")`` (its version) when DeepSpeed can run here, else ``(False, why not)``.

    Checks, in order: a C++ compiler (``c++`` on PATH) and ``Python.h`` (DeepSpeed JIT-compiles a
    C++ op on first use), then that ``import deepspeed`` works -- in a subprocess, so the check
    neither costs this process DeepSpeed's import nor lets its start-up warnings into a notebook.
    Notebooks and tests skip with the reason.
    """
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return False, "deepspeed is not installed (pip install deepspeed)"
    cxx = shutil.which("c++")
    if cxx is None:
        return False, "no C++ compiler (c++) on PATH: DeepSpeed compiles a C++ op on first use"
    include = sysconfig.get_paths().get("include", "")
    if not os.path.exists(os.path.join(include, "Python.h")):
        return (
            False,
            f"Python.h not found in {include}: install the Python development headers (python3-dev)",
        )
    env = dict(
        os.environ,
        DS_ACCELERATOR=os.environ.get(
            "DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda"
        ),
        PYTHONWARNINGS="ignore",
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", "import deepspeed; print(deepspeed.__version__)"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        return False, "import deepspeed did not finish within 120 s"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return False, f"import deepspeed failed: {last}"
    version = out.stdout.strip().splitlines()[-1]
    return True, f"DeepSpeed {version}"  # what a learner needs to know: which version ran


def import_deepspeed():
    """Import DeepSpeed inside a rank: cache its C++ builds, pick the CPU accelerator, silence it."""
    os.environ["TORCH_EXTENSIONS_DIR"] = torch_extensions_dir()
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        os.environ.setdefault(
            "DS_ACCELERATOR", "cpu"
        )  # skip its detection (and the warning it logs)
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    return deepspeed


# =========================================================================== measuring

# Where DeepSpeed's ZeRO optimizers keep things (attribute names in deepspeed 0.19, stage_1_and_2.py
# and stage3.py). Anything else holding a tensor is found by walking the optimizer and reported as
# "buffers", with the attribute it hangs from.
_PARAM_ATTRS = (
    "bit16_groups_flat",
    "fp16_partitioned_groups_flat",
)  # the (partitioned) weights, flat
_MASTER_ATTRS = (
    "single_partition_of_fp32_groups",
    "fp32_partitioned_groups_flat",
)  # fp32 master partition
_GRAD_ATTRS = (
    "averaged_gradients",
    "grads_in_partition",
    "grad_partitions_flat_buffer",
    "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",
    "all_grad_tensors",
)
CATEGORIES = ("params", "grads", "master", "optimizer", "buffers")


def _walk(obj, path: str, out: list, seen: set, depth: int = 0) -> None:
    """Collect ``(path, tensor)`` for every tensor reachable through containers and DeepSpeed objects."""
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
        return
    if (
        depth > 6
        or id(obj) in seen
        or isinstance(obj, (nn.Module, torch.optim.Optimizer, str, bytes))
    ):
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for v in obj.values():
            _walk(v, path, out, seen, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            _walk(v, path, out, seen, depth + 1)
    elif type(obj).__module__.startswith("deepspeed") and hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            _walk(v, f"{path}.{k}" if path else k, out, seen, depth + 1)


def _root(path: str) -> str:
    """``"ipg_buckets.buffer"`` -> ``"ipg_buckets"``: the ZeRO optimizer's attribute a tensor hangs from."""
    return path.split(".")[0]


def snapshot(engine, extra_grads=()) -> dict:
    """Per-category bytes of unique storages this rank holds for the model right now."""
    zero_opt = engine.optimizer
    torch_opt = getattr(
        zero_opt, "optimizer", zero_opt
    )  # ZeRO wraps the torch optimizer; stage 0 does not
    module_params = list(engine.module.parameters())
    found: list = []
    if zero_opt is not torch_opt:
        _walk(zero_opt, "", found, set())
    by_root: dict[str, list] = {}
    for path, t in found:
        by_root.setdefault(_root(path), []).append((path, t))

    def from_attrs(names):
        return [t for n in names for _, t in by_root.get(n, [])]

    masters = from_attrs(_MASTER_ATTRS)
    # stage 3: module params are empty placeholders; the rank's slice lives in ``param.ds_tensor``;
    # a non-empty ``param.data`` there is a gathered full weight (working memory, not a model state)
    ds_tensors = [p.ds_tensor for p in module_params if hasattr(p, "ds_tensor")]
    stage3 = bool(ds_tensors)
    groups = {
        "params": (ds_tensors if stage3 else module_params) + from_attrs(_PARAM_ATTRS),
        "master": masters,
        "optimizer": tensors_in(torch_opt.state),
        "grads": [p.grad for p in module_params + masters if p.grad is not None]
        + list(extra_grads)
        + from_attrs(_GRAD_ATTRS),
    }
    seen: set = set()
    out = unique_storage_bytes(groups, seen)
    buffers: dict[str, int] = {}
    for path, t in found + ([("gathered params", p) for p in module_params] if stage3 else []):
        nbytes = storage_bytes(
            [t], seen
        )  # 0 when its storage is already charged (or holds no memory)
        if nbytes:
            buffers[_root(path)] = buffers.get(_root(path), 0) + nbytes
    out["buffers"] = sum(buffers.values())
    out["total"] = sum(out[c] for c in CATEGORIES)
    out["buffers_detail"] = buffers
    # two details the decomposition needs: Adam's 0-d step tensors, stage 2's gradient partition buffer
    out["adam_step"] = storage_bytes(t for t in tensors_in(torch_opt.state) if t.dim() == 0)
    partition = getattr(zero_opt, "grads_in_partition", None)
    out["grad_partition"] = storage_bytes([partition]) if isinstance(partition, torch.Tensor) else 0
    return out


def psi_padded(engine, psi: int, stage: int, world: int) -> int:
    """Ψ_pad: the element count DeepSpeed actually partitions (N equal slices)."""
    opt = engine.optimizer
    if stage in (1, 2) and hasattr(opt, "bit16_groups_flat"):
        return sum(t.numel() for t in opt.bit16_groups_flat)
    if stage == 3 and hasattr(opt, "fp16_partitioned_groups_flat"):
        return world * sum(t.numel() for t in opt.fp16_partitioned_groups_flat)
    return psi


def full_params(engine, deepspeed, stage: int) -> dict[str, torch.Tensor]:
    """Full weights by name (stage 3 gathers them: every rank must call this)."""
    params = dict(engine.module.named_parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().clone() for n, p in params.items()}
    return {n: p.detach().clone() for n, p in params.items()}
