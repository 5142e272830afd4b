#!/usr/bin/env bash
# Fill .whl/ with the wheels a lent GPU machine's image lacks (see tools/fetch_wheels.py).
cd "$(dirname "$0")/.." && exec "${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}" tools/fetch_wheels.py "$@"
