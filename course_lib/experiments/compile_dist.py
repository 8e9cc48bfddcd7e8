"""torch.compile with DDP and FSDP2: how many graphs, and the same numbers as eager.

Rank functions (run them with ``launch.spawn``) and the two pieces they share:

* :class:`GraphCounter` — a ``torch.compile`` backend that records each ``GraphModule`` Dynamo
  hands it and runs it as is (``gm.forward``): no code generation, so counting graphs is cheap.
* :func:`ddp_bucket_sizes` — the bytes of each bucket a ``DistributedDataParallel`` reducer
  holds now (after the first backward: the rebuilt buckets, in the order gradients arrived).
* :func:`compiled_ddp_split` — torch DDP compiled with Dynamo's DDP optimizer
  (``torch._dynamo.config.optimize_ddp``): one graph per DDP bucket, so each bucket's backward
  ends, and its all-reduce starts, before the next graph's backward runs; losses and weights
  against the same DDP run eagerly.
* :func:`compiled_fsdp2_vs_eager` — FSDP2 with every transformer block compiled, against the
  same FSDP2 model eagerly.

Why the graph count may differ from the bucket count by one: the DDP optimizer splits the graph
(walked from its output back) with a first bucket of ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB)
and ``bucket_cap_mb`` for the rest, whatever ``bucket_cap_mb`` is; torch 2.13's DDP, given an
explicit ``bucket_cap_mb``, caps its first bucket at that value too. Above 1 MiB the two cuts
fall in different places and may make one bucket more or fewer.
"""

from __future__ import annotations

import torch.distributed as dist

from ..launch import device

__all__ = [
    "GraphCounter",
    "ddp_bucket_sizes",
    "compiled_ddp_split",
    "compiled_fsdp2_vs_eager",
]


class GraphCounter:
    """A ``torch.compile`` backend that keeps every graph it is given and runs it unchanged."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def __len__(self) -> int:
        return len(self.graphs)


def ddp_bucket_sizes(ddp_model) -> list[int]:
    """Bytes of each bucket ``ddp_model``'s reducer holds, in its bucket order."""
    buckets = ddp_model.reducer._get_zeros_like_grad_buckets()
    return [b.buffer().numel() * b.buffer().element_size() for b in buckets]


def _weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(model, opt, config, steps: int, batch_size: int) -> list[float]:
    from ..train import shard_batch, step_batch, train_step

    losses = []
    for step in range(steps):
        x, y = shard_batch(*step_batch(step, config, batch_size, device()))
        losses.append(train_step(model, opt, x, y))
    return losses


def compiled_ddp_split(
    bucket_cap_mb: float = 4.0,
    *,
    config=None,
    steps: int = 2,
    batch_size: int = 8,
    optimize_ddp=True,
    lr: float = 0.1,
) -> dict:
    """Rank function: torch DDP compiled with :class:`GraphCounter`, against the same DDP eagerly.

    ``config``: default :func:`course_lib.configs.bench_config` (3.2M parameters, 12.6 MB of
    gradients: several buckets at ``bucket_cap_mb`` ≥ 1). Both models start from seed 0 and take
    ``steps`` SGD steps on ``train.step_batch``. Returns ``graphs`` (how many graphs Dynamo
    compiled), ``buckets`` (the compiled DDP's reducer bucket sizes after the steps),
    ``losses`` / ``eager_losses`` and ``weights`` / ``eager_weights`` (this rank's, on CPU).
    """
    import torch._dynamo
    from torch.nn.parallel import DistributedDataParallel

    from ..configs import bench_config
    from ..models import GPT

    if bucket_cap_mb < 1:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb} is below 1: the DDP optimizer needs >= 1")
    config = bench_config() if config is None else config
    dev = device()
    ids = [dev] if dev.type == "cuda" else None
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = optimize_ddp
    out = {}
    for compiled in (False, True):
        model = GPT(config, seed=0).to(dev)
        ddp = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=bucket_cap_mb)
        counter = GraphCounter()
        run = torch.compile(ddp, backend=counter) if compiled else ddp
        opt = torch.optim.SGD(run.parameters(), lr=lr)
        losses = _train(run, opt, config, steps, batch_size)
        out[compiled] = (losses, _weights(model), len(counter), ddp_bucket_sizes(ddp))
    torch._dynamo.reset()
    return {
        "graphs": out[True][2],
        "buckets": out[True][3],
        "losses": out[True][0],
        "eager_losses": out[False][0],
        "weights": {n: w.cpu() for n, w in out[True][1].items()},
        "eager_weights": {n: w.cpu() for n, w in out[False][1].items()},
    }


def compiled_fsdp2_vs_eager(
    backend: str = "aot_eager",
    *,
    config=None,
    steps: int = 3,
    batch_size: int = 8,
    compile_first: bool = True,
    lr: float = 0.1,
) -> dict:
    """Rank function: FSDP2 with each block compiled (``backend``) against the same FSDP2 eagerly.

    ``compile_first``: ``block.compile(...)`` before ``fully_shard(block)`` (as torchtitan does),
    else after. The root (embeddings, final norm, tied head) stays eager. Both start from seed 0
    and take ``steps`` SGD steps. Returns ``losses``, ``eager_losses`` and the full weights
    (``full_tensor()``, on CPU) of both.
    """
    import torch._dynamo
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ..configs import zero_config
    from ..models import GPT

    config = zero_config() if config is None else config
    mesh = init_device_mesh(device().type, (dist.get_world_size(),))
    torch._dynamo.reset()
    out = {}
    for compiled in (False, True):
        model = GPT(config, seed=0).to(device())
        for block in model.blocks:
            if compiled and compile_first:
                block.compile(backend=backend)
            fully_shard(block, mesh=mesh)
            if compiled and not compile_first:
                block.compile(backend=backend)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        losses = _train(model, opt, config, steps, batch_size)
        full = {n: p.full_tensor().detach().cpu() for n, p in model.named_parameters()}
        out[compiled] = (losses, full)
    torch._dynamo.reset()
    return {
        "losses": out[True][0],
        "eager_losses": out[False][0],
        "weights": out[True][1],
        "eager_weights": out[False][1],
    }
