#!/usr/bin/env bash
# The one command for the GPU machine, from the repository root:
#   bash benchmarks/gpu_session.sh [tests|bench|both|mosaic|decode|ring]
#                                                      (default: both)
# tests/bench/both: the test suite compiled on the GPU, then
# benchmarks/run.py. mosaic (Hopper): the mosaic target of the suite, the
# Mosaic checks, benchmark and compile times. decode: the decode benchmark
# and the decode tests compiled. ring (several GPUs): ring_attention
# checked against flash_attention, then benchmarks/ring.py with the
# latency-hiding scheduler over all local GPUs. Logs and bench.json go to $OUT (default
# /tmp/out). A test failure does not stop the benchmarks; the exit status
# is non-zero if any step failed.
set -uo pipefail

what="${1:-both}"
case "${what}" in
  tests|bench|both|mosaic|decode|ring) ;;
  *) echo "usage: $0 [tests|bench|both|mosaic|decode|ring]" >&2; exit 2 ;;
esac

export PYTHONUNBUFFERED=1
export PYTHONPATH="${PWD}"
OUT="${OUT:-/tmp/out}"
mkdir -p "${OUT}"

nvidia-smi -L
python3 -c 'import jax; print(jax.__version__, jax.devices())'

status=0
run() {  # run NAME COMMAND...: tee the output to $OUT/NAME.log
  local name="$1"; shift
  "$@" 2>&1 | tee "${OUT}/${name}.log" || status=1
}
if [[ "${what}" == mosaic ]]; then
  run mosaic_suite env JFLASH_TEST_ON_GPU=1 XLA_PYTHON_CLIENT_PREALLOCATE=false \
    python3 -m pytest -q -n 8 -rfs -p no:cacheprovider tests -k mosaic
  run check_mosaic python3 benchmarks/check_mosaic.py
  run bench_mosaic python3 benchmarks/run.py --impls mosaic,triton,cudnn \
    --shapes 1,8192,16,128 4,2048,16,128 2,4096,16,64 1,8192,16,256 \
    --no-progress --json "${OUT}/bench_mosaic.json"
  run compile_time python3 benchmarks/compile_time.py
  echo "gpu_session: mosaic done, status ${status}, output in ${OUT}"
  exit "${status}"
fi
if [[ "${what}" == decode ]]; then
  run decode_bench timeout 300 python3 benchmarks/decode.py
  run decode_tests env JFLASH_TEST_ON_GPU=1 timeout 200 python3 -m pytest -q \
    -p no:cacheprovider tests/decode_test.py tests/examples_gpt_test.py \
    tests/nnx_test.py tests/linen_test.py -k "Decode or decode or Generate"
  run generate_paged timeout 120 python3 examples/generate_paged.py
  echo "gpu_session: decode done, status ${status}, output in ${OUT}"
  exit "${status}"
fi
if [[ "${what}" == ring ]]; then
  run check_ring python3 benchmarks/check_ring_gpu.py
  run ring_bench env \
    XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true \
    python3 benchmarks/ring.py --lengths 65536 262144 --exposed-comm \
    --json "${OUT}/ring.json"
  echo "gpu_session: ring done, status ${status}, output in ${OUT}"
  exit "${status}"
fi
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
