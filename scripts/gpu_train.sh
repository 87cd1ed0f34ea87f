#!/usr/bin/env bash
# More self-distilled text and the drafters retrained on it, on a lent GPU (issues #3-#5: their acceptance is
# limited by the training text, docs/eagle.md "What limits it"; 2 CPU cores write ~100 response tokens a second).
# On a CUDA machine whose python3 has torch and transformers, with specframe's own commands only:
#
#   1. `specframe data distill` on the GPU: the target's greedy response to every training prompt, then sampled
#      ones (temperature 0.7, a seed and tag per pass: s1, s2, ...) while the distillation budget lasts;
#   2. `specframe train --device cuda` for each proposer in turn (EAGLE first), continuing from the shipped
#      weights (init_from / init_heads: the same vocabulary), on all of that text; each trainer logs held-out top-1
#      before training (the shipped weights) and after each epoch, on the same held-out prompts;
#   3. under $OUT (default runs/gpu-train): summary.txt, gpu-train.tar.gz (logs and every trained folder but its
#      weights), <proposer>.safetensors (the trained weights, float16; from a trainer cut off by the budget, its
#      last finished epoch's as <proposer>.epoch<N>.safetensors), distill.jsonl.gz (the text, when under the
#      device tool's 16 MiB a file).
#
# Nothing is shipped from here: a session evaluates what came back on its CPU (specframe bench) and ships it only
# if measurably better, with its card. Prepare first, where pip works: scripts/gpu_prepare.sh (it also carries the
# training prompts in .gpu-data), and stage the model as for gpu_check.sh:
#
#   run  command="scripts/gpu_train.sh stage"   carry=[".gpu-model/part-00"]   (and part-01, part-02)
#   run  command="scripts/gpu_train.sh"         carry=[".whl", ".gpu-data", ".gpu-model/SHA256"]   timeout_s=580
#
# Settings (environment): GPU_TRAIN_S (540: the whole script's budget, in seconds from its start; a phase that
# would start with too little of it left is skipped and said), GPU_TRAIN_DISTILL_S (200: no distillation past
# this many seconds from the start), GPU_TRAIN_SAMPLED (8: sampled passes at most), GPU_TRAIN_BATCH (512 prompts
# a generate call), GPU_TRAIN_LIMIT (first N prompts; smoke tests),
# GPU_TRAIN_MAX_NEW_TOKENS (128, as the shipped data), GPU_TRAIN_PROPOSERS ("eagle medusa draft"),
# GPU_TRAIN_EPOCHS (2), GPU_TRAIN_DEVICE (cuda), GPU_TRAIN_DTYPE (bfloat16: generation; training is float32),
# GPU_SKIP_INSTALL. With GPU_TRAIN_DEVICE=cpu and small settings it runs here as a smoke test.
set -uo pipefail
cd "$(dirname "$0")/.."

NAME=gpu-train
DEVICE=${GPU_TRAIN_DEVICE:-cuda}
source scripts/gpu_common.sh  # (`stage` exits there; defines say, fail, left, install_specframe, default_model)
BUDGET=${GPU_TRAIN_S:-540}
DISTILL_S=${GPU_TRAIN_DISTILL_S:-200}
SAMPLED=${GPU_TRAIN_SAMPLED:-8}
BATCH=${GPU_TRAIN_BATCH:-512}
MAX_NEW=${GPU_TRAIN_MAX_NEW_TOKENS:-128}
EPOCHS=${GPU_TRAIN_EPOCHS:-2}
PROPOSERS=${GPU_TRAIN_PROPOSERS:-eagle medusa draft}
BIG=$(mktemp -d)  # the text and the features cache: too big for the archive
trap 'rm -rf "$BIG"; finish' EXIT  # (gpu_common.sh's finish, and the big files gone on every exit)
DATA="$BIG/distill.jsonl"
limit=()
[ -n "${GPU_TRAIN_LIMIT:-}" ] && limit=(--limit "$GPU_TRAIN_LIMIT")
prompts=.gpu-data/prompts.jsonl
[ -f "$prompts" ] || prompts=../shared/data/train_prompts/prompts.jsonl

install_specframe || exit 1
default_model
[ "$MODEL_OK" = 1 ] || { fail "no default target: nothing to distil"; exit 1; }

