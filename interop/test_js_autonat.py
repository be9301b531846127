"""AutoNAT with js-libp2p: a js peer with autoNAT() stays connected to a shardnet bootstrap.

js-libp2p's AutoNAT server answers over the connection it was asked on and then closes it
(@libp2p/autonat handleAutonatMessage: openConnection without force, then connection.close()),
so a bootstrap that asked it every 15 s dropped it every 15 s. shardnet's client never asks
js-libp2p (nat/autonat.AskPolicy). js counts TEST-NET ranges as private and would refuse to dial
them (no question would ever close anything), so this runs in the NAT lab on
``natlab.GLOBAL_NET``, where both sides see public addresses and would ask each other.
"""

import time

import pytest

from foreign import ForeignError, JsPeer, js_available
from shardnet.testing import natlab
from shardnet.testing.localswarm import ShardnetProcess

pytestmark = pytest.mark.skipif(natlab.available() is not None, reason=f"NAT lab: {natlab.available()}")

HOLD = 60.0  # seconds the connection must stay up


def _start_bootstrap(lab, tmp_path):
    p = lab._track(ShardnetProcess("boot", ["bootstrap", "--identity", str(tmp_path / "boot.key"),
                                            "--listen", "/ip4/0.0.0.0/tcp/4001"],
                                   workdir=tmp_path, prefix=lab.prefix("boot")))
    bid = p.wait_for_line(lambda s: s.startswith("bootstrap node "), 60).split()[-1]
    p.wait_for_line(lambda s: s.startswith("ready"), 30)
    return p, bid, f"/ip4/{lab.ip('boot')}/tcp/4001/p2p/{bid}"


def test_a_js_peer_with_autonat_stays_connected_to_a_shardnet_bootstrap(tmp_path):
    why = js_available()
    if why:
        pytest.fail(f"js-libp2p peer unavailable: {why}")
    with natlab.NatLab(natlab.GLOBAL_NET) as lab:
        lab.add_public("boot")
        lab.add_public("js")
        boot, bid, boot_addr = _start_bootstrap(lab, tmp_path)
        js = JsPeer(tmp_path, "js", prefix=lab.prefix("js"), autonat=True,
                    listen=["/ip4/0.0.0.0/tcp/4001"])
        try:
            assert "/libp2p/autonat/1.0.0" in js.protocols, js.protocols
            js.call("dial", addr=boot_addr)
            # the bootstrap looks at js as an AutoNAT server (it has a public address to ask
            # about) and decides not to ask it
            natlab.wait_until(lambda: "not asking" in boot.log_path.read_text(errors="replace"), 30,
                              "the bootstrap's decision about js", detail=lambda: ": " + boot.tail_log(20))
            # js reports every connection it closes; none to the bootstrap may come for HOLD s
            # (a dropped connection that js re-dials at once would not show in `conns`)
            t0 = time.monotonic()
            with pytest.raises(ForeignError, match="no answer within"):
                closed = js._next(lambda e: e.get("event") == "connection_closed" and e.get("peer") == bid, HOLD)
                pytest.fail(f"js's connection to the bootstrap closed after {time.monotonic() - t0:.0f} s: "
                            f"{closed}; bootstrap: {boot.tail_log(20)}")
            assert [c for c in js.call("conns")["conns"] if c["peer"] == bid]
            assert boot.alive()
        finally:
            js.stop()
        boot_log = boot.log_path.read_text(errors="replace")
        assert "not asking" in boot_log and "js-libp2p" in boot_log, boot_log[-3000:]
