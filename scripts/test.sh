#!/usr/bin/env bash
# The README's test command: set up (idempotent, see scripts/setup.sh), then run the default test suite.
#   bash scripts/test.sh                 # everything but @pytest.mark.slow
#   bash scripts/test.sh -m slow         # the long runs, by hand
#   bash scripts/test.sh tests/test_gateway.py -k ttl
# Extra arguments go to pytest (pytest's own options: .venv/bin/python -m pytest --help). The set-up reads
# COPE_DEVICE, COPE_ENV_SERVERS and PYTHON (bash scripts/setup.sh --help: what each does, their defaults).
case " $* " in *" -h "* | *" --help "*) exec bash "$(dirname "${BASH_SOURCE[0]}")/lib/help.sh" "${BASH_SOURCE[0]}" ;; esac
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -rs --durations=15 "$@"
