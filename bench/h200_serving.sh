#!/usr/bin/env bash
# The serving run (bench/HISTORY.md, `serving.py`) on one H200 (the device machine), from a checkout
# of this repository whose wheels are installed in /tmp/site (bench/README.md, "Carrying the
# packages and the code to the device machine"; the streaming clients also need aiohttp's wheels).
# Usage: bench/h200_serving.sh OUT_FILE TIMEOUT_S [serving.py args] (the JSON is written as each
# batch ends, so a run cut short by TIMEOUT_S keeps what it measured).
set -u
out=$1
limit=$2
shift 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/engine:$PWD/protocol:$PWD/bench
echo "serving run: $(date -u +%H:%M:%S), limit ${limit}s, args: $*"
timeout "$limit" python3 bench/serving.py --out "$out" "$@" >"$out.log" 2>&1
echo "serving exit $? at $(date -u +%H:%M:%S)" | tee -a "$out.log"
tail -5 "$out.log"
