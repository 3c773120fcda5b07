#!/bin/bash
# Issue 16's checks on one GPU machine, in one bounded call (device time is short):
# the `gpu` tests, partrain against the hand-written loop, then serial predictions
# against runs. Each part has its own time limit, so one that hangs costs only its own;
# the logs and JSON go to $OUT (default ./gpu-out).
#
#   PARTRAIN_DATA_DIR=DIR [OUT=dir] [T_TESTS=240 T_BENCH=240 T_PRED=330] [PYTEST_ARGS="-n 8"] bash benchmarks/gpu_all.sh
#
# About 13 minutes with the defaults on an H200; shrink the limits, or pass ONLY_BENCH /
# ONLY_PRED (benchmarks' --only) to measure a part again, or PRED_CONFIGS (gpu_predict's
# --configs: gpt, a user's model) to predict others. Runs from the source tree.
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}  # $PWD: tests.gallery's user models
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
: "${PARTRAIN_DATA_DIR:?set PARTRAIN_DATA_DIR to the folder with mnist/ and cifar10_sample/}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)" | tee -a "$OUT/env.txt"

part() {  # name, limit, command...
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - start)) s (limit $limit s)"
    grep -v '^W[0-9]' "$OUT/$name.log" | tail -25
}
[ "${T_TESTS:-240}" -gt 0 ] && part tests "${T_TESTS:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider \
    --timeout 120 -rfEs --durations 12 $PYTEST_ARGS tests/test_gpu.py tests/test_gpu_profile.py
[ "${T_BENCH:-240}" -gt 0 ] && part gpu "${T_BENCH:-240}" python3 benchmarks/gpu.py --data-dir "$PARTRAIN_DATA_DIR" \
    --steps 100 --rounds 2 --compile-rounds 1 ${ONLY_BENCH:+--only "$ONLY_BENCH"} --json "$OUT/gpu.json"
[ "${T_PRED:-330}" -gt 0 ] && part predict "${T_PRED:-330}" python3 benchmarks/gpu_predict.py --steps 40 \
    ${ONLY_PRED:+--only "$ONLY_PRED"} ${PRED_CONFIGS:+--configs "$PRED_CONFIGS"} --json "$OUT/gpu_predict.json"
exit 0
