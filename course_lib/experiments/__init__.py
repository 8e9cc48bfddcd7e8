"""What the notebooks and benchmarks run on ranks, one module per chapter, on one harness (``common``).

Arrows run one way: notebooks → experiments / checks → techniques (``ddp``, ``zero``, ``zero3``,
``fsdp`` …) → foundation (``launch``, ``comm``, ``memory``, ``formulas``, ``models``, ``data``).
"""
