#!/usr/bin/env bash
# The whole test suite: lint, type checks, then the tests (index unit tests and real-engine
# tests on the tiny model). Extra arguments go to pytest, e.g. `bash scripts/test.sh -k index`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=.venv
[ -x "$VENV/bin/python" ] || { echo "no $VENV: run 'bash scripts/install.sh' first" >&2; exit 1; }

echo "==> ruff"
"$VENV/bin/ruff" check vllm_hpc tests examples benchmarks scripts
"$VENV/bin/ruff" format --check vllm_hpc tests examples benchmarks scripts
echo "==> mypy"
"$VENV/bin/mypy"
echo "==> pytest"
# Exit code 5 (no tests collected) is a failure too: pytest returns non-zero for it.
exec "$VENV/bin/python" -m pytest "$@"
