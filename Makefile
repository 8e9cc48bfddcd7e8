# Hands-On Distributed Training — set-up and test entry points.
# Needs only python3 (3.10+) and make. Everything else goes into .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CACHE  := $(CURDIR)/.cache
export COURSE_LIB_CACHE := $(CACHE)
export TORCH_EXTENSIONS_DIR := $(CACHE)/torch_extensions
export RAY_AUTH_MODE := disabled
export PYTHONHASHSEED := 0
# Jupyter refuses to run as root (containers) without this flag; normal users never get it.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: help setup lab test lint unit exercises nbval nbval-busy test-multinode notebooks course doctor smoke \
	gpu-smoke clean

help:
	@echo "make lab    - set up and open the course in JupyterLab (notebooks/)"
	@echo "make test   - set up and run every test (lint, unit, exercises vs solutions, strict nbval)"
	@echo "make lint   - ruff check + ruff format --check (configured in pyproject.toml)"
	@echo "make notebooks [NB=02] [FORCE=1] - build, run and store notebooks one at a time on a quiet"
	@echo "               machine (refuses when busy, says why), with provenance; rewrites docs/runtimes.md"
	@echo "make course - execute every notebook headless into .cache/executed and print each runtime"
	@echo "               (same executor and busy check; stores nothing in notebooks/)"
	@echo "make nbval-busy - strict nbval with one core kept busy by a spinning process (before storing notebooks)"
	@echo "make test-multinode - (root) just the multi-node tests: Ray and torchrun across two network namespaces"
	@echo "make doctor - check the environment"
	@echo "make horovod - build Horovod 0.28.1 once per machine (minutes; cached in ~/.cache/course_lib/wheels)"
	@echo "make smoke  - run every chapter's rank functions once (gloo on CPU, nccl on GPUs)"

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab --ServerApp.ip=127.0.0.1 --notebook-dir=notebooks $(ROOT_FLAG)

doctor: $(STAMP)
	$(VENV)/bin/course-lib doctor

# Lint and format are part of the gate: ruff's rules and line length live in pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

unit: $(STAMP)
	$(PY) -m pytest tests -q -p no:cacheprovider

nbval: $(STAMP)
	$(PY) -m pytest --nbval notebooks --sanitize-with notebooks/sanitize.cfg -q -p no:cacheprovider

# Strict nbval with one core kept busy (a learner's laptop is never idle): one unpinned `while True: pass`
# process at nice 0 runs beside it and is killed afterwards, pass or fail. Not part of `make test`.
NB ?= notebooks
nbval-busy: $(STAMP)
	@$(PY) -c "while True: pass" & busy=$$!; \
	echo "busy process $$busy (while True: pass, nice 0) running beside nbval"; \
	$(PY) -m pytest --nbval $(NB) --sanitize-with notebooks/sanitize.cfg -q -p no:cacheprovider; rc=$$?; \
	kill $$busy; exit $$rc

# Just the multi-node tests: a two-node Ray cluster and torchrun --nnodes=2 across two network namespaces (veth).
# They are part of make test where namespaces can be made (root + iproute2) and skip with the reason elsewhere.
test-multinode: $(STAMP)
	$(PY) -m pytest tests/test_ray_multinode.py tests/test_torchrun_multinode.py -q -p no:cacheprovider --durations=0

# Horovod 0.28.1 (retired; no wheel fits torch 2.13) is compiled once per machine into ~/.cache/course_lib/wheels
# (≈290 CPU-seconds: ≈7 min on 2 idle cores, 17.5 min measured at load ~15), then installed from there in
# seconds; a no-op when already installed. `make lab` does not wait for it.
.PHONY: horovod
horovod: $(STAMP)
	$(PY) tools/build_horovod.py

test: $(STAMP) lint horovod
	$(VENV)/bin/course-lib doctor
	$(PY) -m pytest tests -q -p no:cacheprovider --durations=25
	$(PY) -m pytest --nbval notebooks --sanitize-with notebooks/sanitize.cfg -q -p no:cacheprovider

# Every chapter's rank functions once, small, backend="auto": nccl with one rank per GPU where there are GPUs.
smoke gpu-smoke: $(STAMP)
	$(VENV)/bin/course-lib smoke

# The one notebook executor, tools/build_notebooks.py: one notebook at a time, each only on a quiet machine
# (1-minute load <= 0.25 per core, no other pytest/nbval/ipykernel/build/Ray process; it waits up to 300 s for the
# previous notebook's load to decay, then refuses and names what is busy). NB selects by prefix (NB=02, NB=02_ddp)
# or path, default all; FORCE=1 builds on a busy machine and records forced=True. Runtimes: docs/runtimes.md.
notebooks: $(STAMP)
	$(PY) tools/build_notebooks.py $(NB) $(if $(FORCE),--force)

# The same executor, storing the executed copies in .cache/executed (notebooks/ and the ledger stay as they are).
course: $(STAMP)
	$(PY) tools/build_notebooks.py $(NB) --out $(CACHE)/executed $(if $(FORCE),--force)

clean:
	rm -rf $(VENV) $(CACHE) .pytest_cache
