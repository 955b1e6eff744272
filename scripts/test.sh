#!/usr/bin/env bash
# The README's test command: set up (idempotent, see scripts/setup.sh), then run the default test suite.
#   bash scripts/test.sh                 # everything but @pytest.mark.slow
#   bash scripts/test.sh -m slow         # the long runs, by hand
#   bash scripts/test.sh tests/test_gateway.py -k ttl
# Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -rs --durations=15 "$@"
