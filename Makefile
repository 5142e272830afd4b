# Two commands for a newcomer:
#   make lab    set up .venv (if absent) and start JupyterLab here
#   make test   the same set-up, then the whole test suite (unit tests, grading, lab drift, nbval)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.memlab-installed
# pytest workers: 2 by default (the CI machine has 2 cores); `make test JOBS=8` on a bigger box
JOBS   ?= 2
# torch threads per worker: 1 keeps 2 workers from oversubscribing 2 cores (tiny ops slow down 100x)
THREADS ?= 1

.PHONY: setup lab test labs check-labs grade notebooks doctor clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

$(STAMP): requirements.txt utils/pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -r requirements.txt
	@touch $(STAMP)

setup: $(STAMP)

lab: setup
	@echo "Starting JupyterLab in $(CURDIR); open the http://127.0.0.1:8888/lab?token=... URL it prints below (Ctrl-C to stop)."
	$(BIN)/jupyter lab --ServerApp.root_dir=. $(if $(filter 0,$(shell id -u)),--allow-root,)

test: setup
	MEMLAB_SMALL=1 OMP_NUM_THREADS=$(THREADS) $(BIN)/python -m pytest -n $(JOBS) --dist loadscope \
		--nbval-lax --nbval-current-env --sanitize-with tests/nbval_sanitize.cfg \
		tests notebooks solutions

labs: setup
	$(BIN)/memlab labs build

check-labs: setup
	$(BIN)/memlab labs check

grade: setup
	$(BIN)/memlab grade

# Re-execute lecture and solution notebooks in place, keeping outputs and execution counts
# (on a GPU this stores the full-scale run; commit the result).
notebooks: setup
	$(BIN)/jupyter nbconvert --to notebook --execute --inplace \
		--ExecutePreprocessor.timeout=1800 notebooks/*.ipynb solutions/*.ipynb
	$(BIN)/memlab labs build

doctor: setup
	$(BIN)/memlab doctor

clean:
	rm -rf $(VENV) .pytest_cache utils/*.egg-info
