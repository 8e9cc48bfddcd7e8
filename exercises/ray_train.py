"""Chapter 08 exercise: convert a plain PyTorch training loop to Ray Train.

``plain_loop(config)`` trains the course's tiny GPT in one process. Write ``ray_train_loop(config)``: the same
training as a Ray Train ``train_loop_per_worker``. ``TorchTrainer`` runs it on every worker *after* it has
created the ``torch.distributed`` process group (gloo on CPU, nccl with GPUs). Four changes (notebook 08, §5):

1. ``model = prepare_model(model)`` — the worker's device, and DDP when there is more than one worker;
2. ``loader = prepare_data_loader(loader)`` — a ``DistributedSampler`` (each worker its own shard; the
   loader's ``shuffle=True`` becomes the sampler's, seeded by *seed + epoch*) and batches on the device.
   The loader's batch size is now the **per-worker** batch: ``config["global_batch"] // world_size``
   (``ray.train.get_context().get_world_size()``);
3. ``loader.sampler.set_epoch(epoch)`` at the start of every epoch (with more than one worker), or every
   epoch repeats the first one's order;
4. after every epoch ``ray.train.report({"epoch": epoch, "loss": loss}, checkpoint=...)`` on **every**
   worker: rank 0 passes ``Checkpoint.from_directory(d)`` of a temporary directory ``d`` holding
   ``model.pt`` = ``torch.save(<the unwrapped model>.state_dict(), ...)`` (DDP's ``model.module``), the
   other workers ``checkpoint=None``.

Check: ``course-lib check ray_train_loop`` (or ``check("ray_train_loop")`` in notebook 08) runs it in a real
``TorchTrainer`` with 2 workers and compares the checkpointed weights with one device trained on the same
global batches (AdamW, within the course's ADAMW tolerance: course_lib.results).
"""

import os  # noqa: F401  (os.path.join)
import tempfile  # noqa: F401  (tempfile.TemporaryDirectory)

import ray.train
import torch  # noqa: F401  (torch.save)
from ray.train import Checkpoint  # noqa: F401
from ray.train.torch import prepare_data_loader, prepare_model  # noqa: F401
from torch.utils.data import DataLoader

from course_lib.data import SyntheticDataset
from course_lib.experiments.common import make_optimizer, small_config, train_step
from course_lib.models import GPT


def make_dataset(config: dict) -> SyntheticDataset:
    """The training data: ``config["samples"]`` sequences for the tiny GPT (the same in both loops)."""
    model_config = small_config()
    return SyntheticDataset(
        config["samples"], model_config.block_size, model_config.vocab_size, seed=0
    )


def plain_loop(config: dict) -> dict:
    """One process, one device: the loop to convert. Returns ``{"model": state_dict, "history": [...]}``."""
    model = GPT(small_config(), seed=0)
    optimizer = make_optimizer(config["optimizer"], model.parameters())
    loader = DataLoader(make_dataset(config), batch_size=config["global_batch"], shuffle=True)
    history = []
    for epoch in range(config["epochs"]):
        for x, y in loader:
            loss = train_step(model, optimizer, x, y)
        history.append(
            {"epoch": epoch, "loss": loss}
        )  # Ray Train: ray.train.report(...) with a checkpoint
    return {"model": model.state_dict(), "history": history}


def ray_train_loop(config: dict) -> None:
    """``train_loop_per_worker`` for ``TorchTrainer``: ``plain_loop`` with the four changes above."""
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()  # noqa: F841
    # TODO: copy plain_loop here and make the four changes (prepare_model, prepare_data_loader with the
    # per-worker batch, set_epoch, a report with a checkpoint from rank 0 after every epoch).
    raise NotImplementedError(
        "ray_train_loop: hint — start from plain_loop: the same model, optimizer and loop, with the four "
        "changes this module's docstring lists (notebook 08, §10 has two hints: the idea, then the API)"
    )
