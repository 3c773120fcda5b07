# Everything a fresh machine needs, from one `make` target each.
#   make demo       install, then the main job: a recommendation and a short real training run
#   make test       install, then the whole test suite (what CI runs)
#   make test-fast  the suite without the slow accuracy / multi-node tests

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DATA   ?= $(abspath ../shared/data)
export PARTRAIN_DATA_DIR ?= $(DATA)

.PHONY: install demo test test-fast clean

$(BIN)/partrain: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch pinned to the CPU wheel on the machines (an unpinned torch pulls CUDA packages)
	$(BIN)/pip install --quiet --disable-pip-version-check "torch==2.13.0"
	$(BIN)/pip install --quiet --disable-pip-version-check -e ".[test]"
	touch $@

install: $(BIN)/partrain

demo: install
	$(BIN)/partrain recommend --model cnn --dataset mnist --workers 2 --batch-size 64 --run --steps 200

# --durations: each run's log names its slowest tests (the suite is 18-19 minutes on 2 cores)
test: install
	$(BIN)/python -m pytest -q --durations=25

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
