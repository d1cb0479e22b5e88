#!/usr/bin/env bash
# Creates .venv from a Python >= 3.12 interpreter (jax 0.11.2 needs it; on these machines plain
# python3 may be 3.11 while pyenv has 3.12) and installs kda with its test and plot extras.
set -euo pipefail
cd "$(dirname "$0")/.."

ok312() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }

find_python() {
  local cands=(python3.12 python3)
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | sort -rV); do
      cands=("$(pyenv root)/versions/$v/bin/python3" "${cands[@]}")
    done
  fi
  for c in "${cands[@]}" /root/.pyenv/versions/3.12*/bin/python3; do
    if ok312 "$c"; then command -v "$c" || echo "$c"; return; fi
  done
  echo "no Python >= 3.12 found (jax 0.11.2 needs it)" >&2
  return 1
}

PY="$(find_python)"
VENV="${KDA_VENV:-.venv}"
echo "using $PY ($("$PY" --version)) -> $VENV"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q -e '.[test,plot]'
