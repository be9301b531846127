"""Private swarms, as real processes: members serve and generate; a peer without the key, with
another key, or a member dialling a public node is refused, with a line saying why on both sides."""

import os
import re
import subprocess
import sys
import time

import pytest
from tokenizers import Tokenizer

from shardnet.models import default_model_path
from shardnet.testing.helpers import transformers_greedy
from shardnet.testing.localswarm import LocalSwarm
from shardnet.transport.swarm_key import SwarmKey, SwarmKeyError

pytestmark = pytest.mark.slow

PROMPT, NEW = "def fib(n):", 12


def shardnet_keyed(*args, key=None, timeout=120):
    """The shardnet command with SHARDNET_SWARM_KEY set to ``key`` (None: unset, whatever this
    environment says)."""
    env = {k: v for k, v in os.environ.items() if k != "SHARDNET_SWARM_KEY"}
    if key is not None:
        env["SHARDNET_SWARM_KEY"] = str(key)
    return subprocess.run([sys.executable, "-m", "shardnet", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def make_key(path):
    r = shardnet_keyed("swarm-key", str(path))
    assert r.returncode == 0 and "fingerprint" in r.stdout, r.stderr
    return path


def log_line(proc, pattern, timeout=10.0):
    """The first line of ``proc``'s log matching ``pattern`` (waiting up to ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [ln for ln in proc.log_path.read_text(errors="replace").splitlines() if re.search(pattern, ln)]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"{proc.name}'s log has no line matching {pattern!r}: {proc.tail_log(8)}"
        time.sleep(0.2)


def one_line_error(r):
    assert r.returncode != 0, r
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    return errors[0]


def test_private_swarm_serves_members_and_refuses_everyone_else(tmp_path):
    key, other = make_key(tmp_path / "swarm.key"), make_key(tmp_path / "other.key")
    model = default_model_path()
    with LocalSwarm(tmp_path / "private", swarm_key=key) as swarm, LocalSwarm(tmp_path / "public") as public:
        boot = swarm.start_bootstrap()
        swarm.join_spans([(0, 4), (4, 8)], "--threads", "1")

        # members: a generation through the private swarm equals plain transformers
        r = shardnet_keyed("generate", "--bootstrap", boot, "-n", str(NEW), PROMPT, key=key)
        assert r.returncode == 0, r.stderr
        text = r.stdout.partition("\n-- ")[0]
        tok = Tokenizer.from_file(str(model / "tokenizer.json"))
        want = tok.decode(tok.encode(PROMPT).ids + transformers_greedy(model, PROMPT, NEW))
        assert text == want

        # no key: refused, and each side says why
        err = one_line_error(shardnet_keyed("peers", "--bootstrap", boot, "--wait", "1"))
        assert "is in a private swarm" in err and "this node has no swarm key" in err, err
        log_line(swarm.bootstrap, r"refused a connection from 127\.0\.0\.1:\d+: it left before the swarm-key "
                                  r"handshake finished \(a peer without the swarm key\)")

        # another key: both sides name the mismatch
        err = one_line_error(shardnet_keyed("peers", "--bootstrap", boot, "--wait", "1", key=other))
        assert "holds another swarm key" in err, err
        log_line(swarm.bootstrap, r"refused 12D3KooW\S+ at 127\.0\.0\.1:\d+: it holds another swarm key "
                                  rf"\(this node's key: {SwarmKey.load(key).fingerprint}\)")

        # a member dialling a public node: refused there as a private swarm's peer
        public_boot = public.start_bootstrap()
        err = one_line_error(shardnet_keyed("ping", public_boot, "--count", "1", key=key))
        assert "refused the swarm-key handshake: it is not in this private swarm" in err, err
        log_line(public.bootstrap, r"refused a connection from 127\.0\.0\.1:\d+: it is in a private swarm .* "
                                   r"this node has no swarm key")

        # the members were never disturbed: the swarm still serves
        r = shardnet_keyed("peers", "--bootstrap", boot, "--wait", "2", "--json", key=key)
        assert r.returncode == 0, r.stderr
        assert len(__import__("json").loads(r.stdout)["peers"]) >= 2


def test_swarm_key_files(tmp_path):
    key = SwarmKey.generate()
    assert SwarmKey.parse(key.dump()) == key
    assert key.fingerprint not in key.dump() and key.secret.hex() not in repr(key)
    # go-libp2p / ipfs write base16; base64 reads too
    import base64

    b64 = f"/key/swarm/psk/1.0.0/\n/base64/\n{base64.b64encode(key.secret).decode()}\n"
    assert SwarmKey.parse(b64) == key
    for bad, why in [("", "not a swarm key file"), ("/key/swarm/psk/1.0.0/\n/base16/\nzz\n", "not valid base16"),
                     ("/key/swarm/psk/1.0.0/\n/base16/\nabcd\n", "2 bytes"),
                     ("/key/swarm/psk/1.0.0/\n/bin/\nabcd\n", "unknown key encoding")]:
        with pytest.raises(SwarmKeyError, match=why):
            SwarmKey.parse(bad)
    path = tmp_path / "k"
    key.save(path)
    assert SwarmKey.load(path) == key
    with pytest.raises(SwarmKeyError, match="already exists"):
        key.save(path)
    path.chmod(0o644)
    with pytest.raises(SwarmKeyError, match="readable by others"):
        SwarmKey.load(path)
    err = one_line_error(shardnet_keyed("node", "--swarm-key", str(path)))
    assert "readable by others" in err


def test_admission_proofs_bind_both_peers():
    from shardnet.transport.swarm_key import AdmissionError, parse_admission

    key, other = SwarmKey.generate(), SwarmKey.generate()
    a, b, c = b"peer-a", b"peer-b", b"peer-c"
    msg = key.admission_message(a, b)
    key.check_admission(msg, a, b)
    for data, sender, receiver, why in [
        (msg, b, a, "another swarm key"),  # reflected back to its sender
        (msg, a, c, "another swarm key"),  # replayed to someone else
        (msg, c, b, "another swarm key"),  # replayed by someone else
        (other.admission_message(a, b), a, b, "another swarm key"),
        (msg[:-1], a, b, "not 33"),
        (bytes([2]) + msg[1:], a, b, "version 2"),
    ]:
        with pytest.raises(AdmissionError, match=why):
            key.check_admission(data, sender, receiver)
    with pytest.raises(AdmissionError):
        parse_admission(b"")
