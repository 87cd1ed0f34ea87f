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
# GPU_CHECK_CONFORMANCE_S (180), GPU_CHECK_TESTS_S (150), GPU_CHECK_BENCH_S (210): each phase's time limit,
# GPU_CHECK_BENCH_TIMED_S (120): the bench's --time-limit (no question starts after it; the report says where it
# stopped, so a cut run still writes its results), GPU_CHECK_SKIP_INSTALL; the comparison run with CUDA graphs off
# (none and union against hf, 2 questions): GPU_CHECK_EAGER_S (110), GPU_CHECK_EAGER_TIMED_S (50), GPU_CHECK_SKIP_EAGER. With GPU_CHECK_DEVICE=cpu and small settings it runs here as a smoke test.
set -uo pipefail
cd "$(dirname "$0")/.."

NAME=gpu-check
DEVICE=${GPU_CHECK_DEVICE:-cuda}
source scripts/gpu_common.sh  # (`stage` exits there; defines say, fail, install_specframe, default_model, ...)
LIMIT=${GPU_CHECK_LIMIT:-2}
MAX_NEW=${GPU_CHECK_MAX_NEW_TOKENS:-128}
SUBTASKS=${GPU_CHECK_SUBTASKS:-mt_bench,translation,summarization,qa,math_reasoning,rag}
DTYPES=${GPU_CHECK_DTYPES:-float32 bfloat16}
mkdir -p "$WORK/check"

# --- 1. install, 2. the default target
install_specframe || exit 1
"${SF[@]}" plugins | tee -a "$SUMMARY"
default_model
[ "$MODEL_OK" = 1 ] || say "SKIP bench: no default model (above)"

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
    finished = bool(lines) and re.match(r"\d+ passed, \d+ failed( \(|$)", lines[-1].strip()) is not None
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
    timeout "${GPU_CHECK_BENCH_S:-210}" "${SF[@]}" bench --proposers "$methods" \
        --baselines hf,hf-assisted,hf-pld --limit "$LIMIT" --subtasks "$SUBTASKS" --max-new-tokens "$MAX_NEW" \
        --device "$DEVICE" --questions "$questions" --out "$WORK/bench" --results-doc "$WORK/bench/results.md" \
        --time-limit "${GPU_CHECK_BENCH_TIMED_S:-120}" --no-progress >> "$LOG" 2>&1 || fail "bench (exit $?): $(tail -2 "$LOG")"
    if [ -f "$WORK/bench/results.md" ]; then
        awk '/^## Speed/ {f = 1; next} /^## / {f = 0} f && /^\| (subtask|overall) /' "$WORK/bench/results.md" \
            | tee -a "$SUMMARY"
        grep -o "verification forwards as CUDA graphs\|CUDA graphs off: [^|]*" "$WORK/bench/results.md" | sort | uniq -c \
            | sed 's/^/    methods: /' | tee -a "$SUMMARY"
    fi
    # --- 6. what the CUDA graphs gave: plain decoding and union again with the eager forwards, against hf in the
    # same (shorter) run: one question each of mt_bench and translation (docs/gpu.md, step 5)
    if [ -z "${GPU_CHECK_SKIP_EAGER:-}" ]; then
        timeout "${GPU_CHECK_EAGER_S:-110}" "${SF[@]}" bench --proposers none,union --baselines hf \
            --limit 1 --subtasks mt_bench,translation --max-new-tokens "$MAX_NEW" --device "$DEVICE" \
            --questions "$questions" --out "$WORK/bench-eager" --results-doc "$WORK/bench-eager/results.md" \
            --time-limit "${GPU_CHECK_EAGER_TIMED_S:-50}" --no-progress target.cuda_graphs=false >> "$LOG" 2>&1 \
            || fail "bench with target.cuda_graphs=false (exit $?): $(tail -2 "$LOG")"
        if [ -f "$WORK/bench-eager/results.md" ]; then
            say "eager forwards (target.cuda_graphs=false):"
            awk '/^## Speed/ {f = 1; next} /^## / {f = 0} f && /^\| (subtask|overall) /' "$WORK/bench-eager/results.md" \
                | tee -a "$SUMMARY"
        fi
    fi
fi
[ "$FAILED" = 0 ]
