#!/usr/bin/env bash
# go-libp2p's daemon (p2pd, go-libp2p v0.32.1) and its control protocol's Python bindings, taken
# from the PyPI wheel of hivemind 1.1.12 (x86_64). Idempotent; everything lands in interop/go/bin.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-.venv/bin/python}
case "$PY" in /*) ;; *) PY="$PWD/../../$PY" ;; esac
if [ -x bin/p2pd ] && [ -f bin/p2pd_pb2.py ]; then exit 0; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download --quiet --no-deps --only-binary=:all: hivemind==1.1.12 -d "$tmp"
mkdir -p bin
"$PY" - "$tmp" <<'PYEOF'
import glob, os, sys, zipfile
wheel = glob.glob(os.path.join(sys.argv[1], "hivemind-1.1.12-*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    for name in ("hivemind/hivemind_cli/p2pd", "hivemind/proto/p2pd_pb2.py", "hivemind/proto/p2pd.proto"):
        with open(os.path.join("bin", os.path.basename(name)), "wb") as out:
            out.write(z.read(name))
PYEOF
chmod +x bin/p2pd
echo "p2pd ready: interop/go/bin/p2pd"
