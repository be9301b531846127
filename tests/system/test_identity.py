"""What `shardnet id` says about the identity file. The file rules alone:
tests/unit/transport/test_identity_file.py."""

import os
import subprocess
import sys


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "shardnet", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_cli_id_creates_once_and_shows_after(tmp_path):
    key = tmp_path / "cli.key"
    r1 = _cli("id", "--identity", str(key))
    r2 = _cli("id", "--identity", str(key))
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr + r2.stderr
    assert "(created)" in r1.stdout and "(existing)" in r2.stdout
    assert r1.stdout.splitlines()[0] == r2.stdout.splitlines()[0]


def test_cli_id_with_corrupt_file_fails_in_one_line(tmp_path):
    key = tmp_path / "bad.key"
    key.write_bytes(b"not a key")
    key.chmod(0o600)
    r = _cli("id", "--identity", str(key))
    assert r.returncode == 1
    err_lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert err_lines == [f"error: {key} is not a libp2p private key (corrupt file?): "
                         + err_lines[0].split("(corrupt file?): ", 1)[1]]
    assert "Traceback" not in r.stderr
