"""Chapter 09 exercise: a Ray Data preprocessing step with ``map_batches``, streamed into a Ray Train trainer.

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
    # Hint 1 (the idea): a text is T+1 words; each word is one token id. The model reads tokens 0..T-1 and
    #   predicts tokens 1..T, so x and y are the same row shifted by one.
    # Hint 2 (the API): str.split() gives the words, VOCAB maps a word to its id, np.array(..., dtype=np.int64)
    #   stacks equal-length rows into an (n, T+1) array, and numpy slicing on the last axis gives x and y.
    raise NotImplementedError(
        "tokenize_batch: still a TODO (hints in exercises/ray_data.py: words -> ids with VOCAB, "
        "then x and y are the rows shifted by one)"
    )


def fit_with_ray_data(folder: str, train_loop, num_workers: int = 2):
    """Read ``folder``'s Parquet files, ``map_batches(tokenize_batch)``, fit a TorchTrainer on it; return the Result."""
    # Hint 1 (the idea): the dataset is a lazy plan — read the files, add your step, and give the plan to the
    #   trainer; each worker reads its own shard inside train_loop (already written for you).
    # Hint 2 (the API): ray.data.read_parquet, Dataset.map_batches(fn, batch_size=..., num_cpus=...),
    #   ray.train.torch.TorchTrainer(train_loop, datasets={...}, scaling_config=ray.train.ScalingConfig(
    #   num_workers=..., resources_per_worker=...), run_config=ray.train.RunConfig(...)), trainer.fit().
    raise NotImplementedError(
        "fit_with_ray_data: still a TODO (hints in exercises/ray_data.py: read, map_batches with half a CPU "
        "per task, a TorchTrainer whose workers ask for half a CPU, fit)"
    )
