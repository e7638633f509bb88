#!/usr/bin/env bash
# The test command: a fresh machine needs nothing but python3 (>= 3.10) and this script.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" test
exec python -m pytest "$@"
