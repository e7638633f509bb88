# Sourced by the scripts beside it: make (once) and activate the project's virtual environment.
# torch is pinned to the CPU build 2.13.0 here (the package itself accepts a range); set
# MFSDP_VENV to reuse another environment.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MFSDP_VENV:-$root/.venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
stamp="$venv/.mfsdp-installed-$1"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  python -m pip install -q --disable-pip-version-check "torch==2.13.0"
  python -m pip install -q --disable-pip-version-check -e "$root[$1]"
  touch "$stamp"
fi
cd "$root"
