#!/usr/bin/env bash
# The GPU check (issue #8) in one script: on a CUDA machine whose python3 has torch and transformers, install
# specframe without dependencies, run the conformance suite for every registered proposer on CUDA in float32
# and bfloat16, and benchmark every proposer on a Spec-Bench subset against transformers' plain generate,
# assisted generation and prompt lookup (optionally the fast test suite too). Results go under $OUT
# (default runs/gpu-check): summary.txt and gpu-check.tar.gz (every report, log and the bench folder), remade
# after every phase, so a call stopped anywhere returns what it had. Exit status: 0 when no check failed
# (summary.txt's last line says whether runs were cut off by their time limit: its CUT lines).
#
# Prepare first, where pip works: scripts/gpu_prepare.sh (it says which device calls carry what).
#
#   scripts/gpu_check.sh stage   keep the carried model part in /tmp/gpu-model (the staging calls: a carried path
#                                replaces its folder, so .gpu-model holds only this call's part) and list them
#   scripts/gpu_check.sh         the conformance suite's greedy, rollback and isolation checks (77 s on the H200),
#                                then the benchmarks: at most GPU_CHECK_S (480) seconds in all
#   scripts/gpu_check.sh suite   the whole conformance suite (its sampling statistics and power checks too) and
#                                nothing else, within GPU_CHECK_S: a call of its own, as twelve processes' statistics
#                                on one GPU do not fit beside the benchmarks (docs/gpu.md)
#
# Settings (environment): GPU_CHECK_DEVICE (cuda), GPU_CHECK_LIMIT (2 questions per subtask),
# GPU_CHECK_SUBTASKS (all six), GPU_CHECK_MAX_NEW_TOKENS (128), GPU_CHECK_DTYPES ("float32 bfloat16"),
# GPU_CHECK_ARCHS ("llama"; e.g. "llama qwen2 gemma3_text": the model types of the quick checks' tiny targets,
# each about as long as llama's, so give GPU_CHECK_CONFORMANCE_S room),
# GPU_CHECK_TESTS (set: also the fast test suite), GPU_CHECK_S (480: the call's budget from its start; each phase
# ends at its own limit or at what the budget leaves it, and one left too little, under 100 s for a bench and 30 s
# for the others, is skipped and said),
# GPU_CHECK_CONFORMANCE_S (150; with `suite`, the budget), GPU_CHECK_TESTS_S (150), GPU_CHECK_BENCH_S (210),
# GPU_CHECK_BENCH_TIMED_S (120): the bench's --time-limit (no question starts after it; the report says where it
# stopped; at most the bench's own limit less 60 s), GPU_CHECK_SKIP_INSTALL; the comparison run with CUDA graphs
# off (none and union against hf, 2 questions): GPU_CHECK_EAGER_S (110), GPU_CHECK_EAGER_TIMED_S (50),
# GPU_CHECK_SKIP_EAGER. A bench stopped by its limit gets SIGINT (not SIGTERM, which would end it on the spot), so
# it keeps the turns it finished (bench.partial.json). With GPU_CHECK_DEVICE=cpu and small settings it runs here
# as a smoke test.
set -uo pipefail
cd "$(dirname "$0")/.."

NAME=gpu-check
DEVICE=${GPU_CHECK_DEVICE:-cuda}
MODE=${1:-}
case "$MODE" in
    "" | suite | stage) ;;
    *) echo "gpu_check.sh: unknown mode '$MODE' (give none, 'suite' or 'stage')" >&2; exit 2 ;;
esac
source scripts/gpu_common.sh  # (`stage` exits there; defines say, fail, left, phase_limit, archive, ...)
BUDGET=${GPU_CHECK_S:-480}
LIMIT=${GPU_CHECK_LIMIT:-2}
MAX_NEW=${GPU_CHECK_MAX_NEW_TOKENS:-128}
SUBTASKS=${GPU_CHECK_SUBTASKS:-mt_bench,translation,summarization,qa,math_reasoning,rag}
DTYPES=${GPU_CHECK_DTYPES:-float32 bfloat16}
ARCHS=${GPU_CHECK_ARCHS:-llama}  # the quick checks' tiny target types (specframe check --arch)

# --- 1. install, 2. the default target (the suite needs none: its targets are tiny random models)
install_specframe || exit 1
"${SF[@]}" plugins | tee -a "$SUMMARY"
if [ "$MODE" != suite ]; then
    # whether specframe's lean Llama forward (prefill and eager steps) gives transformers' results bit for bit
    # here: where it does not (a fused kernel, say), transformers' forward runs instead, slower and unsaid
    "$PY" - "$DEVICE" << 'PYEOF' 2>&1 | tee -a "$SUMMARY"
