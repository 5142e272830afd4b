#!/usr/bin/env bash
# The whole course on short GPU leases: a thin wrapper around tools/gpu_session.py (the plan, its
# budgets and the projected GPU time are there; `--plan-only` prints them).
# Usage, from the repository root:
#   bash tools/gpu_session.sh               # call one (<= 540 s): env, pytest -m cuda, the GPU measurements and benches
#   bash tools/gpu_session.sh --call 2      # the lectures, not yet stored from a GPU first (--limit 240 after call one)
#   bash tools/gpu_session.sh --plan-only   # the plan and the projection; runs nothing
#   bash tools/gpu_session.sh --rehearse    # the same steps at small scale on this CPU, budgets x 2
#   bash tools/gpu_session.sh --online      # your own GPU box: pip installs the missing packages
# On a lent machine the wheels travel in .whl/ (tools/fetch_wheels.sh; carry .whl) and are installed
# with no network; results are packed into $OUT (or ./gpu-out), at most 8 files of 16 MiB.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python   # your own box: the venv make built
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/utils${PYTHONPATH:+:$PYTHONPATH}
exec "$PY" tools/gpu_session.py "$@"
