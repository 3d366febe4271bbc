#!/usr/bin/env bash
# The issue-4 sweep on the GPU machine, split so that each part fits a
# 10-minute device call. From the repository root:
#   bash benchmarks/gpu_sweep.sh bf16_d128|bf16_d64_d256|fp16|long [...]
# bf16_d128: N = 512..32768 (B*N = 16384), D = 128, GQA 32q/8kv, causal and
#       not, jflash / cuDNN / XLA / JAX's Pallas `mha`.
# bf16_d64_d256: the same N range at D = 64 and 256 (without XLA).
# fp16: the same at D = 128 and GQA only.
# long: B=1, H=16, D=128, causal, N = 16k..128k, jflash and cuDNN, with the
#       per-call memory (must grow linearly in N).
# Output (JSON, logs) goes to $OUT (default /tmp/out).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="${PWD}"
OUT="${OUT:-/tmp/out}"
mkdir -p "${OUT}"

shapes() {  # shapes <head_dim> [kv_heads]: the sweep's N range at B*N=16384.
  for n in 512 1024 2048 4096 8192 16384 32768; do
    local b=$(( 16384 / n )); (( b < 1 )) && b=1
    echo "${b},${n},16,$1"
  done
}
gqa="8,2048,32,128,8 2,8192,32,128,8"
run() {  # run <name> <timeout> args...
  local name=$1 limit=$2; shift 2
  timeout "${limit}" python3 benchmarks/run.py --no-progress --repeats 3 \
    --iters 5 --warmup 1 --json "${OUT}/${name}.json" "$@" \
    > "${OUT}/${name}.log" 2>&1
  echo "${name}: exit $?"
  grep -v "Warning" "${OUT}/${name}.log" | tail -n +1 | cut -c1-110 | \
    grep -E "triton|^shape" || true
}
for part in "$@"; do
  case "${part}" in
    bf16_d128)
      run sweep_bf16_d128 380 --dtype bfloat16 --impls triton,cudnn,xla,mha \
        --shapes $(shapes 128) ${gqa} ;;
    bf16_d64_d256)
      run sweep_bf16_d64 260 --dtype bfloat16 --impls triton,cudnn,mha \
        --shapes $(shapes 64)
      run sweep_bf16_d256 260 --dtype bfloat16 --impls triton,cudnn,mha \
        --shapes $(shapes 256) ;;
    fp16)
      run sweep_fp16_d128 380 --dtype float16 --impls triton,cudnn,xla,mha \
        --shapes $(shapes 128) ${gqa} ;;
    long)
      run long_context 180 --impls triton,cudnn --causal yes --iters 2 \
        --shapes 1,16384,16,128 1,32768,16,128 1,65536,16,128 \
        1,131072,16,128 ;;
    *) echo "unknown part ${part}" >&2; exit 2 ;;
  esac
done
