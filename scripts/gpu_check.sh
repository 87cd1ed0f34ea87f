#!/usr/bin/env bash
# The GPU check (issue #8) in one script: on a CUDA machine whose python3 has torch and transformers, install
# specframe without dependencies, run the conformance suite for every registered proposer on CUDA in float32
# and bfloat16, and benchmark every proposer on a Spec-Bench subset against transformers' plain generate,
# assisted generation and prompt lookup (optionally the fast test suite too). Results go under $OUT
# (default runs/gpu-check): summary.txt and gpu-check.tar.gz (every report, log and the bench folder),
# written even when a phase fails or the run is cut short. Exit status: 0 when every check passed.
#
# Prepare first, where pip works: scripts/gpu_prepare.sh (it says which device calls carry what).
#
#   scripts/gpu_check.sh stage     keep the carried model part in /tmp/gpu-model (the staging calls: a carried path
#                                  replaces its folder, so .gpu-model holds only this call's part) and list them
#   scripts/gpu_check.sh           the whole check
#
# Settings (environment): GPU_CHECK_DEVICE (cuda), GPU_CHECK_LIMIT (2 questions per subtask),
# GPU_CHECK_SUBTASKS (all six), GPU_CHECK_MAX_NEW_TOKENS (128), GPU_CHECK_DTYPES ("float32 bfloat16"),
# GPU_CHECK_QUICK (conformance: greedy, rollback and isolation only), GPU_CHECK_TESTS (set: also the fast test suite),
# GPU_CHECK_CONFORMANCE_S (180), GPU_CHECK_TESTS_S (150), GPU_CHECK_BENCH_S (240): each phase's time limit,
# GPU_CHECK_BENCH_TIMED_S (150): the bench's --time-limit (no question starts after it; the report says where it
# stopped, so a cut run still writes its results), GPU_CHECK_SKIP_INSTALL. With GPU_CHECK_DEVICE=cpu and small settings it runs here as a smoke test.
set -uo pipefail
cd "$(dirname "$0")/.."

STAGED=/tmp/gpu-model  # outside the repository: a warm machine keeps it from one call to the next
if [ "${1:-}" = "stage" ]; then
    mkdir -p "$STAGED" && cp .gpu-model/part-* "$STAGED"/ || exit 1
    echo "model parts staged: $(ls "$STAGED" | tr '\n' ' ')"
    exit 0
fi

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
FAILED=0
START=$(date +%s)
say() { echo "$*" | tee -a "$SUMMARY"; }
fail() { say "FAIL $*"; FAILED=1; }
elapsed() { echo "$(($(date +%s) - START))s"; }
finish() {  # always: the archive of everything so far (no file over the device tool's 16 MiB)
    rm -f "$WORK/model.gguf"
    say "[$(elapsed)] finished: $([ "$FAILED" = 0 ] && echo 'every check passed' || echo 'FAILURES above')"
    cp "$SUMMARY" "$WORK/"
    tar -czf "$OUT/gpu-check.tar.gz" -C "$WORK" . && rm -rf "$WORK"
}
trap finish EXIT

