#!/usr/bin/env bash
# Issue 13: INT8 quantize kernel variants side by side on one GPU, in one device call of about 4 minutes.
# Variants: '.' (this checkout's csrc/) and .kv_b, .kv_c (each a copy of lightning_zeroq/, csrc/ and
# benchmarks/quant_kernels.py holding one kernel variant); VARIANTS=". .kv_b" picks others.
#   bash benchmarks/kernel_variants.sh          # from the repository root, on the GPU machine
# 1. builds every variant's JIT extension at once in the background (~60-90 s), and prints the
#    registers nvcc gives the quantize kernels (G = 64: one chunk per lane, team of 8) of each;
# 2. times quantize_pack / unpack_dequantize at 256 Mi elements, fp32/bf16/fp16, variants
#    alternating, three rounds (benchmarks/quant_kernels.py of each variant);
# 3. runs the kernel tests (pytest -m gpu tests/ops: tests/ops/test_kernels_gpu.py, which runs on CUDA
#    when torch.cuda.is_available()) against every variant, the three in parallel.
# Every line is printed with its variant's name as prefix; logs also go to $OUT (default /tmp/zeroq_out).
set -u
cd "$(dirname "$0")/.."
root=$PWD
out=${OUT:-/tmp/zeroq_out}
mkdir -p "$out"
read -r -a variants <<< "${VARIANTS:-. .kv_b .kv_c}"
export ZEROQ_EXT_CACHE=${ZEROQ_EXT_CACHE:-/tmp/zeroq_ext}
start=$SECONDS
stamp() { echo "== $1 ($((SECONDS - start)) s)"; }
name_of() { [ "$1" = . ] && echo base || echo "${1#.}"; }
# tests/ops imports hypothesis (its property tests are CPU-only, but collected): install it from a
# carried .whl/ if the machine lacks it (as gpu_session.sh one_gpu), else leave that file out.
extra=()
if ! python3 -c "import hypothesis" 2>/dev/null; then
  if [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl > "$out/pip.log" 2>&1; then
    export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site
  else
    extra=(--ignore="$root/tests/ops/test_quant_properties.py")
  fi
fi
for v in "${variants[@]}"; do
  [ -f "$v/csrc/quant_int8.cu" ] && [ -f "$v/lightning_zeroq/ops/_load.py" ] || { echo "missing variant $v" >&2; exit 2; }
done

stamp "build (parallel) and registers"
nvcc=$(python3 -c "from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or '')" 2>/dev/null)/bin/nvcc
[ -x "$nvcc" ] || nvcc=$(command -v nvcc || true)
for v in "${variants[@]}"; do
  n=$(name_of "$v")
  # cwd = the variant: `python -m` puts it first on sys.path, so its lightning_zeroq (and csrc/) is used
  (cd "$v" && timeout 200 python3 -c "from lightning_zeroq.ops._load import main; raise SystemExit(main())") \
    > "$out/build_$n.log" 2>&1 &
  if [ -n "$nvcc" ] && [ -x "$nvcc" ]; then
    ("$nvcc" -std=c++17 -O3 -arch=sm_90 --resource-usage -c -o /dev/null "$v/csrc/quant_int8.cu" 2>&1 \
      | python3 -c '
import re, sys
name = None
for line in sys.stdin:
    m = re.search(r"Compiling entry function .(\S+). for", line)
    if m:
        name = m.group(1)
    m = re.search(r"Used (\d+) registers", line)
    if m and name and "quantize_one_chunk_kernel" in name and "Li8E" in name:
        kind = re.search(r"kernelI(\w+?)Li8E", name).group(1)
        print(f"registers quantize_one_chunk_kernel<{kind}, 8>: {m.group(1)}")
') > "$out/registers_$n.txt" 2>&1 &
  fi
done
wait
for v in "${variants[@]}"; do
  n=$(name_of "$v")
  tail -4 "$out/build_$n.log" | sed "s|^|$v: |"
  [ -f "$out/registers_$n.txt" ] && sed "s|^|$v: |" "$out/registers_$n.txt"
done

stamp "timing: 256 Mi elements, three rounds, alternating"
for i in 1 2 3; do
  for v in "${variants[@]}"; do
    (cd "$v" && timeout 90 python3 -m benchmarks.quant_kernels --numel 268435456) 2>&1 | sed "s|^|$v: |"
  done
done | tee "$out/quant_kernels_variants.txt"
echo "quantize_pack vs copy (rounds 1 2 3):"
for v in "${variants[@]}"; do
  for dt in bfloat16 float16 float32; do
    echo "$v $dt: $(grep -E "^$v: quantize_pack +$dt " "$out/quant_kernels_variants.txt" | awk '{print $NF}' | tr '\n' ' ')"
  done
done

stamp "kernel tests (pytest -m gpu tests/ops), variants in parallel"
for v in "${variants[@]}"; do
  n=$(name_of "$v")
  (cd "$v" && PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH} timeout 200 python3 -m pytest --import-mode=importlib \
    -p no:cacheprovider -q -m gpu -rf -s ${extra[@]+"${extra[@]}"} "$root/tests/ops") > "$out/tests_$n.log" 2>&1 &
done
wait
for v in "${variants[@]}"; do
  n=$(name_of "$v")
  grep -vE "^\s*$" "$out/tests_$n.log" | tail -25 | sed "s|^|$v: |"
done
stamp "done"
