#!/usr/bin/env bash
# Sets up .venv (if missing) with the package and its test dependencies, lints, and runs the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/ruff check .
.venv/bin/ruff format --check .
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest -q -n auto "$@"
