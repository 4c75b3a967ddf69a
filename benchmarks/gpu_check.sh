#!/usr/bin/env bash
# One lease on a GPU machine: build the CUDA extension, record the compiler's resource usage,
# benchmark, run the CUDA tests. Everything lands under $RESULTS (default ./gpu_out). Steps are
# picked by name so that one call can do what a short lease allows:
#
#   bash benchmarks/gpu_check.sh build kernels bench hookcost hooks fsdp
#
# Each step has its own time limit; on an H100 (2026-11-27) the five took 3.3 minutes. The output
# folder holds more than the 8 files a device call brings back: pack it (tar) at the end of the
# call. The test workers run torch with one thread each: with its default of one per core, 14
# workers on 16 cores ran the kernel tests ten times slower. "kernels_changed" runs the tests of
# the ops named in $KERNELS only; $BENCH_ARGS (e.g. "--only dct") narrows the benchmark, and
# $MEMORY_WORKLOADS / $MEMORY_SECONDS the memory planner's run ("memorytrace": the plans in
# $MEMORY_PLANS profiled, one step each). "bisect" rebuilds small
# extensions to find which build step puts a private copy of libstdc++ in them (issue 35).
# Runs from the repository root with the machine's own python3 (which holds a CUDA torch). Wheels
# in .whl/ are installed first: the workplace's GPU image lacks expecttest, which
# torch.library.opcheck needs (pip download expecttest -d .whl, and carry .whl).
set -uo pipefail
OUT=${RESULTS:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# -P: the source tree must not shadow the installed package, which holds the compiled _C.
PY="python3 -P"
# the benchmarks import their harness (lab/) from benchmarks/, which -P leaves off the path
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/benchmarks

for step in "$@"; do
  echo "== $step $(date +%T)"
  case "$step" in
  build)
    nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
    if ls .whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    fi
    start=$(date +%s)
    HETERO_COMM_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=16 \
      python3 -m pip install -v --no-build-isolation --no-deps --no-index . >"$OUT/build.log" 2>&1 \
      || { tail -40 "$OUT/build.log"; exit 1; }
    echo "build: $(( $(date +%s) - start )) s"
    $PY -c "import hetero_comm; print('cuda backend:', hetero_comm.kernel_backend('cuda'))"
    so=$($PY -c "import hetero_comm._C as c; print(c.__file__)")
    cuobjdump --dump-resource-usage "$so" >"$OUT/resource_usage.txt" 2>&1
    grep -c "REG:" "$OUT/resource_usage.txt" | sed 's/^/kernels with resource lines: /'
    ;;
  linkdiag)  # issue 12 bug 2: what the extension links, and a native backtrace of a rejected call
    so=$($PY -c "import hetero_comm._C as c; print(c.__file__)")
    readelf -d "$so" | grep NEEDED
    echo "std:: symbols defined in _C: $(nm -C --defined-only "$so" | grep -c ' std::')"
    grep -E "^(c\+\+|g\+\+|x86_64.*g\+\+|/usr/bin/(c|g)\+\+).* -shared" "$OUT/build.log" | tail -1 | cut -c1-1500
    grep -m2 -E "nvcc .*select_segments" "$OUT/build.log" | cut -c1-600
    for tool in c++ g++; do echo "$tool: $(readlink -f "$(command -v $tool)") $($tool -dumpfullversion)"; done
    nvcc --version | tail -2
    bad="import torch; from hetero_comm import ops; ops.segment_accumulate_(torch.ones(10, device='DEV'), torch.ones(11, device='DEV'), 4)"
    for dev in cpu cuda; do
      $PY -X faulthandler -c "${bad//DEV/$dev}" 2>&1 | grep -E "Error|Segmentation" | head -2
    done
    echo "symbol bindings of _C's stream calls (LD_DEBUG) on the failing call:"
    LD_DEBUG=bindings $PY -c "${bad//DEV/cuda}" 2>&1 | grep -E "_C\.[^ ]*so.*(_M_insert|num_put|locale|ostream)" | head -8
    timeout 45 cuda-gdb -batch -ex run -ex bt --args python3 -P -c "${bad//DEV/cuda}" 2>&1 | grep -E "^#|signal" | head -30
    ;;
  bench)
    timeout 110 $PY benchmarks/bench_kernels.py --device cuda ${BENCH_ARGS:-} --json "$OUT/bench_kernels_cuda.json" 2>&1 \
      | tee "$OUT/bench_kernels_cuda.txt" | grep -A30 "^aims"
    ;;
  hookcost)
    timeout 100 $PY benchmarks/bench_hook_cost.py --device cuda --steps 20 --warmup 5 --json "$OUT/bench_hook_cost_cuda.json" \
      --profile "$OUT/hook_profile_cuda.txt" --trace "$OUT/hook_trace_adamw_cuda.json" 2>&1 \
      | tee "$OUT/bench_hook_cost_cuda.txt" | tail -22
    # buckets of 4-8K values: the recipes' host time per bucket (on the CPU: 1.0-1.1 ms)
    timeout 60 $PY benchmarks/bench_hook_cost.py --device cuda --width 64 --layers 16 --batch 8 \
      --bucket-mb 0.016 --steps 50 --warmup 5 2>&1 | tee "$OUT/bench_hook_cost_cuda_small_buckets.txt" | tail -16
    ;;
  bisect)  # issue 35 bug 1: which build step puts a private libstdc++ in an extension
    $PY benchmarks/gpu_bisect_numeric_error.py --out /tmp/bisect 2>&1 | tee "$OUT/bisect.txt" | tail -30
    ;;
  kernels)
    OMP_NUM_THREADS=1 PYTHONPATH=/tmp/site timeout 170 $PY -m pytest -m "" -q -p no:cacheprovider -n 14 -k cuda --durations=10 \
      tests/test_cuda_kernels.py tests/test_cuda_kernel_cases.py tests/test_buffer_pool.py 2>&1 | tee "$OUT/kernels.log" | tail -30
    pkill -9 -f "pytest" || true  # workers a time limit left behind would compete with what follows
    ;;
  kernels_changed)  # the kernel tests of the ops named in $KERNELS (a pytest -k expression)
    OMP_NUM_THREADS=1 PYTHONPATH=/tmp/site timeout ${KERNEL_TEST_SECONDS:-150} $PY -m pytest -m "" -v -p no:cacheprovider -n 15 \
      -k "cuda and (${KERNELS:?name the ops, e.g. KERNELS='select or pack'})" tests/test_cuda_kernel_cases.py \
      >"$OUT/kernels_changed.log" 2>&1
    echo "passed: $(grep -c ' PASSED' "$OUT/kernels_changed.log"), failed: $(grep -c ' FAILED' "$OUT/kernels_changed.log")"
    grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/kernels_changed.log" | tail -15
    pkill -9 -f "pytest" || true
    ;;
  hooks)
    PYTHONPATH=/tmp/site timeout 140 $PY -m pytest -m "" -q -p no:cacheprovider -n 6 tests/test_cuda_hooks.py \
      tests/test_build.py::test_an_error_message_with_a_number_raises_instead_of_crashing ${HOOK_TESTS:-} \
      2>&1 | tee "$OUT/hooks.log" | tail -40
    ;;
  fsdp)  # issue 62: the one call on FSDP2 with CUDA tensors (2 gloo ranks on the one GPU)
    PYTHONPATH=/tmp/site timeout 200 $PY -m pytest -m "" -q -p no:cacheprovider -n 3 --durations=5 \
      tests/test_cuda_fsdp.py 2>&1 | tee "$OUT/fsdp.log" | tail -30
    ;;
  memory)  # issue 37: the planner on CUDA, the small workloads and the 0.4B-parameter transformer
    PYTHONPATH=/tmp/site timeout 120 $PY -m pytest -m "" -q -p no:cacheprovider tests/test_cuda_memory.py \
      2>&1 | tee "$OUT/memory_tests.log" | tail -5
    timeout ${MEMORY_SECONDS:-300} $PY benchmarks/bench_memory.py --device cuda \
      --workloads ${MEMORY_WORKLOADS:-transformer,wide_transformer} \
      --json "$OUT/bench_memory_cuda.json" 2>&1 | tee "$OUT/bench_memory_cuda.txt" | tail -24
    ;;
  memorytrace)  # issue 37: where the sixth run's swapping plans at half the wide transformer's peak lost time,
    # and what partial recomputation costs there (every block partial; four swaps and three partial)
    timeout ${MEMORY_SECONDS:-180} $PY benchmarks/trace_memory_plan.py --device cuda --workload wide_transformer \
      --plans "${MEMORY_PLANS:-k s s s k s s k k k,k k s s k s s k k k,k r r k r r r k k k,k p p p p p p p p k,k s s p k s s p p k}" \
      2>&1 | tee "$OUT/trace_memory_plan_cuda.txt" | tail -60
    ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
done
