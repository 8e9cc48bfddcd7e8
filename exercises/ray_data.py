"""Chapter 08 exercise: a Ray Data preprocessing step with ``map_batches``, streamed into a Ray Train trainer.

The folder holds Parquet files with the columns ``id`` (int64) and ``text``: each text is the tiny GPT's
sequence of T+1 words, e.g. ``"w05 w17 w06 w18 …"``, where word ``wNN`` is token ``NN`` (see ``VOCAB``).

1. ``tokenize_batch(batch)``: a ``map_batches`` function. It gets a batch as a dict of numpy arrays
   (``batch["id"]``, ``batch["text"]``) and returns ``{"id": ids, "x": tokens[:, :-1], "y": tokens[:, 1:]}``
   with int64 arrays of shape (rows,) and (rows, T).
2. ``fit_with_ray_data(folder, train_loop, num_workers)``: build the dataset —
   ``ray.data.read_parquet(folder)`` then ``.map_batches(tokenize_batch, batch_size=16, num_cpus=0.5)`` —
   and hand it to ``TorchTrainer(train_loop, datasets={"train": ds}, ...)`` with ``num_workers`` workers of
   ``resources_per_worker={"CPU": 0.5}`` (on 2 CPUs, workers asking for 1 CPU each leave none for Ray Data)
   and a fresh ``RunConfig(**course_lib.ray_train.run_config_kwargs("ex08"))``; return ``trainer.fit()``'s Result.
   ``train_loop`` (given by the checker) reads ``ray.train.get_dataset_shard("train")``.

Check: ``course-lib check ray_data_pipeline`` (or ``check("ray_data_pipeline")`` in a notebook). Your
tokenisation is compared on a small batch, then your trainer runs on real Ray workers: every row must reach a
worker exactly once, through a ``map_batches`` step, and the trained weights must equal one device trained on
the correct tokens.
"""

import numpy as np  # noqa: F401  (you will need it)

VOCAB = {f"w{i:02d}": i for i in range(32)}


def tokenize_batch(batch: dict) -> dict:
    """``{"id": (n,), "text": (n,) str}`` → ``{"id": (n,), "x": (n, T), "y": (n, T)}`` (int64 token ids)."""
    # TODO: split every text into words, map each word with VOCAB, stack the rows into an (n, T+1) int64
    # array, and return the ids with x = all but the last token, y = all but the first.
    raise NotImplementedError(
        "tokenize_batch: implement it (hint: np.array([[VOCAB[w] for w in t.split()] "
        "for t in batch['text']]), then x = tokens[:, :-1], y = tokens[:, 1:])"
    )


def fit_with_ray_data(folder: str, train_loop, num_workers: int = 2):
    """Read ``folder``'s Parquet files, ``map_batches(tokenize_batch)``, fit a TorchTrainer on it; return the Result."""
    # TODO: ds = ray.data.read_parquet(folder).map_batches(...)
    #       TorchTrainer(train_loop, datasets={"train": ds}, scaling_config=ScalingConfig(...), run_config=...)
    raise NotImplementedError(
        "fit_with_ray_data: implement it (hint: map_batches(tokenize_batch, batch_size=16, "
        "num_cpus=0.5); ScalingConfig(num_workers=num_workers, resources_per_worker="
        "{'CPU': 0.5}); datasets={'train': ds}; return trainer.fit())"
    )
