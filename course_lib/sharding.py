"""The rules every sharding technique (ZeRO-1/2 in ``zero.py``, ZeRO-3 in ``zero3.py``) checks on its inputs.

* Only **element-wise** optimizers can be sharded: a slice's update must be the slice of the full
  update (:data:`ELEMENTWISE_OPTIMIZERS`).
* All parameters on **one device** (this rank's, ``launch.device()``), kept in **fp32** (master weights).
* Not under a **data-parallel wrapper**: DDP reduces gradients itself, so ZeRO on top would reduce
  them twice. :func:`mark_reduced_by` leaves the wrapper's name on each parameter it reduces
  (``ddp.DDP``, ``ddp.torch_ddp``, ``ZeroOptimizer`` call it) and :func:`reducer_of` reads it back,
  in O(parameters). The marks are the only record: this module imports no technique, so any
  technique may import it.
"""

from __future__ import annotations

import torch

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "check_optimizer_cls",
    "check_same_device",
    "check_fp32",
    "mark_reduced_by",
    "reducer_of",
    "check_not_reduced",
]

# Optimizers whose update of element i reads only element i of the parameter, its gradient and
# its state (plus per-tensor scalars such as the step count). Only those can be cut into
# slices: a slice's update is then exactly the slice of the full update. LBFGS (global dot
# products), Adafactor (row/column statistics of a matrix) or Muon (orthogonalises a matrix)
# need the whole tensor and cannot be sharded this way.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)


def check_optimizer_cls(optimizer_cls) -> None:
    names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(
            f"optimizer_cls must be an element-wise torch.optim.Optimizer class (each element's "
            f"update depends on that element alone: {names}), got {optimizer_cls!r}"
        )
    if not issubclass(optimizer_cls, ELEMENTWISE_OPTIMIZERS):
        raise ValueError(
            f"{optimizer_cls.__name__} is not an element-wise optimizer: ZeRO steps each rank's "
            f"slice of a flat buffer on its own, which is only the same as stepping the whole "
            f"tensor when every element's update depends on that element alone. Supported: {names}"
        )


def check_same_device(tensors, who: str) -> torch.device:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(
            f"{who}: parameters are on several devices {sorted(map(str, devices))}; "
            f"move the model to one device (this rank's, launch.device()) first"
        )
    return devices.pop() if devices else torch.device("cpu")


def check_fp32(named, who: str) -> None:
    for name, p in named:
        if p.dtype != torch.float32:
            raise ValueError(
                f"{who} keeps fp32 parameters (master weights); {name} is {p.dtype}. "
                f"Keep the model in fp32"
                + (
                    " and pass compute_dtype=torch.bfloat16 for 16-bit compute"
                    if who == "Zero3"
                    else ""
                )
            )


_MARK = "_course_reduced_by"


def mark_reduced_by(params, owner: str) -> None:
    """Note on each parameter that ``owner`` (a wrapper's name) reduces its gradient."""
    for p in params:
        setattr(p, _MARK, owner)


def reducer_of(params) -> str | None:
    """The name of the wrapper that already reduces one of these parameters' gradients, if any."""
    for p in params:
        owner = getattr(p, _MARK, None)
        if owner is not None:
            return owner
    return None


def check_not_reduced(params, who: str) -> None:
    """Raise if a wrapper already reduces these parameters' gradients (``who`` would reduce them twice)."""
    wrapper = reducer_of(params)
    if wrapper is not None:
        raise ValueError(
            f"{who} does its own gradient reduction, but {wrapper} already reduces these "
            f"parameters' gradients (it wraps their module): give {who} a model that no "
            f"data-parallel wrapper has wrapped"
        )
