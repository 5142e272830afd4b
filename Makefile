# Two commands for a newcomer, on a laptop without a GPU or on a GPU box:
#   make lab    set up .venv (if absent), copy the labs into work/, open JupyterLab on docs/start.md
#   make test   the same set-up, then the whole test suite (unit tests, grading, lab drift, nbval)
# Everything else: `make help`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.memlab-installed
# pytest workers: 2 by default (the CI machine has 2 cores); `make test JOBS=8` on a bigger box
JOBS   ?= 2
# torch threads per worker: 1 keeps 2 workers from oversubscribing 2 cores (tiny ops slow down 100x)
THREADS ?= 1
# `make estimate ARGS="llama-2-7b --gpu 24GB"`
ARGS   ?=
# `make grade LAB=04`: one lab by its chapter number (default: every lab in work/)
LAB    ?=

# torch is installed first, and only when .venv has none (a torch already there is kept):
# the CUDA build (PyPI's default wheel) where `nvidia-smi -L` lists a GPU, else PyTorch's CPU
# build from its CPU wheel index. `make setup TORCH_INDEX=https://download.pytorch.org/whl/cu126`
# picks another index. `make torch-cmd` prints the command without running it.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
TORCH_PIP := $(BIN)/python -m pip install torch
# prints the pip command for torch, or nothing when .venv already has torch (shell builtins only)
define TORCH_CMD
if [ -x "$(BIN)/python" ] && "$(BIN)/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" 2>/dev/null; then \
	:; \
elif [ -n "$(TORCH_INDEX)" ]; then \
	echo "$(TORCH_PIP) --index-url $(TORCH_INDEX)"; \
else \
	case "$$(nvidia-smi -L 2>/dev/null)" in \
		(GPU*) echo "$(TORCH_PIP)" ;; \
		(*) echo "$(TORCH_PIP) --index-url $(TORCH_CPU_INDEX)" ;; \
	esac; \
fi
endef

# JupyterLab rooted at the repository, so the lectures (notebooks/) and your labs (work/) sit side by
# side, opened on docs/start.md (rendered: .jupyter/lab/settings/overrides.json opens Markdown as a
# preview) with the file browser left at the root (`?file-browser-path=/`: a /lab/tree URL otherwise
# moves the browser into the file's folder, docs/). No news pop-up or update checks
# (.jupyter/labconfig/page_config.json disables the announcements plugin); of the server's output only
# the URL to open is printed (LAB_FILTER: the banner's other lines and the known noise of opening a
# notebook are dropped: "not trusted", the kernel's TCP-without-encryption note, tornado's websocket
# ping note, which .jupyter/jupyter_server_config.json also avoids; other warnings pass through). One
# Ctrl-C stops it (answer_yes) and ends with one line, not make's "Interrupt" (the recipe's trap).
# Its terminals find `memlab`, `python` and `jupyter` from .venv (PATH is set for the server, and its
# terminals start a plain, not a login, shell: a login shell's /etc/profile may reset PATH).
JUPYTER_ENV  := PATH="$(CURDIR)/$(BIN):$$PATH" \
	JUPYTER_CONFIG_PATH="$(CURDIR)/.jupyter$${JUPYTER_CONFIG_PATH:+:$$JUPYTER_CONFIG_PATH}"
LAB_START    := docs/start.md
# `make lab LAB_IP=0.0.0.0` on a remote machine (then mind the token; an ssh tunnel is safer)
LAB_IP       ?= 127.0.0.1
JUPYTER_OPTS := --ServerApp.root_dir="$(CURDIR)" --LabApp.default_url='/lab/tree/$(LAB_START)?file-browser-path=/' \
	--LabApp.app_settings_dir="$(CURDIR)/.jupyter/lab/settings" \
	--ServerApp.ip=$(LAB_IP) --ServerApp.log_format="%(message)s" \
	--LabApp.news_url=None --LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate \
	--ServerApp.log_level=WARN --LabApp.log_level=WARN \
	--ServerApp.terminado_settings=shell_command="$${SHELL:-/bin/sh}" --ServerApp.answer_yes=True
