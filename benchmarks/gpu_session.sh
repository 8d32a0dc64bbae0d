#!/usr/bin/env bash
# Everything the open issues need from a 2-GPU machine, in two device calls of < 10 minutes each.
# Every piece has its own time limit and writes into $OUT as it goes, so a slow piece costs only itself.
#   bash benchmarks/gpu_session.sh tests   # GPU tests, kernel bandwidth, INT8 accuracy (stage 2 and 3)
#   bash benchmarks/gpu_session.sh bench   # step time and peak memory: three links, offload, 1B stage 3
#   bash benchmarks/gpu_session.sh recheck # after fixes: stage-3 parity, kernels, memory of each arm, socket repeats
#   bash benchmarks/gpu_session.sh checkpoint # checkpoint save/load time, async blocked time, host memory vs FSDP2
# What the open issues still need from 2 H200s (session 5; each mode below is one device call):
#   #13, #14  peers        (carry .whl: DeepSpeed; ~10 min: split nvlink/shm/socket into two calls if needed)
#   #12       checkpoint   #15  fabric   #17  side_channel (carry .bench_old)   #11 (optional)  eps
#   #13       memory       (carry .whl for ds2/ds3; NPROC=1 for world size 1; MEMORY_ARMS=ds2,ds3 for a call of its own)
#   one H200: offload_table (the README offload table)
#   first, on any number of GPUs (1 will do): verify -- session 5's changes that no GPU has run yet
#   (git archive 35ea923 lightning_zeroq benchmarks csrc | tar -x -C .before; carry .before and .whl)
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/zeroq_out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" ZEROQ_EXT_CACHE=/tmp/zeroq_ext
build() {  # compile (or load) the CUDA extension once, before any distributed run
  { time timeout 150 python3 -c "from lightning_zeroq.ops._load import main; raise SystemExit(main())"; } \
    > "$out/build.log" 2>&1
  tail -3 "$out/build.log"
}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$out/gpus.txt" 2>&1
case ${1:-tests} in
  tests)
    build
    timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_gpu.py tests/ops -s \
      > "$out/gpu_tests.log" 2>&1
    grep -E "worst|deviation|passed|failed|FAILED|Error" "$out/gpu_tests.log" | tail -45
    timeout 90 python3 -m benchmarks.quant_kernels > "$out/quant_kernels.txt" 2>&1; tail -12 "$out/quant_kernels.txt"
    for stage in 2 3; do
      timeout 100 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/quant_accuracy.py --steps 300 \
        --stage $stage 2>&1 | grep -E '^\{|Error' | tee -a "$out/quant_accuracy.jsonl"
    done
    ;;
  bench)
    five=ddp,zeroq2,zeroq2+int8,zeroq3,zeroq3+int8
    LAUNCH_TIMEOUT=170 LINKS=nvlink ARMS=$five,zeroq2+offload_optimizer,zeroq3+offload_params \
      bash benchmarks/run_step_time.sh | tee "$out/step_time_nvlink.jsonl"
    LAUNCH_TIMEOUT=120 LINKS=shm ARMS=$five bash benchmarks/run_step_time.sh | tee "$out/step_time_shm.jsonl"
    LAUNCH_TIMEOUT=170 LINKS=socket ARMS=$five bash benchmarks/run_step_time.sh | tee "$out/step_time_socket.jsonl"
    LAUNCH_TIMEOUT=90 LINKS=nvlink ARMS=zeroq3,zeroq3+int8 BENCH_ARGS="--layers 17" \
      bash benchmarks/run_step_time.sh | tee "$out/step_time_1b.jsonl"
    ;;
  recheck)
    build
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_gpu.py tests/ops -s \
      -k "engine_matches or offload_matches or kernels_gpu" > "$out/gpu_tests.log" 2>&1
    grep -E "worst|passed|failed|FAILED|Error" "$out/gpu_tests.log" | tail -40
    timeout 90 python3 -m benchmarks.quant_kernels > "$out/quant_kernels.txt" 2>&1; tail -12 "$out/quant_kernels.txt"
    export OMP_NUM_THREADS=$(( $(nproc) / 2 ))  # torchrun would set 1: the offload arms' host step needs the cores
    LAUNCH_TIMEOUT=200 LINKS=nvlink ARMS=zeroq2,zeroq2+int8,zeroq2+offload_optimizer,zeroq3,zeroq3+int8,zeroq3+offload_params \
      bash benchmarks/run_step_time.sh | tee "$out/step_time_nvlink.jsonl"
    LAUNCH_TIMEOUT=120 LINKS=socket ARMS=zeroq3,zeroq3+int8,zeroq3,zeroq3+int8 \
      bash benchmarks/run_step_time.sh | tee "$out/step_time_socket.jsonl"
    ;;
  links)  # stage 2 and 3, with and without INT8, over socket and host memory, OMP threads as in recheck
    build
    timeout 60 python3 -m benchmarks.quant_kernels > "$out/quant_kernels.txt" 2>&1; tail -12 "$out/quant_kernels.txt"
    export OMP_NUM_THREADS=$(( $(nproc) / 2 ))
    LAUNCH_TIMEOUT=150 LINKS=socket ARMS=zeroq2,zeroq2+int8,zeroq3,zeroq3+int8 \
      bash benchmarks/run_step_time.sh | tee "$out/step_time_socket.jsonl"
    LAUNCH_TIMEOUT=100 LINKS=shm ARMS=zeroq2,zeroq2+int8,zeroq3,zeroq3+int8 \
      bash benchmarks/run_step_time.sh | tee "$out/step_time_shm.jsonl"
    ;;
  split)  # session 3: GPU tests and kernels after the engine split; step time before/after the split
    build
    timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_gpu.py tests/ops/test_kernels_gpu.py -s \
      > "$out/gpu_tests.log" 2>&1
    grep -E "worst|deviation|passed|failed|FAILED|Error" "$out/gpu_tests.log" | tail -30
    timeout 60 python3 -m benchmarks.quant_kernels --numel 268435456 > "$out/quant_kernels.txt" 2>&1; tail -8 "$out/quant_kernels.txt"
    # The engine before the split (commit 2c428da, exported to .bench_old/ and carried) and after, alternating.
    for i in 1 2; do
      LAUNCH_TIMEOUT=100 LINKS=nvlink ARMS=zeroq2,zeroq3 bash .bench_old/benchmarks/run_step_time.sh \
        | sed 's/^{/{"code": "before-split", /' | tee -a "$out/step_time_split.jsonl"
      LAUNCH_TIMEOUT=100 LINKS=nvlink ARMS=zeroq2,zeroq3 bash benchmarks/run_step_time.sh \
        | sed 's/^{/{"code": "after-split", /' | tee -a "$out/step_time_split.jsonl"
    done
    ;;
  int8_params)  # INT8 payloads resting with parameters offloaded to the CPU, against the same run without
    export OMP_NUM_THREADS=$(( $(nproc) / 2 ))
    LAUNCH_TIMEOUT=200 LINKS=nvlink ARMS=zeroq3+int8,zeroq3+int8+offload_optimizer,zeroq3+int8+offload_params \
      bash benchmarks/run_step_time.sh | tee "$out/step_time_int8_params.jsonl"
    ;;
  side_channel)  # issue 17 item 8: stage-2 INT8 over loopback sockets, before (2c428da) and after, alternating
    export OMP_NUM_THREADS=$(( $(nproc) / 2 ))
    for i in 1 2; do
      (cd .bench_old && LAUNCH_TIMEOUT=90 LINKS=socket ARMS=zeroq2+int8 bash benchmarks/run_step_time.sh) \
        | sed 's/^{/{"code": "before", /' | tee -a "$out/step_time_side_channel.jsonl"
      LAUNCH_TIMEOUT=90 LINKS=socket ARMS=zeroq2+int8 bash benchmarks/run_step_time.sh \
        | sed 's/^{/{"code": "after", /' | tee -a "$out/step_time_side_channel.jsonl"
    done
    ;;
  options)  # issue 13 options, first look: NVLink and sockets
    export OMP_NUM_THREADS=$(( $(nproc) / 2 ))
    LAUNCH_TIMEOUT=150 LINKS=nvlink ARMS=zeroq3,zeroq3+keep,zeroq3+prefetch2,zeroq3+int8+qgrad,zeroq2+qgrad \
      bash benchmarks/run_step_time.sh | tee "$out/step_time_options_nvlink.jsonl"
    LAUNCH_TIMEOUT=150 LINKS=socket ARMS=zeroq3,zeroq3+keep,zeroq3+int8,zeroq3+int8+qgrad \
      bash benchmarks/run_step_time.sh | tee "$out/step_time_options_socket.jsonl"
    ;;
  checkpoint)  # save/load time and peak host memory per rank: ZeroQ (sync, async) against FSDP2 + DCP, 953M GPT
    export OMP_NUM_THREADS=$(( $(nproc) / 2 ))
    timeout 540 python3 -m torch.distributed.run --nproc-per-node 2 --master-port $((29500 + RANDOM % 1000)) \
      benchmarks/checkpoint_time.py --dir "${CKPT_DIR:-/tmp/zeroq_checkpoint_bench}" --repeats 3 --verify \
      --arms zeroq,zeroq_pageable,fsdp2,zeroq_async,fsdp2_async \
      2>&1 | grep -E '^\{|Error|error' | tee "$out/checkpoint_time.jsonl"
    ;;
  fabric)  # issue 15: the Fabric loop against the Trainer on the 953M GPT, NCCL, alternating in one launch
    for stage in 2 3; do
      timeout 280 python3 -m torch.distributed.run --nproc-per-node 2 --master-port $((29500 + RANDOM % 1000)) \
        benchmarks/fabric_step_time.py --stage $stage --modes fabric,trainer,fabric,trainer \
        2>&1 | grep -E '^\{|Error' | tee -a "$out/fabric_step_time.jsonl"
    done
    ;;
  offload_table)  # one H200: the README's offload table (zeroq2/zeroq3 offload, ratios, auto, FSDP2, the host floor)
    export OMP_NUM_THREADS=$(nproc)
    timeout 40 python3 benchmarks/host_adam.py --numel 953223168 --threads $(nproc) --steps 3 --rounds 1 \
      2>&1 | grep torch_fused | tee "$out/host_adam.jsonl"
    arms=zeroq3+offload_params,fsdp2+offload_optimizer,zeroq2+offload_optimizer,zeroq2
    arms=$arms,zeroq2+offload_optimizer+ratio25,zeroq2+offload_optimizer+ratio50,zeroq2+offload_optimizer+ratio75
    arms=$arms,zeroq2+offload_optimizer+auto,zeroq3+offload_optimizer+ratio50,zeroq3+offload_optimizer+auto
    timeout 280 python3 -m torch.distributed.run --nproc-per-node 1 benchmarks/step_time.py \
      --arms $arms,zeroq3+offload_params,fsdp2+offload_optimizer --steps 4 --warmup 2 --budget 13 --memory-peak \
      > "$out/step_time_offload.log" 2>&1
    grep -E '^\{' "$out/step_time_offload.log" | tee "$out/step_time_offload.jsonl"
    ;;
  one_gpu)  # what one GPU answers: the kernels before (.bench_kernel_old, the previous commit) and after,
            # alternating (issue 13), and the host AdamW kernels on this machine's CPUs (issue 14)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=$PYTHONPATH:/tmp/site  # hypothesis (tests/ops), DeepSpeed (host_adam.py)
    build
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/ops > "$out/kernel_tests.log" 2>&1
    tail -3 "$out/kernel_tests.log"
    old=(env -C .bench_kernel_old PYTHONPATH="$PWD/.bench_kernel_old" ZEROQ_EXT_CACHE=/tmp/zeroq_ext_old)
    "${old[@]}" timeout 150 python3 -c "from lightning_zeroq.ops._load import main; raise SystemExit(main())" \
      > "$out/build_old.log" 2>&1
    for i in 1 2 3; do
      "${old[@]}" timeout 60 python3 -m benchmarks.quant_kernels --dtype bfloat16 float16 2>&1 | sed 's/^/before: /'
      timeout 60 python3 -m benchmarks.quant_kernels --dtype bfloat16 float16 2>&1 | sed 's/^/after:  /'
    done > "$out/quant_kernels_before_after.txt"
    grep -E "quantize_pack|copy" "$out/quant_kernels_before_after.txt"
    timeout 280 python3 benchmarks/host_adam.py --threads "$(nproc)" --numel 476000000 2>&1 \
      | grep -E '^\{|Error' | tee "$out/host_adam.jsonl"
    ;;
  peers)  # issues 13 and 14: zeroq beside FSDP2 and DeepSpeed, every link, in one run sequence per link;
          # sockets three times in alternating order (carry .whl: DeepSpeed)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=$PYTHONPATH:/tmp/site
    build
    export OMP_NUM_THREADS=$(( $(nproc) / 2 ))
    all=ddp,fsdp2,fsdp2+keep,ds2,ds3,ds3+int8,zeroq2,zeroq2+int8,zeroq3,zeroq3+int8,zeroq3+keep
    LAUNCH_TIMEOUT=300 LINKS=nvlink ARMS=$all bash benchmarks/run_step_time.sh | tee "$out/peers_nvlink.jsonl"
    LAUNCH_TIMEOUT=300 LINKS=shm ARMS=fsdp2,ds3,zeroq3,zeroq3+int8 bash benchmarks/run_step_time.sh | tee "$out/peers_shm.jsonl"
    for i in 1 2 3; do
      LAUNCH_TIMEOUT=200 LINKS=socket ARMS=ds3,zeroq3,ds3+int8,zeroq3+int8,zeroq3+int8+qgrad \
        bash benchmarks/run_step_time.sh | sed "s/^{/{\"repeat\": $i, /" | tee -a "$out/peers_socket.jsonl"
    done
    off=zeroq2,zeroq2+offload_optimizer,ds2+offload_optimizer,fsdp2+offload_optimizer,zeroq2+offload_optimizer+ratio25
    off=$off,zeroq2+offload_optimizer+ratio50,zeroq2+offload_optimizer+ratio75,zeroq3,zeroq3+offload_params,ds3+offload_optimizer+offload_params
    LAUNCH_TIMEOUT=400 LINKS=nvlink ARMS=$off bash benchmarks/run_step_time.sh | tee "$out/peers_offload.jsonl"
    LAUNCH_TIMEOUT=200 LINKS=nvlink ARMS=zeroq2+clip,zeroq2+offload_optimizer+clip,ds2+offload_optimizer+clip \
      bash benchmarks/run_step_time.sh | tee "$out/peers_offload_clip.jsonl"
    ;;
  verify)  # session 5: lazy gradient shards (0ca1294), SplitStore, teardown release -- no GPU ran them yet
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=$PYTHONPATH:/tmp/site
    build
    n=$(nvidia-smi -L | wc -l)
    ZEROQ_GPU_WORLD=$n timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_gpu.py \
      tests/test_checkpoint_staging.py > "$out/gpu_tests.log" 2>&1
    grep -E "worst|passed|failed|FAILED|Error" "$out/gpu_tests.log" | tail -20
    run() { timeout "$1" python3 -m torch.distributed.run --nproc-per-node "$n" --master-port $((29500 + RANDOM % 1000)) "${@:2}"; }
    (cd .before && PYTHONPATH="$PWD:/tmp/site" run 150 ../benchmarks/bitwise_versions.py /tmp/before.pt) > "$out/bitwise.log" 2>&1
    run 150 benchmarks/bitwise_versions.py /tmp/after.pt >> "$out/bitwise.log" 2>&1
    python3 benchmarks/bitwise_versions.py --compare /tmp/before.pt /tmp/after.pt | tee -a "$out/bitwise.log"
    export OMP_NUM_THREADS=$(( $(nproc) / n ))
    for i in 1 2; do  # peak memory and step time before and after, alternating
      (cd .before && PYTHONPATH="$PWD:/tmp/site" run 200 benchmarks/step_time.py --arms zeroq2,zeroq3,zeroq2+offload_optimizer) \
        2>/dev/null | grep '^{' | sed 's/^{/{"code": "before", /' | tee -a "$out/step_time_verify.jsonl"
      run 250 benchmarks/step_time.py --arms zeroq2,zeroq3,zeroq2+offload_optimizer,fsdp2 \
        2>/dev/null | grep '^{' | sed 's/^{/{"code": "after", /' | tee -a "$out/step_time_verify.jsonl"
    done
    ;;
  eps)  # issue 11: default AdamW eps, ZeRO vs DDP against DDP vs itself with the ranks summed in reverse order
    build
    for stage in 2 3; do
      timeout 120 python3 benchmarks/eps_noise.py --world-size 2 --stage $stage --device cuda 2>&1 \
        | grep -E '^\{|Error' | tee -a "$out/eps_noise_cuda.jsonl"
    done
    ;;
  memory)  # issue 13: every GiB of the peaks by tensor class (benchmarks/memory_account.py), one launch per arm, each with
           # its own time limit; the first DeepSpeed arm JIT-compiles FusedAdam. Back in $OUT (8 files at most):
           # memory_account.txt, rank 0's snapshot per arm (*_rank0.pickle.gz, gunzip for pytorch.org/memory_viz) and
           # memory_peaks.tgz (every rank's live blocks at the peaks with their stacks)
    ls .whl/*.whl > /dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
    arms=${MEMORY_ARMS:-zeroq2,zeroq3,fsdp2}
    [ -z "${MEMORY_ARMS:-}" ] && python3 -c "import deepspeed" > /dev/null 2>&1 && arms=$arms,ds2,ds3
    echo "arms: $arms (world size ${NPROC:-2})" | tee "$out/memory_account.txt"
    mem=/tmp/zeroq_memory
    rm -rf "$mem"
    ds_limit=170
    for arm in ${arms//,/ }; do
      limit=${MEMORY_TIMEOUT:-100}
      case $arm in ds*) limit=${MEMORY_TIMEOUT:-$ds_limit}; ds_limit=110 ;; esac
      timeout "$limit" python3 -m torch.distributed.run --nproc-per-node "${NPROC:-2}" --master-port $((29500 + RANDOM % 1000)) \
        benchmarks/memory_account.py --arms "$arm" --out "$mem" --snapshot-mib 10 >> "$out/memory_account.txt" 2>&1 \
        || echo "memory_account.py $arm: exit $? (time limit ${limit} s; 124: reached)" | tee -a "$out/memory_account.txt"
      cp "$mem"/*_rank0.pickle.gz "$out/" 2> /dev/null
      peaks=$(cd "$mem" 2> /dev/null && ls *_peak.json.gz 2> /dev/null)
      [ -n "$peaks" ] && tar -czf "$out/memory_peaks.tgz" -C "$mem" $peaks
    done
    grep -E '^\{' "$out/memory_account.txt" | cut -c1-300
    ;;
  *) echo "usage: $0 tests|bench|recheck|links|split|int8_params|side_channel|options|checkpoint|fabric|one_gpu|eps|peers|verify|memory" >&2; exit 2 ;;
esac
