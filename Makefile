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

# Two tests at a time (pytest-xdist: most wait on processes they start), then those marked
# `alone` one at a time: they time the machine (a profile beside another test reads its load
# and measures again) or train on both cores in pytest's own process (beside another test's
# workers, each parallel region waits for a descheduled thread: an mlp step 3 ms -> 150 ms).
# --durations: each log names its slowest tests.
test: install
	$(BIN)/python -m pytest -q -n 2 -m "not alone" --durations=15; two=$$?; \
	$(BIN)/python -m pytest -q -m alone --durations=15; alone=$$?; \
	exit $$(( two || alone ))

test-fast: install
	$(BIN)/python -m pytest -q -n 2 -m "not slow and not alone"; two=$$?; \
	$(BIN)/python -m pytest -q -m "alone and not slow"; alone=$$?; \
	exit $$(( two || alone ))

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
