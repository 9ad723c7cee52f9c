#!/usr/bin/env bash
# One call on the GPU machine: environment facts, the GPU tests, the benchmarks; a short table last.
#   NVDNN_CACHE_DIR=.gpu-cache bash benchmarks/gpu_check.sh [pytest args...]
#   BENCHES="" CALLS=quick SWEEP=quick bash benchmarks/gpu_check.sh -k nothing   # the optional stages only
#   NVDNN_UNMEASURED=1 BENCHES="" RNN=quick DECODER=1 bash benchmarks/gpu_check.sh -n 14 tests/test_gpu_rnn.py \
#       tests/test_gpu_rnn_backward.py   # the recurrent cells' GPU tests and benchmarks, the decoder's check
#   BENCHES="" DECODER=1 NVDNN_PROFILE=rnn RNN_BREAKDOWN=h512.b16. bash benchmarks/gpu_check.sh -n 14 \
#       tests/test_gpu_rnn.py tests/test_gpu_rnn_backward.py tests/test_gpu_pointwise.py \
#       -k "proj or dropout_seed or gated"
# Logs and JSON go to $OUT (or ./gpu-out); NVDNN_RECORD collects the specs the run needed.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NVDNN_RECORD=${NVDNN_RECORD:-$out/record.jsonl}
python3 - <<'PY' | tee "$out/env.txt"
import cupy, nvdnn
from nvdnn import compiler
props = cupy.cuda.runtime.getDeviceProperties(0)
print(f"device {props['name'].decode()} arch {compiler.device_arch()} NVRTC {compiler.nvrtc_version()} "
      f"headers {compiler.headers_version()} cupy {cupy.__version__} cache {nvdnn.default_cache().folder} "
      f"entries {nvdnn.default_cache().info()['entries']}")
PY
# stage limits (seconds) keep one call inside the machine's per-command limit
timeout "${TEST_TIMEOUT:-360}" python3 -m pytest -m gpu -q -p no:cacheprovider "$@" 2>&1 \
  | tee "$out/gpu_tests.log" | grep -E "FAILED|ERROR|passed|failed" | tail -40
for bench in ${BENCHES-copy pointwise graph norm reduce pool}; do  # BENCHES="" runs none
  timeout "${BENCH_TIMEOUT:-150}" python3 benchmarks/bench_$bench.py --json "$out/bench_$bench.json" 2>&1 \
    | tee "$out/bench_$bench.log"
done
# optional stages. CALLS=quick|full: host cost per call of every entry point (quick: small rows, ~45 s; full ~90 s);
# SWEEP=quick|full: the memory-bound real-model sweeps (quick ~10 s a family, full ~2 min), SWEEP_FAMILIES=norm,pool
if [ -n "${CALLS:-}" ]; then
  timeout "${CALLS_TIMEOUT:-150}" python3 benchmarks/bench_calls.py $([ "$CALLS" = quick ] && echo --quick) \
      --json "$out/bench_calls.json" > "$out/bench_calls.log" 2>&1
  grep -vE "^\[[0-9]+/" "$out/bench_calls.log" | tail -"${CALLS_LINES:-70}"
fi
if [ -n "${SWEEP:-}" ]; then
  timeout "${SWEEP_TIMEOUT:-300}" python3 benchmarks/bench_sweep.py $([ "$SWEEP" = quick ] && echo --quick) \
      ${SWEEP_FAMILIES:+--family "$SWEEP_FAMILIES"} --json "$out/bench_sweep.json" > "$out/bench_sweep.log" 2>&1
  grep -E "^(pointwise|norm|softmax|reduce|pool): |Error|error" "$out/bench_sweep.log" | tail -40
fi
# RNN=quick|full: bench_rnn's LSTM forward and training step (quick: 128 steps, one layer); DECODER=1: the
# decoder-layer example's op-by-op check against the float64 reference at a small LLaMA-like shape
if [ -n "${RNN:-}" ]; then
  for train in "" --train; do
    timeout "${RNN_TIMEOUT:-120}" python3 benchmarks/bench_rnn.py $([ "$RNN" = quick ] && echo --quick) $train \
        --json "$out/bench_rnn${train:+_train}.json" > "$out/bench_rnn${train:+_train}.log" 2>&1
    tail -16 "$out/bench_rnn${train:+_train}.log"
  done
fi
if [ -n "${RNN_BREAKDOWN:-}" ]; then  # e.g. RNN_BREAKDOWN=h512.b16.: where those training steps' time goes
  timeout "${RNN_TIMEOUT:-120}" python3 benchmarks/bench_rnn.py --quick --train --only "$RNN_BREAKDOWN" --breakdown 8 \
      > "$out/bench_rnn_breakdown.log" 2>&1
  grep -E "^  |geomean" "$out/bench_rnn_breakdown.log"
fi
if [ -n "${DECODER:-}" ]; then
  timeout "${DECODER_TIMEOUT:-60}" python3 examples/decoder_layer.py --check-ops --seq 512 --hidden 1024 --heads 8 \
      --kv-heads 2 --ffn 3584 2>&1 | tee "$out/decoder_check.log" | tail -4
fi
python3 -c "import nvdnn; print('cache entries after the run:', nvdnn.default_cache().info()['entries'])"
# NVDNN_PROFILE=kernels: ncu counters of the memory-bound kernels short of target (profile_kernels.py);
# NVDNN_PROFILE=rnn: the persistent LSTM at batch 1 and 16, W_hh in shared memory, then in registers
if [ "${NVDNN_PROFILE:-}" = kernels ] && command -v ncu >/dev/null; then
  timeout "${PROFILE_TIMEOUT:-120}" ncu --clock-control none --kernel-name regex:nvdnn_ --launch-skip 9 \
      --launch-count 3 --section SpeedOfLight --section Occupancy --section WarpStateStats \
      --section MemoryWorkloadAnalysis python3 benchmarks/profile_kernels.py > "$out/ncu.txt" 2>&1
  grep -E "nvdnn_|Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Stall|Hit Rate|Duration" \
      "$out/ncu.txt" | head -60
fi
if [ "${NVDNN_PROFILE:-}" = rnn ] && command -v ncu >/dev/null; then
  for held in 0 1; do
    NVDNN_UNMEASURED=$held timeout "${PROFILE_TIMEOUT:-120}" ncu --clock-control none --kernel-name regex:persistent \
        --launch-skip 6 --launch-count 2 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section SourceCounters python3 benchmarks/profile_rnn.py \
        > "$out/ncu_rnn_kreg$held.txt" 2>&1
    grep -E "persistent|Duration|Warp Cycles Per Issued|Stall|Issued Ipc|L2 Hit|Throughput" \
        "$out/ncu_rnn_kreg$held.txt" | head -40
  done
fi
# the device tool returns a handful of files: pack the logs, JSON and recording into one
pack=$(mktemp -d)/gpu_check.tar.gz
tar -czf "$pack" -C "$out" . && find "$out" -mindepth 1 -delete && mv "$pack" "$out/"
