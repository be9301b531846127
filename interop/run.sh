#!/usr/bin/env bash
# The interop suite: shardnet against libp2p implementations nobody here wrote. Installs the js
# peers (npm ci) and go-libp2p's daemon (p2pd, from a PyPI wheel), runs interop/test_*.py, and writes the results matrix to docs/interop.md.
# Exit status: non-zero if any check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}

(cd interop/js && npm ci --no-audit --no-fund --loglevel=error) || { echo "interop: npm ci failed" >&2; exit 1; }
PYTHON="$PY" bash interop/go/fetch_p2pd.sh || { echo "interop: fetching p2pd failed" >&2; exit 1; }
"$PY" -m pytest interop -q -p no:cacheprovider -o addopts="" --junitxml=interop/results.xml
status=$?
"$PY" interop/matrix.py interop/results.xml docs/interop.md || status=1
echo "interop: results matrix in docs/interop.md (pytest exit $status)"
exit $status
