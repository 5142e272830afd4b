#!/usr/bin/env bash
# One long call on a lent GPU machine (see CONTRIBUTING.md, "On a GPU"):
#   CUDA tests, every lecture and solution at full scale (outputs stored in place), every bench.
# Usage (from the repository root, wheels for the packages the image lacks in .whl/):
#   bash tools/gpu_session.sh [steps...]     steps: env tests notebooks bench debug diag (default: all)
# Writes logs and a tarball of the executed notebooks to $OUT (or ./gpu-out when OUT is unset).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/utils
  export PATH=/tmp/site/bin:$PATH
else
  export PYTHONPATH=$PWD/utils
fi
unset MEMLAB_SMALL
STEPS=${*:-env tests notebooks bench}
NB_TIMEOUT=${NB_TIMEOUT:-240}
pack() { tar czf "$OUT/results.tgz" notebooks solutions labs 2>/dev/null; }
for step in $STEPS; do
  case $step in
    env)
      { nvidia-smi; python3 -c "import torch,transformers,sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name()); print('transformers', transformers.__version__)"; python3 -m memlab doctor; } 2>&1 | tee "$OUT/env.log" ;;
    tests)
      timeout 300 python3 -m pytest -m cuda -q -p no:cacheprovider tests 2>&1 | tee "$OUT/cuda_tests.log" ;;
    notebooks)
      for nb in notebooks/*.ipynb solutions/*.ipynb; do
        echo "== $nb"; t0=$(date +%s)
        timeout "$NB_TIMEOUT" python3 -m nbconvert --to notebook --execute --inplace \
          --ExecutePreprocessor.timeout=1800 "$nb" 2>&1 | tail -3
        echo "   rc=${PIPESTATUS[0]} $(( $(date +%s) - t0 )) s"; pack
      done 2>&1 | tee "$OUT/notebooks.log" ;;
    debug)  # lectures with errors kept in the outputs, to read every failing cell at once
      mkdir -p /tmp/dbg && cp notebooks/*.ipynb /tmp/dbg/
      for nb in /tmp/dbg/*.ipynb; do
        timeout "$NB_TIMEOUT" python3 -m nbconvert --to notebook --execute --inplace --allow-errors \
          --ExecutePreprocessor.timeout=1800 "$nb" 2>&1 | tail -1
      done
      tar czf "$OUT/debug.tgz" -C /tmp/dbg . ;;
    diag)  # the H100 session's probe of the tracker's and the estimator's gaps (results/h100/diag.log)
      timeout 240 python3 results/h100/probes/gpu_diag.py 2>&1 | tee "$OUT/diag.log" ;;
    bench)
      for b in $(python3 -c "import memlab.bench as b; print(' '.join(b.available()))"); do
        timeout "${BENCH_TIMEOUT:-240}" python3 -m memlab bench "$b" 2>&1 | tee "$OUT/bench_$b.txt"
      done ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
pack
