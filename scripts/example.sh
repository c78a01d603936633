#!/usr/bin/env bash
# Sets up .venv (if missing) with the package and onnxruntime, then runs the fixture example.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[ort]'
exec .venv/bin/python examples/run_fixture.py "$@"
