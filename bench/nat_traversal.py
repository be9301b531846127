"""NAT traversal in the NAT lab: time to a direct connection, hole-punch success by NAT type,
and relayed vs direct stream throughput, measured side by side in one run.

    sudo python -m bench.nat_traversal [--rounds 20] [--attempts-symmetric 20] [--mib 32] [--repeats 3] [--quick]

Needs root (network namespaces, nftables). The lab (shardnet/testing/natlab.py): a relay on the public
segment; targets a (cone NAT) and s (symmetric NAT) hold a slot at it; dialers b (cone) and
c (symmetric) connect to a target through the relay, and the target (which accepted the relayed
connection) hole-punches. One "round" is: drop the connection, reconnect through the relay,
read the target's punch outcome (up to 3 coordinated dials). Throughput: b echoes --mib MiB of
1 MiB frames (out and back, pipelined) to a over the punched connection and to r, a cone-NAT
target that does not punch, over the relay.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench._common import bench_parser  # noqa: E402
from shardnet.testing import natlab  # noqa: E402
from shardnet.testing.localswarm import ShardnetProcess, stop_processes  # noqa: E402


def start(lab, tmp: Path, procs: list, name: str, args: list[str]) -> tuple[ShardnetProcess, str, float]:
    t0 = time.monotonic()
    p = ShardnetProcess(name, ["node", "--events", "--identity", str(tmp / f"{name}.key"),
                               "--listen", "/ip4/0.0.0.0/tcp/4001", *args], workdir=tmp, prefix=lab.prefix(name))
    procs.append(p)
    ready = p.wait_event(lambda e: e.get("event") == "ready", 60)
    return p, ready["peer_id"], time.monotonic() - t0


def wait(pred, timeout: float, what: str, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(step)
    raise TimeoutError(what)


def links(p: ShardnetProcess, peer: str) -> list[dict]:
    return p.command({"cmd": "status"})["connections"].get(peer, [])


def direct(p: ShardnetProcess, peer: str) -> bool:
    return any(not c["relayed"] for c in links(p, peer))


def punch_round(dialer, dialer_id, target, target_id, circuit: str) -> dict:
    """Disconnect, reconnect through the relay, return this round's punch outcome: the target's
    (it accepted the relayed connection, so it starts the upgrade), or the dialer's if the dialer
    ran it instead (when both sides start one, only one goes on: holepunch.py's glare rule)."""
    sides = ((target, dialer_id), (dialer, target_id))

    def punches(p, peer) -> dict | None:
        return p.command({"cmd": "status"})["nat"]["hole_punches"].get(peer)

    before = [(punches(p, peer) or {}).get("at", 0) for p, peer in sides]
    dialer.command({"cmd": "disconnect", "peer": target_id})
    wait(lambda: not links(dialer, target_id) and not links(target, dialer_id), 20, "disconnect", 0.1)
    r = dialer.command({"cmd": "connect", "addr": circuit, "timeout": 20})
    if not r["ok"]:
        raise RuntimeError(f"relayed connect failed: {r}")

    def outcome():
        for (p, peer), at in zip(sides, before):
            o = punches(p, peer)
            if o and o["at"] > at:
                return o
        return None

    try:
        return wait(outcome, 60, "punch outcome", 0.2)
    except TimeoutError:
        seen = {p.name: {"punches": punches(p, peer), "connections": links(p, peer)} for p, peer in sides}
        raise TimeoutError(f"no punch outcome within 60 s on either side: {seen}") from None


def main() -> int:
    ap = bench_parser(__doc__, quick="a short run for the tests: 1 punch round per pair, 1 MiB echoed once each way")
    ap.add_argument("--rounds", type=int, default=20, help="punch rounds for the cone/cone pair")
    ap.add_argument("--attempts-symmetric", type=int, default=20,
                    help="coordinated dials to make for each pair with a symmetric NAT")
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.attempts_symmetric, args.mib, args.repeats = 1, 1, 1, 1
    why = natlab.available()
    if why:
        print(f"NAT lab unavailable: {why}", file=sys.stderr)
        return 1
    results: dict = {}
    procs: list[ShardnetProcess] = []
    with tempfile.TemporaryDirectory() as tmpdir, natlab.NatLab() as lab:
        tmp = Path(tmpdir)
        try:
            lab.add_public("relay")
            for name, nat in (("a", "cone"), ("r", "cone"), ("s", "symmetric"), ("b", "cone"), ("c", "symmetric")):
                lab.add_private(name, nat)
            relay = ShardnetProcess("relay", ["relay", "--identity", str(tmp / "relay.key"),
                                              "--listen", "/ip4/0.0.0.0/tcp/4001"], workdir=tmp,
                                    prefix=lab.prefix("relay"))
            procs.append(relay)
            rid = relay.wait_for_line(lambda s: s.startswith("relay node "), 60).split()[-1]
            relay.wait_for_line(lambda s: s.startswith("ready"), 30)
            relay_addr = f"/ip4/{lab.ip('relay')}/tcp/4001/p2p/{rid}"
            targets = {}
            for name, extra in (("a", []), ("r", ["--no-hole-punch"]), ("s", [])):
                p, pid, _ = start(lab, tmp, procs, name, ["--bootstrap", relay_addr, "--relay", relay_addr, *extra])
                wait(lambda p=p: rid in p.command({"cmd": "status"})["reservations"], 30, f"{name} slot")
                targets[name] = (p, pid, f"{relay_addr}/p2p-circuit/p2p/{pid}")

            # time to the first direct connection, from the dialer's process start
            t0 = time.monotonic()
            b, b_id, b_ready = start(lab, tmp, procs, "b", ["--bootstrap", relay_addr])
            a, a_id, a_circuit = targets["a"]
            r = b.command({"cmd": "connect", "addr": a_circuit, "timeout": 20})
            t_relayed = time.monotonic() - t0
            assert r["ok"], r
            wait(lambda: direct(b, a_id), 30, "first direct connection", 0.02)
            t_direct = time.monotonic() - t0
            # b may see the connection a moment before a (the puncher) has recorded the outcome
            first = wait(lambda: a.command({"cmd": "status"})["nat"]["hole_punches"].get(b_id), 30, "punch outcome")
            results["first_direct"] = {"process_ready_s": b_ready, "relayed_s": t_relayed, "direct_s": t_direct,
                                       "punch_s": first["seconds"], "attempts": first["attempts"]}
            print(f"first direct connection: process ready {b_ready:.2f} s, relayed {t_relayed:.2f} s, "
                  f"direct {t_direct:.2f} s after start (the punch itself: {first['seconds']:.3f} s, "
                  f"{first['attempts']} attempt(s))", flush=True)

            # throughput, relayed vs direct, same dialer, same relay, both targets behind cone NATs
            rr, r_id, r_circuit = targets["r"]
            assert b.command({"cmd": "connect", "addr": r_circuit, "timeout": 20})["ok"]
            tput = {"direct": [], "relayed": []}
            for _ in range(args.repeats):
                for kind, peer in (("direct", a_id), ("relayed", r_id)):
                    res = b.command({"cmd": "echo_bulk", "peer": peer, "mib": args.mib})
                    assert res["ok"] and res["relayed"] == (kind == "relayed"), res
                    tput[kind].append(res["mib_per_s"])
            med = {k: statistics.median(v) for k, v in tput.items()}
            results["echo_mib_per_s"] = {**med, "runs": tput, "direct_over_relayed": med["direct"] / med["relayed"]}
            print(f"echo throughput ({args.mib} MiB out and back, median of {args.repeats}): direct "
                  f"{med['direct']:.1f} MiB/s, relayed {med['relayed']:.1f} MiB/s, "
                  f"direct/relayed {med['direct'] / med['relayed']:.2f}x", flush=True)
            b.command({"cmd": "disconnect", "peer": r_id})

            # punch success by NAT type
            c, c_id, _ = start(lab, tmp, procs, "c", ["--bootstrap", relay_addr])
            s, s_id, s_circuit = targets["s"]
            pairs = [("cone -> cone", b, b_id, a, a_id, a_circuit, args.rounds, None),
                     ("symmetric -> cone", c, c_id, a, a_id, a_circuit, None, args.attempts_symmetric),
                     ("cone -> symmetric", b, b_id, s, s_id, s_circuit, None, args.attempts_symmetric),
                     ("symmetric -> symmetric", c, c_id, s, s_id, s_circuit, None, args.attempts_symmetric)]
            results["punch"] = {}
            for label, d, d_id, t, t_id, circuit, rounds, attempts_wanted in pairs:
                outcomes = []
                while (rounds is not None and len(outcomes) < rounds) or (
                        attempts_wanted is not None and sum(o["attempts"] for o in outcomes) < attempts_wanted):
                    outcomes.append(punch_round(d, d_id, t, t_id, circuit))
                ok = [o for o in outcomes if o["ok"]]
                attempts = sum(o["attempts"] for o in outcomes)
                ok_attempts = len(ok)  # a successful punch succeeds on its last attempt
                secs = [o["seconds"] for o in ok] or [0.0]
                fail_secs = [o["seconds"] for o in outcomes if not o["ok"]]
                results["punch"][label] = {
                    "punches": len(outcomes), "succeeded": len(ok), "attempts": attempts,
                    "attempt_success_rate": ok_attempts / attempts if attempts else 0.0,
                    "median_success_s": statistics.median(secs) if ok else None,
                    "median_failure_s": statistics.median(fail_secs) if fail_secs else None}
                print(f"{label:24} {len(ok)}/{len(outcomes)} punches, {ok_attempts}/{attempts} attempts succeeded"
                      + (f", median {statistics.median(secs) * 1000:.0f} ms to direct" if ok else "")
                      + (f", failure reported after a median {statistics.median(fail_secs):.1f} s" if fail_secs
                         else ""), flush=True)
        finally:
            stop_processes(procs)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