import sys, torch
from specframe.lean_forward import same_as_transformers
from specframe.testing.tiny import tiny_llama
for dtype in (torch.float32, torch.bfloat16):
    same = same_as_transformers(tiny_llama(vocab_size=64, hidden_size=64, device=sys.argv[1], dtype=dtype))
    print(f"lean forward, {sys.argv[1]} {dtype}: {'used (the same' if same else 'NOT used (not the same'} as transformers')")
PYEOF
    default_model
    [ "$MODEL_OK" = 1 ] || say "SKIP bench: no default model (above)"
fi
archive

# --- 3. conformance: one process per proposer and dtype, in parallel (tiny models are launch-bound). Each
# writes a line per check as it finishes, so one cut off by its time limit still reports the checks it ran.
proposers=$("${SF[@]}" plugins --json | "$PY" -c "import json,sys; print(' '.join(r['name'] for r in json.load(sys.stdin)['proposers']))")
conformance() {  # conformance <folder in $WORK> <seconds> <what, for the summary> <--quick, or "" for the whole suite>
    local dir=$WORK/$1 seconds=$2 what=$3 quick=$4 p t i a mode pids=() runs=() archs=()
    mkdir -p "$dir"
    if [ -n "$quick" ]; then for a in $ARCHS; do archs+=(--arch "$a"); done; fi  # (the whole suite: llama)
    for p in $proposers; do
        for t in $DTYPES; do
            mode=$quick
            [ -z "$quick" ] && [ "$p" != none ] && mode=--no-power  # (the power checks test the suite itself: once)
            OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 timeout -k 10 "$seconds" "${SF[@]}" check --proposer "$p" \
                --device "$DEVICE" --dtype "$t" $mode ${archs[@]+"${archs[@]}"} > "$dir/$p-$t.txt" 2> "$dir/$p-$t.err" &
            pids+=($!)
            runs+=("$p-$t")
        done
    done
    for i in "${!pids[@]}"; do  # each one's exit status beside its report (124: stopped by its time limit)
        wait "${pids[$i]}"
        echo $? > "$dir/${runs[$i]}.rc"
    done
    "$PY" - "$dir" "$what" "$seconds" << 'EOF' 2>&1 | tee -a "$SUMMARY"
import pathlib, re, sys
folder, what, seconds = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
for f in sorted(folder.glob("*.txt")):
    lines = f.read_text().splitlines()
    checks = [line.strip() for line in lines if re.match(r"\s+(PASS|FAIL)\s", line)]
    failed = [c for c in checks if c.startswith("FAIL")]
    finished = bool(lines) and re.match(r"\d+ passed, \d+ failed( \(|$)", lines[-1].strip()) is not None
    err = f.with_suffix(".err").read_text().strip().splitlines()
    rc = f.with_suffix(".rc").read_text().strip()
    cut = not finished and rc in ("124", "137")  # (stopped by its time limit: CUT, unless a check failed)
    why = f"cut off by its {seconds} s time limit" if cut else f"exit {rc}: {err[-1] if err else 'no message'}"
    stopped = "" if finished else f", then stopped ({why})"
    status = "FAIL" if failed or not (finished or cut) or not checks else "CUT" if cut else "PASS"  # (0 run: FAIL)
    said = r"verification forwards as CUDA graphs|CUDA graphs off: [^;]*?(?=;| \([\d.]+s\)|$)"  # (the greedy check's)
    graphs = sorted({m.group(0) for c in checks for m in [re.search(said, c)] if m})
    graphs = f" ({'; '.join(graphs)})" if graphs else ""
    print(f"{status} conformance ({what}) {f.stem}: {len(checks) - len(failed)}/{len(checks)} checks passed{stopped}{graphs}")
    for c in failed if finished else checks:  # (an unfinished run: every check it got through)
        print(f"    {c}")
EOF
    grep -q "^FAIL" "$SUMMARY" && FAILED=1
    grep -q "^CUT" "$SUMMARY" && FINISHED_OK=$INCOMPLETE
    say "[$(elapsed)] conformance ($what) done"
    archive
}
if [ "$MODE" = suite ]; then
    seconds=$(phase_limit "${GPU_CHECK_CONFORMANCE_S:-100000}" "$BUDGET")
    enough "$seconds" "conformance (whole suite)" 30 && conformance suite "$seconds" "whole suite" ""
    exit "$FAILED"
fi
seconds=$(phase_limit "${GPU_CHECK_CONFORMANCE_S:-150}" "$BUDGET")
if enough "$seconds" "conformance (greedy, rollback, isolation)" 30; then
    conformance check "$seconds" "greedy, rollback, isolation" --quick
fi

