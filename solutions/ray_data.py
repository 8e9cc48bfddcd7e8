"""Chapter 09 exercise, solved: a Ray Data preprocessing step with ``map_batches``, streamed into Ray Train.

See ``exercises/ray_data.py`` for the task.
"""

import numpy as np

VOCAB = {f"w{i:02d}": i for i in range(32)}


def tokenize_batch(batch: dict) -> dict:
    """``{"id": (n,), "text": (n,) str}`` → ``{"id": (n,), "x": (n, T), "y": (n, T)}`` (int64 token ids)."""
    tokens = np.array(
        [[VOCAB[w] for w in str(text).split()] for text in batch["text"]], dtype=np.int64
    )
    return {"id": np.asarray(batch["id"], dtype=np.int64), "x": tokens[:, :-1], "y": tokens[:, 1:]}


def fit_with_ray_data(folder: str, train_loop, num_workers: int = 2):
    """Read ``folder``'s Parquet files, ``map_batches(tokenize_batch)``, fit a TorchTrainer on it; return the Result."""
    import ray.data
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from course_lib import ray_train

    ds = ray.data.read_parquet(folder).map_batches(tokenize_batch, batch_size=16, num_cpus=0.5)
    trainer = TorchTrainer(
        train_loop,
        datasets={"train": ds},
        scaling_config=ScalingConfig(num_workers=num_workers, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(**ray_train.run_config_kwargs("ex08")),
    )
    return trainer.fit()