# --- 1. distil: greedy, then sampled passes, within the distillation budget (a pass cut short keeps every batch
# it wrote: the file is appended a batch at a time)
distill() {  # distill <tag or ""> <more options...>
    local tag=$1 seconds
    shift
    seconds=$(left "$DISTILL_S")
    if [ "$seconds" -lt 20 ]; then
        say "distil ${tag:-greedy}: skipped (the distillation budget is spent)"
        return 1
    fi
    timeout "$seconds" "${SF[@]}" data distill --prompts "$prompts" --out "$DATA" --device "$DEVICE" \
        --dtype "${GPU_TRAIN_DTYPE:-bfloat16}" --batch-size "$BATCH" --max-new-tokens "$MAX_NEW" ${limit[@]+"${limit[@]}"} \
        ${tag:+--tag "$tag"} "$@" >> "$LOG" 2>&1
    local rc=$?
    say "[$(elapsed)] distil ${tag:-greedy}: $(wc -l < "$DATA") responses in all$([ "$rc" = 124 ] && echo ' (this pass cut off by the budget)')"
    [ "$rc" = 0 ] || [ "$rc" = 124 ] || fail "distil ${tag:-greedy} (exit $rc): $(tail -2 "$LOG")"
    [ "$rc" = 0 ]
}
touch "$DATA"
if distill ""; then
    for i in $(seq 1 "$SAMPLED"); do
        distill "s$i" --temperature 0.7 --seed "$i" || break
    done
fi
"$PY" - "$DATA" << 'EOF' 2>&1 | tee -a "$SUMMARY"
import sys
from specframe.data import read_distill
rows = read_distill(sys.argv[1])
print(f"text: {len(rows)} responses to {len({r.prompt_id for r in rows})} prompts, "
      f"{sum(len(r.response_ids) for r in rows)} response tokens")
EOF
archive  # (after every phase: a call the device tool stops never runs the trap)
gzip -c "$DATA" > "$OUT/distill.jsonl.gz"
if [ "$(stat -c %s "$OUT/distill.jsonl.gz")" -gt $((16 * 1024 * 1024)) ]; then
    rm "$OUT/distill.jsonl.gz"
    say "distill.jsonl.gz left out: over the 16 MiB a file that comes back"
fi

# --- 2. train each proposer on all of it, from the shipped weights; each gets what is left but 90 s for each
# trainer after it (the first also pays for the features cache), so a slow first one does not leave the others none
after=$(echo $PROPOSERS | wc -w)
for p in $PROPOSERS; do
    after=$((after - 1))  # (trainers after this one)
    shipped=specframe/artifacts/$p-smollm2-135m-instruct
    case $p in
        eagle) opts=("init_from=$shipped" "fuse_layers=[2,15,27]" lr=3e-4 batch_size=32) ;;
        medusa) opts=("init_heads=$shipped" num_heads=4 tree_nodes=16 lr=3e-4) ;;
        draft) opts=("init_from=$shipped" layers=2 lr=3e-4 batch_size=32) ;;
        *) fail "no training recipe here for proposer $p"; continue ;;
    esac
    seconds=$(($(left "$BUDGET") - 90 * after))
    enough "$seconds" "train $p" 60 || continue
    timeout "$seconds" "${SF[@]}" train --proposer "$p" --device "$DEVICE" data="$DATA" out="$WORK/$p" \
        epochs="$EPOCHS" features_cache="$BIG/features" "${opts[@]}" > "$WORK/train-$p.log" 2>&1
    rc=$?
    grep -E "^(before training|epoch [0-9]+:)" "$WORK/train-$p.log" | sed "s/^/  $p: /" | tee -a "$SUMMARY"
    if [ "$rc" = 0 ] && [ -f "$WORK/$p/model.safetensors" ]; then
        mv "$WORK/$p/model.safetensors" "$OUT/$p.safetensors"
        say "[$(elapsed)] train $p: done ($OUT/$p.safetensors; its folder's other files in $NAME.tar.gz)"
    else
        # a run cut off keeps its last finished epoch: the checkpoint's weights (the whole one of a run killed
        # while it swapped checkpoints: `recovered`), in float16, as <proposer>.epoch<N>.safetensors; its
        # optimizer moments are left (too big to come back). The shipped artifact's config and vocabulary go with
        # them: a run from its weights (init_from / init_heads) keeps its shape and vocabulary.
        kept=$("$PY" - "$WORK/$p/checkpoint" "$OUT/$p" << 'EOF'
import json, sys
from pathlib import Path
from safetensors.torch import load_file
from specframe.fingerprint import save_weights
from specframe.training.common import recovered
folder, stem = recovered(Path(sys.argv[1])), sys.argv[2]
if (folder / "state.json").is_file():
    epoch = json.loads((folder / "state.json").read_text())["epoch"]
    weights = {k: v.half().contiguous() for k, v in load_file(folder / "model.safetensors").items()}
    save_weights(weights, f"{stem}.epoch{epoch}.safetensors")
    print(f"; epoch {epoch}'s weights kept as {stem}.epoch{epoch}.safetensors")
EOF
        )
        fail "train $p ($(why "$rc" "$seconds")): $(tail -1 "$WORK/train-$p.log")$kept"
    fi
    rm -rf "$WORK/$p/checkpoint" "$WORK/$p/checkpoint.tmp" "$WORK/$p/checkpoint.old"  # (not for the archive)
    archive
done
[ "$FAILED" = 0 ]
