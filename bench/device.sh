#!/usr/bin/env bash
# Runs the GPU tests and benchmarks on a machine that has JAX for the GPU but
# cannot install this project (no network): pallasopt is imported through a
# symlink to this checkout instead of `pip install -e`.
#
#   bench/device.sh env                 # device, driver and package versions
#   bench/device.sh tests [pytest args] # pytest -m gpu, log + junit XML in $OUT
#   bench/device.sh bench [bench args]  # python -m bench.kernels, resumable
#   bench/device.sh step [args]         # whole train steps timed (bench.whole_step --time)
#   bench/device.sh all                 # env, tests, then the priority rows, in one
#                                       # device call of at most $ALL_SECONDS (540)
#
# `all` is the first call of a GPU session: the tests get at most 240 s, the
# whole Llama-shaped train step (AdamW, f32 and int8 state against Optax, in
# the fused, clip-fused and update forms) at most 120 s, the bench the rest,
# priority rows first (8-bit and bf16 state at a 16M leaf,
# GPT-2 small and the 1B decoder; Muon at 4096^2 and on GPT-2 small; Adafactor's
# trees); the JSONL and its table land in $OUT. A second call of `bench` with
# the same --out resumes where the first stopped.
#
# Logs and results go to $OUT (default /tmp/pallasopt-out). Set
# PALLASOPT_COMMIT=<sha> when the checkout has no .git, so every bench record
# names the code it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/pallasopt-out}
mkdir -p /tmp/pallasopt-import "$out"
ln -sfn "$PWD" /tmp/pallasopt-import/pallasopt
export PYTHONPATH=/tmp/pallasopt-import:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}

step=${1:?usage: bench/device.sh env|tests|bench|all [args]}
shift
case $step in
  env)
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    $python - <<'EOF'
import jax, jaxlib, optax, numpy
print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "optax", optax.__version__, "numpy", numpy.__version__)
print("devices", jax.devices(), [d.device_kind for d in jax.devices()])
import pallasopt
print("pallasopt from", pallasopt.__file__)
EOF
    ;;
  tests)
    # Several workers compile Triton kernels in parallel; without preallocation
    # they share the one GPU's memory.
    XLA_PYTHON_CLIENT_PREALLOCATE=false $python -m pytest -m gpu -q -p no:cacheprovider \
      --junitxml="$out/gpu-tests.xml" "$@" 2>&1 | tee "$out/gpu-tests.log"
    ;;
  bench)
    $python -m bench.kernels "$@" 2>&1 | tee -a "$out/bench.log"
    ;;
  step)
    $python -m bench.whole_step --time 20 --json "$out/whole-step-time.json" "$@" 2>&1 \
      | tee -a "$out/whole-step.log"
    ;;
  all)
    budget=${ALL_SECONDS:-540}
    start=$SECONDS
    "$0" env 2>&1 | tee "$out/env.log"
    timeout 240 "$0" tests -n 4
    timeout 120 "$0" step --model llama-1b-2l --form fused --form clip-fused --form update
    left=$((budget - (SECONDS - start)))
    priority='^(adamw|lion)/(leaf/f32/16777216|gpt2-small/f32|decoder-1b/f32)/(bf16-sr/)?state-'
    priority+='|^muon/(matrix/4096x4096|gpt2-small/f32)|^adafactor/(gpt2-small|decoder-1b)/f32/[a-z]'
    timeout "$((left > 30 ? left - 30 : 1))" "$0" bench --filter "$priority" --out "$out/kernels-full.jsonl"
    ;;
  *)
    echo "unknown step: $step (env, tests, bench, step or all)" >&2
    exit 2
    ;;
esac
