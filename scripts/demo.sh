#!/usr/bin/env bash
# The demo: 4 CPU ranks (gloo) on this machine; arguments go to the demo (--help lists them).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" demo
exec python examples/demo.py "$@"
