#!/usr/bin/env bash
# Runs benchmarks/step_time.py over the links named in $LINKS (default: nvlink), one launch per link
# with every arm of $ARMS in it, one after another (comma-separated, see step_time.py).
# Usage (2 GPUs): LINKS="nvlink shm socket" ARMS="ddp,zeroq2,zeroq2+int8" bash benchmarks/run_step_time.sh > results.jsonl
# Extra step_time.py flags go in $BENCH_ARGS (e.g. "--layers 17"); $LAUNCH_TIMEOUT bounds each launch (s).
set -u
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nproc=${NPROC:-2}
for link in ${LINKS:-nvlink}; do
  case $link in
    nvlink) linkenv=() ;;
    shm) linkenv=(NCCL_P2P_DISABLE=1) ;;
    socket) linkenv=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo) ;;
    *) echo "unknown link $link" >&2; exit 2 ;;
  esac
  env "${linkenv[@]}" BENCH_LINK=$link timeout "${LAUNCH_TIMEOUT:-600}" python3 -m torch.distributed.run \
    --nproc-per-node "$nproc" --master-port $((29500 + RANDOM % 1000)) benchmarks/step_time.py \
    --arms "${ARMS:-ddp,zeroq2}" ${BENCH_ARGS:-} 2>&1 | grep -E '^\{|Error|error' | head -20
done
