#!/usr/bin/env bash
# One prepared GPU check for convoy: the CUDA tests (tests/test_cuda.py + the device-RNG unit tests)
# and the GPU checkpoint bench (bench/gpu.py), with one verdict line per goal.  Sized for under 8
# minutes on one GPU (an estimate, not yet timed on one: tests ~3-4 min, bench ~1 min; the
# timeouts below cap them at 5.5 + 2 min).  Log and figures go to
# "${OUT:-bench/gpu-out}": gpu_check.log (everything), cuda-tests.xml (JUnit) + .txt, gpu-bench.json + .txt.
#
#   bash bench/gpu_check.sh                      # from the repository root
#   PYTHON=/path/to/python bash bench/gpu_check.sh
#
# Without CUDA it still runs: the CUDA tests skip with their reason, the bench prints one line,
# and the script says "no CUDA" and exits 0.  Exit status: 0 when every test passed or skipped and
# the bench ran; 1 when a test failed or the bench crashed.  A missed bench goal is reported in
# its verdict line, not in the exit status (it is a figure, not a failure).
#
# What it assumes (it installs nothing the repository does not):
# * Python, first found of: $PYTHON; .venv/bin/python (`make install`); python3 if it imports
#   torch; else `make install` creates .venv (needs the network: PyPI's torch==2.13.0 wheel for
#   Linux x86_64 is the CUDA build, with its nvidia-* wheels; a venv made from a CPU-only index,
#   like a CI machine's, gets +cpu and everything here skips).
# * The device machine of this workplace (one H200) has no network and no .venv: its python3 is
#   /opt/torch/.venv (Python 3.12, torch 2.11 + CUDA 13, pytest, psutil, numpy, safetensors,
#   xxhash, pyyaml, filelock, typer, rich), but neither pydantic nor prefect/mlflow/dvc.  Put the
#   wheels of the repository's own pins (requirements.lock: pydantic, pydantic_core,
#   annotated-types, typing-inspection) in .whl/ (carried with the tree); this script installs them
#   with --no-index into a scratch dir.  Without prefect the flow test skips ("needs prefect").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/gpu-out}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"

main() {  # the whole check; its output goes to the terminal and to $LOG
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
T0=$SECONDS
echo "== convoy gpu_check $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

PY="${PYTHON:-}"
if [ -z "$PY" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
if [ -z "$PY" ] && command -v python3 >/dev/null && python3 -c 'import torch' 2>/dev/null; then PY=python3; fi
if [ -z "$PY" ]; then
    echo "== no Python with torch: make install"
    make install || { echo "VERDICT setup: FAILED (make install)"; exit 1; }
    PY=.venv/bin/python
fi
if ! "$PY" -c 'import pydantic' 2>/dev/null && compgen -G '.whl/*.whl' >/dev/null; then
    echo "== installing the carried wheels of the repository's pins (.whl/, --no-index) into /tmp/convoy-site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/convoy-site .whl/*.whl \
        || { echo "VERDICT setup: FAILED (wheels)"; exit 1; }
    export PYTHONPATH="$PYTHONPATH:/tmp/convoy-site"
fi
"$PY" - <<'EOF' || { echo "VERDICT setup: FAILED (imports)"; exit 1; }
import sys, torch
print(f"== python {sys.version.split()[0]} ({sys.executable}); torch {torch.__version__}, CUDA build "
      f"{torch.version.cuda}, available: {torch.cuda.is_available()}")
for i in range(torch.cuda.device_count()):
    print(f"== cuda:{i} {torch.cuda.get_device_name(i)}")
import training.worker  # noqa: F401  (the repository's own imports: pydantic, yaml, ...)
EOF
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    CUDA=1
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
else
    CUDA=0
    echo "== no CUDA: the CUDA tests skip (reason in the summary) and the bench measures nothing"
fi

echo "== [1/2] CUDA tests"
timeout 330 "$PY" -m pytest -q -ra -p no:cacheprovider --junitxml="$OUT/cuda-tests.xml" \
    tests/test_device_rng.py tests/test_cuda.py 2>&1 | tee "$OUT/cuda-tests.txt"
TESTS_RC=${PIPESTATUS[0]}
SUMMARY=$(grep -E '[0-9]+ (passed|failed|skipped|errors?)\b.* in [0-9.]+s' "$OUT/cuda-tests.txt" | tail -n 1 | tr -d '=' | xargs)
echo "== tests took $((SECONDS - T0)) s (exit $TESTS_RC)"

echo "== [2/2] GPU checkpoint bench"
timeout 120 "$PY" bench/gpu.py --json "$OUT/gpu-bench.json" 2>&1 | tee "$OUT/gpu-bench.txt"
BENCH_RC=${PIPESTATUS[0]}

echo
echo "== verdicts ($((SECONDS - T0)) s in all)"
if [ "$TESTS_RC" -eq 0 ]; then T=PASSED; else T=FAILED; fi
if [ "$CUDA" -eq 1 ]; then
    echo "VERDICT CUDA tests (bitwise kill/resume fp32 + fp16 GradScaler + bf16, device RNG, CPU<->GPU, auto, flow): $T ($SUMMARY)"
    if [ "$BENCH_RC" -eq 0 ]; then
        grep '^GOAL ' "$OUT/gpu-bench.txt" | sed 's/^GOAL /VERDICT /'
    else
        echo "VERDICT GPU bench: FAILED (exit $BENCH_RC); no goal measured"
    fi
else
    echo "VERDICT CUDA tests: SKIPPED, no CUDA ($SUMMARY; CPU unit tests $T)"
    echo "VERDICT async save stall <= 1.2x raw D2H copy: NOT MEASURED (no CUDA)"
    echo "VERDICT step slowdown during a background persist <= 5 %: NOT MEASURED (no CUDA)"
fi
[ "$TESTS_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
