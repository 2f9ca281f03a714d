#!/usr/bin/env bash
# The megatron backend's decode run (bench/HISTORY.md, `engine_megatron.py`) on one H200 (the device
# machine), from a checkout of this repository whose wheels are installed in /tmp/site
# (bench/README.md, "Carrying the packages and the code to the device machine"): the GPU tests of
# the megatron backend start in the background while the benchmark builds its two models; the
# benchmark (decode profile, then the A/B of step settings at batch 1, 64, 256) times nothing until
# the tests are done. Usage: bench/h200_run.sh OUT_DIR DEADLINE_S (no new measurement starts after
# DEADLINE_S seconds; everything written under OUT_DIR is kept if the call is cut short). Further
# arguments go to bench/engine_megatron.py (e.g. --variants, --kv-cache-gib, --profile).
set -u
out=$1
deadline=$2
shift 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/engine:$PWD/protocol:$PWD/tests
export MEGAFLEET_GPU_REPORT=$out/gpu-report.jsonl
rm -f /tmp/gpu-tests.done
(
  timeout 240 python3 -m pytest -p no:cacheprovider --noconftest -q -rA -k "not tp2" tests/gpu/test_gpu_megatron.py \
    >"$out/gpu-tests.log" 2>&1
  echo "pytest exit $?" >>"$out/gpu-tests.log"
  touch /tmp/gpu-tests.done
) &
timeout $((deadline + 45)) python3 bench/engine_megatron.py --out "$out/engine-megatron-h200.json" \
  --wait-for /tmp/gpu-tests.done --wait-timeout 150 --deadline-s "$deadline" --warmup-max-batch 64 \
  "$@" >"$out/bench.log" 2>&1
echo "bench exit $?" >>"$out/bench.log"
wait
