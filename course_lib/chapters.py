"""The course's chapters, identified by topic.

Everything outside the notebook file names names a chapter by its topic: modules
(``experiments/<topic>.py``, ``checks/<topic>.py``, ``exercises/<topic>.py``), quiz banks and item ids,
exercise records and learner progress. A chapter's *number* is read from its notebook's file name, so
a new chapter is inserted by adding a row here and renaming notebook files; nothing a learner saved
changes meaning.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Chapter", "CHAPTERS", "chapter", "number"]


@dataclass(frozen=True)
class Chapter:
    topic: str  # the chapter's identity: quiz bank file, item id prefix, progress key
    notebook: str  # the notebook's file stem under notebooks/ (its number is its first two digits)
    title_en: str
    title_ko: str

    @property
    def number(self) -> int:
        return int(self.notebook[:2])


CHAPTERS: tuple[Chapter, ...] = (
    Chapter(
        "collectives", "00_setup_and_collectives", "Set-up and collectives", "환경 준비와 집합 통신"
    ),
    Chapter(
        "single-device",
        "01_single_device",
        "One device: memory and time",
        "단일 장치: 메모리와 시간",
    ),
    Chapter("ddp", "02_ddp", "Data parallelism and DDP", "데이터 병렬과 DDP"),
    Chapter("zero", "03_zero", "ZeRO-1/2/3", "ZeRO-1/2/3"),
    Chapter("fsdp", "04_fsdp", "FSDP", "FSDP"),
    Chapter("pipeline", "05_pipeline_parallel", "Pipeline parallelism", "파이프라인 병렬"),
    Chapter("tensor-parallel", "06_tensor_parallel", "Tensor parallelism", "텐서 병렬"),
    Chapter(
        "context-expert-parallel",
        "07_context_expert_parallel",
        "Context and expert parallelism",
        "컨텍스트 병렬과 전문가 병렬",
    ),
    Chapter("ray-train", "08_ray_train", "Ray Train", "Ray Train"),
    Chapter("ray-data", "09_ray_data", "Ray Data", "Ray Data"),
    Chapter("review", "10_review", "Review: choosing a strategy", "복습: 전략 고르기"),
)

_BY_TOPIC = {c.topic: c for c in CHAPTERS}
_BY_NUMBER = {c.number: c for c in CHAPTERS}


def chapter(key: str | int) -> Chapter:
    """The chapter named by topic (``"ddp"``) or, for older callers, by notebook number (``2`` or ``"02"``)."""
    if isinstance(key, str) and key in _BY_TOPIC:
        return _BY_TOPIC[key]
    try:
        return _BY_NUMBER[int(key)]
    except (TypeError, ValueError, KeyError):
        raise ValueError(
            f"chapter {key!r} is not one of the topics {sorted(_BY_TOPIC)} "
            f"(or notebook numbers {sorted(_BY_NUMBER)})"
        ) from None


def number(topic: str) -> int:
    """The notebook number of ``topic``'s chapter (read from its file name)."""
    return chapter(topic).number
