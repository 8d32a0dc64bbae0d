#!/usr/bin/env bash
# Runs benchmarks/step_time.py for every arm over the links named in $LINKS (default: nvlink).
# Usage (2 GPUs): LINKS="nvlink shm socket" ARMS="ddp zeroq1 zeroq2" bash benchmarks/run_step_time.sh > results.jsonl
# An arm is ddp or zeroq1/2/3, optionally with +int8 and/or +offload_optimizer / +offload_params.
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
  for arm in ${ARMS:-ddp zeroq1 zeroq2}; do
    extra=()
    [[ $arm == *+int8* ]] && extra+=(--quantized)
    [[ $arm == *+offload_optimizer* ]] && extra+=(--offload optimizer)
    [[ $arm == *+offload_params* ]] && extra+=(--offload params)
    env "${linkenv[@]}" BENCH_LINK=$link python3 -m torch.distributed.run --nproc-per-node "$nproc" \
      --master-port $((29500 + RANDOM % 1000)) benchmarks/step_time.py --arm "${arm%%+*}" "${extra[@]}" ${BENCH_ARGS:-} \
      2>&1 | grep -E '^\{|Error|error' | head -5
  done
done
