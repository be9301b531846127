"""Write docs/interop.md from the interop suite's JUnit XML: one row per check, one column per
foreign implementation. A cell is the test's outcome; checks not built yet say so.

    python interop/matrix.py interop/results.xml docs/interop.md
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from datetime import date
from pathlib import Path

IMPLEMENTATIONS = {
    "js": "js-libp2p 3.3.11 (Node 20, interop/js)",
    "go": "go-libp2p v0.32.1 (p2pd from hivemind 1.1.12)",
}
GO_NO_DCUTR = "not checked: DCUtR is checked against js only"
#: (check, {implementation: test id, or why it is not checked}); a missing implementation has no
#: test yet
CHECKS = [
    ("connect: shardnet dials (TCP + Noise + Yamux); identify both ways; observed address valid",
     {"js": "test_js.test_shardnet_dials_js_and_both_identify", "go": "test_go.test_shardnet_dials_go_and_both_identify"}),
    ("connect: the foreign peer dials shardnet; ping",
     {"js": "test_js.test_js_dials_shardnet_and_pings_go_both_ways", "go": "test_go.test_go_dials_shardnet"}),
    ("a shardnet activation frame echoed byte for byte, both ways",
     {"js": "test_js.test_an_activation_frame_is_echoed_byte_for_byte_both_ways",
      "go": "test_go.test_an_activation_frame_is_echoed_byte_for_byte_both_ways"}),
    ("gossipsub messages both ways", {"js": "test_js.test_gossipsub_messages_flow_both_ways",
                                      "go": "test_go.test_gossipsub_messages_flow_both_ways"}),
    ("DHT: GET_VALUE and PUT_VALUE across implementations (js: shardnet's signed records both ways; go: the "
     "foreign side fetches, and refuses shardnet's namespace); provider records both ways",
     {"js": "test_js.test_dht_values_and_provider_records_cross_implementations",
      "go": "test_go.test_dht_values_and_provider_records_cross_implementations"}),
    ("DHT: a value the foreign side puts under a binary key (/pk/<peer ID>) is stored by shardnet",
     {"go": "test_go.test_a_value_go_puts_under_a_binary_key_is_stored_by_shardnet",
      "js": "not checked: js's values in this suite are shardnet records under text keys"}),
    ("circuit relay v2: a shardnet peer reserves on the foreign relay; another dials it through (js: its "
     "128 KiB circuit limit then ends the circuit with a clear error)",
     {"js": "test_js.test_a_shardnet_peer_reserves_on_a_js_relay_and_is_dialled_through_it",
      "go": "test_go.test_a_shardnet_peer_reserves_on_a_go_relay_and_is_dialled_through_it"}),
    ("relay role: the foreign peer reserves a slot on `shardnet relay`; it is reached through the circuit "
     "50 times (js: by another js peer with js's dial API, which races and aborts duplicate circuits; go: by "
     "shardnet peers) and keeps its relay connection and slot every round",
     {"js": "test_js_relay.test_a_js_peer_reserved_on_a_shardnet_relay_is_reached_by_another_for_50_rounds",
      "go": "test_go_relay.test_a_go_peer_reserved_on_a_shardnet_relay_is_reached_for_50_rounds"}),
    ("relay role: a circuit cut at the shardnet relay's data limit ends as a reset at both ends, logged at "
     "INFO with peers, bytes and reason; the reserved peer keeps its slot",
     {"js": "test_js_relay.test_a_circuit_cut_at_the_relay_limit_ends_as_a_reset_and_is_logged[data]",
      "go": "not checked: the js check covers it (p2pd's stream bridge hides resets)"}),
    ("relay role: a circuit cut at the shardnet relay's time limit, likewise",
     {"js": "test_js_relay.test_a_circuit_cut_at_the_relay_limit_ends_as_a_reset_and_is_logged[time]",
      "go": "not checked: the js check covers it (p2pd's stream bridge hides resets)"}),
    ("DCUtR (NAT lab): shardnet, public, starts the upgrade of a relayed connection; the foreign peer, "
     "behind a cone NAT, answers and dials it directly",
     {"js": "test_js_dcutr.test_shardnet_starts_dcutr_and_js_behind_a_nat_answers", "go": GO_NO_DCUTR}),
    ("DCUtR (NAT lab): the foreign peer, public, starts; shardnet, behind a cone NAT, answers and dials "
     "from its listening port",
     {"js": "test_js_dcutr.test_js_starts_dcutr_and_shardnet_behind_a_nat_answers", "go": GO_NO_DCUTR}),
    ("DCUtR (NAT lab): both behind cone NATs, a TCP simultaneous open",
     {"js": "test_js_dcutr.test_both_behind_cone_nats", "go": GO_NO_DCUTR}),
    ("AutoNAT (NAT lab): a foreign peer with AutoNAT on stays connected to a shardnet bootstrap for 60 s "
     "(js answers AutoNAT over the connection asked on, then closes it: shardnet never asks it)",
     {"js": "test_js_autonat.test_a_js_peer_with_autonat_stays_connected_to_a_shardnet_bootstrap",
      "go": "not checked: the suite's p2pd is started without AutoNAT"}),
]
NOT_BUILT = "not built yet"


def outcomes(xml_path: Path) -> dict[str, str]:
    out = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        key = f"{case.get('classname', '').split('.')[-1]}.{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            first = (bad.get("message") or bad.text or "failed").strip().splitlines()[0]
            out[key] = f"FAIL: {first[:160]}"
        elif case.find("skipped") is not None:
            why = (case.find("skipped").get("message") or "").strip().splitlines()[0][:160]
            out[key] = f"known failure (xfail): {why}" if "xfail" in why.lower() or case.find("skipped").get(
                "type", "").endswith("xfail") else f"skipped: {why}"
        else:
            out[key] = "pass"
    return out


def render(results: dict[str, str]) -> str:
    cols = list(IMPLEMENTATIONS)
    lines = ["# Interop results", "",
             f"Regenerated by `interop/run.sh` ({date.today().isoformat()}): shardnet "
             "against libp2p implementations it does not share code with, each a separate process.", "",
             "| check | " + " | ".join(IMPLEMENTATIONS[c] for c in cols) + " |",
             "| --- | " + " | ".join("---" for _ in cols) + " |"]
    for check, tests in CHECKS:
        # a test ID, or a sentence saying why there is none
        cells = [NOT_BUILT if c not in tests else tests[c] if tests[c].startswith("not checked")
                 else results.get(tests[c], "not run") for c in cols]
        lines.append(f"| {check} | " + " | ".join(cells) + " |")
    lines += ["", "Notes (evidence for anything the other side does differently) are in "
              "[interop-notes.md](interop-notes.md).", ""]
    return "\n".join(lines)


def main() -> int:
    xml_path, out = Path(sys.argv[1]), Path(sys.argv[2])
    results = outcomes(xml_path)
    out.write_text(render(results))
    failed = [k for k, v in results.items() if v.startswith("FAIL")]
    print(f"{len(results)} checks run, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