# --- 4. optionally the fast test suite there (the tests parametrized over devices also run on CUDA)
if [ -n "${GPU_CHECK_TESTS:-}" ]; then
    parallel=()
    "$PY" -c "import xdist" 2> /dev/null && parallel=(-n 8)  # pytest-xdist is in the GPU image
    seconds=$(phase_limit "${GPU_CHECK_TESTS_S:-150}" "$BUDGET")
    if enough "$seconds" "pytest (fast suite)" 30; then
        timeout -k 10 "$seconds" "$PY" -m pytest -q -m "not slow" -p no:cacheprovider ${parallel[@]+"${parallel[@]}"} \
            tests > "$WORK/pytest.log" 2>&1 || { rc=$?; fail "pytest ($(why "$rc" "$seconds"))"; }
        say "pytest (fast suite): $(tail -1 "$WORK/pytest.log")"
        archive
    fi
fi

# --- 5. Spec-Bench subsets. bench <folder in $WORK> <seconds> <timed seconds> <bench options...>; at its limit it
# gets SIGINT and keeps the turns it finished in bench.partial.json; its rows go into the summary.
bench() {
    local name=$1 seconds=$2 timed=$3 rc mark
    shift 3
    mark=$(wc -l < "$LOG")  # (its own lines of the log, for its error: not an earlier phase's)
    [ "$timed" -gt $((seconds - 60)) ] && timed=$((seconds - 60))  # (loading, building, and a question that overruns)
    timeout -s INT -k 20 "$seconds" "${SF[@]}" bench --max-new-tokens "$MAX_NEW" --device "$DEVICE" \
        --questions "$questions" --out "$WORK/$name" --results-doc "$WORK/$name/results.md" --time-limit "$timed" \
        --no-progress "$@" >> "$LOG" 2>&1
    rc=$?
    if cut_off "$rc"; then  # (as a cut conformance run: said, not a failure of what it ran)
        local kept="nothing finished"
        [ -f "$WORK/$name/bench.partial.json" ] && kept="the turns it finished are in $name/bench.partial.json"
        say "CUT $name ($(why "$rc" "$seconds")): no report; $kept"
    elif [ "$rc" != 0 ]; then
        fail "$name ($(why "$rc" "$seconds")): $(tail -n +$((mark + 1)) "$LOG" | tail -2)"
    fi
    if [ -f "$WORK/$name/results.md" ]; then
        awk '/^## Speed/ {f = 1; next} /^## / {f = 0} f && /^\| (subtask|overall) /' "$WORK/$name/results.md" \
            | tee -a "$SUMMARY"
        grep -o "verification forwards as CUDA graphs\|CUDA graphs off: [^|]*" "$WORK/$name/results.md" | sort \
            | uniq -c | sed 's/^/    methods: /' | tee -a "$SUMMARY"
    fi
    archive
}
if [ "$MODEL_OK" = 1 ]; then
    questions=.gpu-data/question.jsonl
    [ -f "$questions" ] || questions=../shared/data/spec_bench/question.jsonl
    if [ ! -f "$questions" ]; then
        say "SKIP benches: no Spec-Bench questions (.gpu-data/question.jsonl: see scripts/gpu_prepare.sh)"
        MODEL_OK=0
    fi
fi
if [ "$MODEL_OK" = 1 ]; then
    methods=none
    for p in $proposers; do [ "$p" != none ] && methods="$methods,$p"; done
    # every proposer against transformers' plain, assisted and prompt-lookup generate
    seconds=$(phase_limit "${GPU_CHECK_BENCH_S:-210}" "$BUDGET")
    if enough "$seconds" bench 100; then
        bench bench "$seconds" "${GPU_CHECK_BENCH_TIMED_S:-120}" --proposers "$methods" \
            --baselines hf,hf-assisted,hf-pld --limit "$LIMIT" --subtasks "$SUBTASKS"
    fi
    # --- 6. what the CUDA graphs gave: plain decoding and union again with the eager forwards, against hf in the
    # same (shorter) run: one question each of mt_bench and translation (docs/gpu.md, step 5)
    seconds=$(phase_limit "${GPU_CHECK_EAGER_S:-110}" "$BUDGET")
    if [ -z "${GPU_CHECK_SKIP_EAGER:-}" ] && enough "$seconds" "bench with target.cuda_graphs=false" 100; then
        say "eager forwards (target.cuda_graphs=false):"
        bench bench-eager "$seconds" "${GPU_CHECK_EAGER_TIMED_S:-50}" --proposers none,union --baselines hf \
            --limit 1 --subtasks mt_bench,translation target.cuda_graphs=false
    fi
fi
[ "$FAILED" = 0 ]
