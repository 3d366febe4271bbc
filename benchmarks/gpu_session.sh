#!/usr/bin/env bash
# The one command for the GPU machine, from the repository root:
#   bash benchmarks/gpu_session.sh [tests|bench|both]   (default: both)
# Runs the test suite compiled on the GPU, then benchmarks/run.py. Logs and
# bench.json go to $OUT (default /tmp/out). A test failure does not stop the
# benchmark; the exit status is non-zero if either step failed.
set -uo pipefail

what="${1:-both}"
case "${what}" in
  tests|bench|both) ;;
  *) echo "usage: $0 [tests|bench|both]" >&2; exit 2 ;;
esac

export PYTHONUNBUFFERED=1
export PYTHONPATH="${PWD}"
OUT="${OUT:-/tmp/out}"
mkdir -p "${OUT}"

nvidia-smi -L
python3 -c 'import jax; print(jax.__version__, jax.devices())'

status=0
if [[ "${what}" != bench ]]; then
  JFLASH_TEST_ON_GPU=1 python3 -m pytest -q -x -p no:cacheprovider tests \
    2>&1 | tee "${OUT}/tests.log" || status=1
fi
if [[ "${what}" != tests ]]; then
  python3 benchmarks/run.py --json "${OUT}/bench.json" 2>&1 \
    | tee "${OUT}/bench.log" || status=1
fi
echo "gpu_session: ${what} done, status ${status}, output in ${OUT}"
exit "${status}"
