#!/usr/bin/env bash
# Set up shardnet in ./.venv on a fresh machine (idempotent; rerun any time).
set -euo pipefail
cd "$(dirname "$0")"

say() { printf '[setup] %s\n' "$*"; }

# System packages: py-libp2p 0.8.1 builds fastecdsa from source, which needs the GMP headers;
# the NAT lab (shardnet/testing/natlab.py, its tests) needs iproute2 and nftables.
missing=""
for pkg in libgmp-dev iproute2 nftables; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing="$missing $pkg"
done
if [ -n "$missing" ]; then
    say "installing$missing"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi

PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "error: shardnet needs Python >= 3.11 (found $("$PY" --version 2>&1))" >&2; exit 1; }

if [ ! -x .venv/bin/python ]; then
    say "creating .venv"
    "$PY" -m venv .venv
fi
say "upgrading pip"
.venv/bin/python -m pip install -q --upgrade pip

# torch first, pinned: on these machines 2.13.0 is a CPU wheel on local disk, while a bare
# requirement on an empty venv would pull a multi-GB CUDA build.
if ! .venv/bin/python -c 'import torch' >/dev/null 2>&1; then
    say "installing torch 2.13.0"
    .venv/bin/python -m pip install -q torch==2.13.0
fi
say "installing shardnet and its test dependencies"
.venv/bin/python -m pip install -q -e '.[test]'
say "ready: .venv/bin/shardnet --help"
