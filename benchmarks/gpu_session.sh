#!/usr/bin/env bash
# Everything the open issues still need from a 2-GPU machine, in three device calls of < 10 minutes each.
#   bash benchmarks/gpu_session.sh tests  > $OUT/gpu_tests.log      # tests, kernel bandwidth, INT8 accuracy
#   bash benchmarks/gpu_session.sh bench1 > $OUT/step_time_1.jsonl  # NVLink and host-memory links
#   bash benchmarks/gpu_session.sh bench2 > $OUT/step_time_2.jsonl  # socket link, offload arms
# Carry the hydra/omegaconf wheels only for the CLI check (../shared/tools/gpu-wheels.sh).
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" ZEROQ_EXT_CACHE=/tmp/zeroq_ext
case ${1:-tests} in
  tests)
    python3 -c "from lightning_zeroq.ops._load import main; raise SystemExit(main())" 2>&1 | tail -2  # build once
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py tests/ops -s 2>&1 \
      | grep -E "worst|passed|failed|FAILED|Error" | tail -40
    python3 -m benchmarks.quant_kernels 2>&1 | tail -15
    python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/quant_accuracy.py --steps 300 2>&1 | grep '^{'
    ;;
  bench1)
    LINKS="nvlink shm" ARMS="ddp zeroq2 zeroq2+int8 zeroq3 zeroq3+int8" bash benchmarks/run_step_time.sh
    ;;
  bench2)
    LINKS="socket" ARMS="ddp zeroq2 zeroq2+int8 zeroq3 zeroq3+int8" bash benchmarks/run_step_time.sh
    ARMS="zeroq2 zeroq2+offload_optimizer zeroq3 zeroq3+offload_params" bash benchmarks/run_step_time.sh
    ;;
esac
