# epd: the two commands. `make test` and `make serve` create .venv when missing and
# reinstall when pyproject.toml or constraints.txt changes.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test serve examples lint bench lock clean

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "$(PYTHON) not found; run: make PYTHON=python3 ..." >&2; exit 1; }
	@# A venv whose creation failed half-way (no python3.11-venv: no pip in it) is made again.
	@test -x $(BIN)/pip || { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# torch's version is pinned (which build: see the README); another would be installed.
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	@# Every other dependency at the exact release it was tested with (constraints.txt; `make
	@# lock` moves them to the newest releases pyproject.toml allows).
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	@touch $(STAMP)

# Under CI=true (or with EPD_STRICT=1 in the environment, as .ci/run sets) a test skipped for
# want of transformers or NIXL fails: CI must run the parity and real-transfer tests.
STRICT := $(if $(filter true,$(CI)),EPD_STRICT=1,)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(STRICT) $(BIN)/python -m pytest

# make serve ARGS="--pools-prefill-replicas 2 --log-level info": any `epd serve` flags.
ARGS ?=

serve: $(STAMP)
	$(BIN)/python -m epd serve $(ARGS)

# The README tour's media (cat.png, clip/, clip.mp4) in the current folder.
examples: $(STAMP)
	$(BIN)/python -m epd make-examples .

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/hash_bench.py

# constraints.txt again: the newest releases pyproject.toml allows, installed into a scratch
# venv and frozen. Run `make test` after it and commit the file with what it changed.
LOCK_VENV := .lock-venv
lock:
	rm -rf $(LOCK_VENV) && $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install --quiet "torch==2.13.0"
	$(LOCK_VENV)/bin/python -m pip install --quiet ".[dev]"
	{ echo "# The exact releases \`make test\` and \`make serve\` install (make lock writes this file)."; \
	  echo "# torch is pinned in pyproject.toml and the Makefile."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --exclude epd --exclude torch; } > constraints.txt.new
	@# Replaced only once the freeze succeeded: a failed one left an empty file behind.
	mv constraints.txt.new constraints.txt
	rm -rf $(LOCK_VENV)

clean:
	rm -rf $(VENV) $(LOCK_VENV) constraints.txt.new build *.egg-info .mypy_cache .ruff_cache .pytest_cache