# keeps the banner's first http URL (its "?token=" made "&token=" after the default URL's own query),
# drops its other lines and the noise below (a shell loop: awk and sed buffer a pipe); ignores Ctrl-C
# so that JupyterLab's own shutdown messages still get through
LAB_NOISE := *"is not trusted"*|*"Kernel is running over TCP without encryption"*|*websocket_ping_timeout*|*"No session ID specified"*
LAB_FILTER := trap '' INT; set -f; url=; while IFS= read -r line; do set -- $$line; [ $$\# -gt 0 ] || continue; \
	case "$$line" in \
	(*"To access the server"*|*"open this file in a browser"*|*"copy and paste one of these"*|*file://*|*"No web browser found"*) ;; \
	($(LAB_NOISE)) ;; \
	(*http://*|*https://*) [ -n "$$url" ] || { url=1; u=$$1; case "$$u" in (*\?*\?token=*) u="$${u%\?token=*}&token=$${u\#\#*\?token=}" ;; esac; \
		echo "JupyterLab (Ctrl-C to stop): $$u"; } ;; \
	(*) printf '%s\n' "$$line" ;; \
	esac; done
LAB_STOPPED := echo "JupyterLab stopped. Your notebooks are in work/; make lab opens them again."

.PHONY: help setup torch torch-cmd lab test test-quick labs check-labs grade notebooks doctor estimate clean

help:
	@echo "make lab                      set up .venv, copy labs/ into work/ (never overwriting), open JupyterLab on the lectures and labs"
	@echo "make test                     set up .venv, run every test (unit, grading, lab drift, notebooks): ~11 min"
	@echo "make test-quick               set up .venv, check the set-up works (lecture 00, lab 00, memlab's units): ~2 min"
	@echo "make grade [LAB=04]           grade the notebooks in work/ you changed (labs/ when there is no work/): the table"
	@echo "make doctor                   environment report for bug reports"
	@echo "make estimate ARGS='MODEL ...' will this fine-tune fit? e.g. ARGS='llama-2-7b --gpu 24GB'"
	@echo "make setup                    only create .venv and install (torch first: CPU or CUDA build)"
	@echo "make torch-cmd                print the pip command that would install torch (dry run)"
	@echo "make labs / make check-labs   regenerate labs/ from solutions/ / check them for drift and leaks"
	@echo "make notebooks                re-execute lectures and solutions in place (commit the outputs)"
	@echo "make clean                    delete .venv and caches (work/ is kept)"
	@echo "make help                     this list"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

torch: | $(BIN)/python
	@cmd=$$($(TORCH_CMD)); \
	if [ -z "$$cmd" ]; then echo "torch is already in $(VENV): kept"; \
	else echo "$$cmd"; $$cmd; fi

torch-cmd:
	@cmd=$$($(TORCH_CMD)); \
	if [ -z "$$cmd" ]; then echo "# torch is already in $(VENV): kept"; else echo "$$cmd"; fi

$(STAMP): requirements.txt utils/pyproject.toml | $(BIN)/python
	@$(MAKE) --no-print-directory torch
	$(BIN)/python -m pip install -r requirements.txt
	@touch $(STAMP)

setup: $(STAMP)

lab: setup
	@$(BIN)/memlab labs start >/dev/null
	@trap '$(LAB_STOPPED); exit 0' INT; \
	$(JUPYTER_ENV) $(BIN)/jupyter lab $(JUPYTER_OPTS) $(if $(filter 0,$(shell id -u)),--allow-root,) 2>&1 | ($(LAB_FILTER)); \
	$(LAB_STOPPED)

# nbval runs the lectures; each solution runs once, through the grader
# (tests/course/test_course.py: no cell fails, full marks, the NBVAL_CHECK_OUTPUT cells' stored outputs)
PYTEST := MEMLAB_SMALL=1 OMP_NUM_THREADS=$(THREADS) $(BIN)/python -m pytest -n $(JOBS) --dist loadscope \
	--nbval-lax --nbval-current-env --sanitize-with tests/nbval_sanitize.cfg
test: setup
	@echo "make test: about 15 minutes on 2 idle cores (CI, set-up included), longer on a busy machine; no test"
	@echo "depends on the clock, so a slow run is slower, never red. Progress: the percentage at each line's end."
	$(PYTEST) tests notebooks

# the set-up works: memlab's chapter-00 units, the package and the doctor, lecture 00 run by nbval, solution 00
# graded (its test in tests/course/test_course.py); under 3 minutes on 2 cores
QUICK := tests/ch00 tests/meta/test_packaging.py tests/course/test_doctor.py notebooks/00_where_the_memory_goes.ipynb
test-quick: setup
	@echo "make test-quick: about 1-2 minutes on 2 cores (make test runs everything)"
	$(PYTEST) $(QUICK) "tests/course/test_course.py::test_solution_runs_clean_and_scores_full_marks[00_where_the_memory_goes]"

labs: setup
	$(BIN)/memlab labs build

check-labs: setup
	$(BIN)/memlab labs check

# The table is the result: exit 0 whether or not every exercise passes (a lab in progress is not
# a failure of make); non-zero only when the grader could not grade (memlab grade's exit 2: a
# missing or unreadable notebook, a bad argument, said in one line with the allowed chapters, above
# make's own "Error 2") or crashed. `make grade LAB=04` grades one lab; with no LAB, the labs of
# work/ changed since `memlab labs start` copied them (`.venv/bin/memlab grade --all`: every one).
grade: setup
	@$(BIN)/memlab grade $(LAB); rc=$$?; [ $$rc -le 1 ] || exit $$rc

doctor: setup
	$(BIN)/memlab doctor

estimate: setup
	$(BIN)/memlab estimate $(ARGS)

# Re-execute lecture and solution notebooks in place, keeping outputs and execution counts
# (on a GPU this stores the full-scale run; commit the result).
notebooks: setup
	$(BIN)/jupyter nbconvert --to notebook --execute --inplace \
		--ExecutePreprocessor.timeout=1800 notebooks/*.ipynb solutions/*.ipynb
	$(BIN)/python tools/clean_outputs.py notebooks/*.ipynb solutions/*.ipynb
	$(BIN)/memlab labs build

clean:
	rm -rf $(VENV) .pytest_cache utils/*.egg-info