# --- 1. install (no network there: wheels from .whl; specframe and the ngram plugin without dependencies)
if [ -z "${GPU_CHECK_SKIP_INSTALL:-}" ]; then
    if ls .whl/*.whl > /dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl >> "$LOG" 2>&1 || { fail "installing .whl: $(tail -3 "$LOG")"; exit 1; }
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . ./plugins/specframe-ngram \
        >> "$LOG" 2>&1 || { fail "installing specframe: $(tail -3 "$LOG")"; exit 1; }
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
SF=("$PY" -m specframe)
say "gpu-check $(date -u +%FT%TZ) on $(hostname), device $DEVICE"
"$PY" - << 'EOF' 2>&1 | tee -a "$SUMMARY"
import sys, torch, transformers, specframe
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")
if torch.cuda.is_available():
    print(f"cuda {torch.version.cuda}: {torch.cuda.get_device_name(0)}")
EOF
"${SF[@]}" plugins | tee -a "$SUMMARY"

# --- 2. the default target, from the staged GGUF parts (their sha256 checked here, again by `models pull`)
MODEL_OK=0
if "${SF[@]}" models list --json 2> /dev/null | "$PY" -c \
    "import json,sys; sys.exit(0 if any(m['alias'] == 'smollm2-135m-instruct' and m['status'] == 'cached' for m in json.load(sys.stdin)) else 1)"; then
    MODEL_OK=1
elif ls "$STAGED"/part-* > /dev/null 2>&1; then
    cat $(ls "$STAGED"/part-* | sort) > "$WORK/model.gguf"
    if [ -f .gpu-model/SHA256 ] && [ "$(sha256sum "$WORK/model.gguf" | cut -d' ' -f1)" != "$(cat .gpu-model/SHA256)" ]; then
        say "SKIP bench: the staged parts ($(ls "$STAGED" | tr '\n' ' ')) do not make the model (sha256 differs: a part missing?)"
    elif SPECFRAME_SMOLLM2_WHEEL="$WORK/model.gguf" "${SF[@]}" models pull >> "$LOG" 2>&1; then
        MODEL_OK=1
    else
        fail "the default model from the staged parts: $(tail -1 "$LOG")"
    fi
    rm -f "$WORK/model.gguf"
else
    say "SKIP bench: no default model here (stage the parts in $STAGED first, see scripts/gpu_prepare.sh)"
fi
say "[$(elapsed)] model ready: $MODEL_OK"

# --- 3. conformance: one process per proposer and dtype, in parallel (tiny models are launch-bound). Each
# writes a line per check as it finishes, so one cut off by its time limit still reports the checks it ran.
proposers=$("${SF[@]}" plugins --json | "$PY" -c "import json,sys; print(' '.join(r['name'] for r in json.load(sys.stdin)['proposers']))")
pids=()
runs=()
for p in $proposers; do
    for t in $DTYPES; do
        mode=--no-power
        [ "$p" = none ] && mode=  # the power checks test the suite itself: once per device and dtype
        [ -n "${GPU_CHECK_QUICK:-}" ] && mode=--quick
        OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 timeout "${GPU_CHECK_CONFORMANCE_S:-180}" "${SF[@]}" check \
            --proposer "$p" --device "$DEVICE" --dtype "$t" $mode > "$WORK/check/$p-$t.txt" 2> "$WORK/check/$p-$t.err" &
        pids+=($!)
        runs+=("$p-$t")
    done
done
for i in "${!pids[@]}"; do  # each one's exit status beside its report (124: stopped by its time limit)
    wait "${pids[$i]}"
    echo $? > "$WORK/check/${runs[$i]}.rc"
done
"$PY" - "$WORK/check" << 'EOF' 2>&1 | tee -a "$SUMMARY"
import pathlib, re, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.txt")):
    lines = f.read_text().splitlines()
    checks = [line.strip() for line in lines if re.match(r"\s+(PASS|FAIL)\s", line)]
    failed = [c for c in checks if c.startswith("FAIL")]
    finished = bool(lines) and re.fullmatch(r"\d+ passed, \d+ failed", lines[-1].strip()) is not None
    err = f.with_suffix(".err").read_text().strip().splitlines()
    rc = f.with_suffix(".rc").read_text().strip()
    why = "cut off by the time limit" if rc == "124" else f"exit {rc}: {err[-1] if err else 'no message'}"
    stopped = "" if finished else f", then stopped ({why})"
    print(f"{'PASS' if finished and checks and not failed else 'FAIL'} conformance {f.stem}: "
          f"{len(checks) - len(failed)}/{len(checks)} checks passed{stopped}")
    for c in failed if finished else checks:  # (an unfinished run: every check it got through)
        print(f"    {c}")
EOF
grep -q "^FAIL" "$SUMMARY" && FAILED=1
say "[$(elapsed)] conformance done"

# --- 4. optionally the fast test suite there (the tests parametrized over devices also run on CUDA)
if [ -n "${GPU_CHECK_TESTS:-}" ]; then
    parallel=()
    "$PY" -c "import xdist" 2> /dev/null && parallel=(-n 8)  # pytest-xdist is in the GPU image
    timeout "${GPU_CHECK_TESTS_S:-150}" "$PY" -m pytest -q -m "not slow" -p no:cacheprovider ${parallel[@]+"${parallel[@]}"} \
        tests > "$WORK/pytest.log" 2>&1 || fail "pytest (exit $?)"
    say "pytest (fast suite): $(tail -1 "$WORK/pytest.log")"
fi

# --- 5. Spec-Bench subset: every proposer against transformers' plain, assisted and prompt-lookup generate
if [ "$MODEL_OK" = 1 ]; then
    questions=.gpu-data/question.jsonl
    [ -f "$questions" ] || questions=../shared/data/spec_bench/question.jsonl
    methods=none
    for p in $proposers; do [ "$p" != none ] && methods="$methods,$p"; done
    timeout "${GPU_CHECK_BENCH_S:-240}" "${SF[@]}" bench --proposers "$methods" \
        --baselines hf,hf-assisted,hf-pld --limit "$LIMIT" --subtasks "$SUBTASKS" --max-new-tokens "$MAX_NEW" \
        --device "$DEVICE" --questions "$questions" --out "$WORK/bench" --results-doc "$WORK/bench/results.md" \
        --time-limit "${GPU_CHECK_BENCH_TIMED_S:-150}" --no-progress >> "$LOG" 2>&1 || fail "bench (exit $?): $(tail -2 "$LOG")"
    if [ -f "$WORK/bench/results.md" ]; then
        awk '/^## Speed/ {f = 1; next} /^## / {f = 0} f && /^\| (subtask|overall) /' "$WORK/bench/results.md" \
            | tee -a "$SUMMARY"
    fi
fi
[ "$FAILED" = 0 ]
