"""Receipt commands: check a run receipt offline (verify), ask peers for theirs (receipts)."""

from __future__ import annotations

import json
from pathlib import Path

import click
import trio

from shardnet.transport.errors import ShardnetError

from .common import fail, log, network_options, run, say, visiting, visitor_config, wrap_errors


@click.command()
@click.argument("receipt", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--manifest", type=click.Path(exists=True, path_type=Path), default=None,
              help="The model's manifest (`shardnet model manifest` output) or its checkpoint directory.")
@click.option("--recompute", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="A local copy of the model: recompute the output. Greedy runs are checked teacher-forced "
                   "(one forward pass over prompt + output): each token's logit must be within the dtype's "
                   "tolerance of the best; the smallest margin is reported.")
@click.option("--exact", is_flag=True,
              help="With --recompute: regenerate the text and require the very same tokens (no tolerance).")
@click.option("--prompt", default=None, help="The prompt text, when the receipt does not carry its tokens.")
@wrap_errors
def verify(receipt: Path, manifest: Path | None, recompute: Path | None, exact: bool, prompt: str | None) -> None:
    """Check a run receipt offline: signatures, layer tiling, hash chains linking every stage,
    the output hash, the model ID; optionally recompute the output. One line per check; exit 0
    only if every check passes."""
    from shardnet.protocols import receipts as rc

    if exact and recompute is None:
        fail("--exact compares recomputed tokens: give --recompute MODEL_DIR too", 2)
    try:
        doc = json.loads(receipt.read_text())
    except (OSError, json.JSONDecodeError) as e:
        fail(f"{receipt} is not a JSON receipt: {e}")
    model_id = None
    if manifest is not None:
        from shardnet.inference.model.checkpoint import Checkpoint, model_id_of

        if manifest.is_dir():
            model_id = Checkpoint(manifest).model_id
        else:  # `shardnet model manifest --json` output, or a bare manifest: the ID is recomputed from it
            m = json.loads(manifest.read_text())
            model_id = model_id_of(m["manifest"] if isinstance(m, dict) and "manifest" in m else m)
    checks = rc.verify_run(doc, manifest_model_id=model_id)
    if recompute is not None and all(c.ok for c in checks):
        from shardnet.inference.client.recompute import recompute_check

        checks.append(recompute_check(doc, recompute, prompt, exact=exact))
    for c in checks:
        say(f"{'ok  ' if c.ok else 'FAIL'}  {c.name}: {c.detail}")
    bad = [c for c in checks if not c.ok]
    if bad:
        fail(f"receipt does not verify: {bad[0].name}")
    say(f"receipt verifies: {len(checks)} checks passed")


@click.command()
@network_options("/ip4/0.0.0.0/tcp/0")
@click.option("--peer", "peer_ids", multiple=True, help="Ask this peer (repeatable; default: every peer found).")
@click.option("--get", "get_ids", multiple=True, help="Fetch the receipt with this ID (repeatable) and print it.")
@click.option("--reports", "want_reports", is_flag=True,
              help="List the reports of peers caught computing wrong that peers heard on gossip.")
@click.option("--wait", default=3.0, show_default=True, help="Seconds to spend discovering peers.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@wrap_errors
def receipts(listen, announce, bootstrap, quic, mdns, relays, peer_ids, get_ids, want_reports, wait, as_json) -> None:
    """List the stage receipts peers keep (newest first), fetch receipts by ID, or list reports."""
    from shardnet.inference.receipt_service import request
    from shardnet.protocols import receipt_gossip as rg
    from shardnet.protocols import receipts as rc

    if not bootstrap and not mdns:
        fail("receipts needs --bootstrap MADDR (or --mdns)", 2)
    cfg = visitor_config(relays, listen, announce, bootstrap, quic, mdns)

    async def _main() -> list[dict]:
        async with visiting(cfg, wait) as n:
            targets = list(peer_ids) or [str(p) for p in n.peers()]
            out: list[dict] = []

            async def ask(peer: str) -> None:
                try:
                    if want_reports:
                        got = await request(n, peer, rg.encode_request(reports_max=rg.MAX_REPORTS_PER_RESPONSE))
                        for blob in got["reports"]:
                            try:
                                r = rg.decode_report(blob)
                            except rg.GossipError as e:
                                log.info("%s sent a bad report: %s", peer[:16], e)
                                continue
                            out.append({"id": rc.receipt_id(blob), "from": peer, "accused": r["accused"],
                                        "reporter": r["reporter"], "layers": r["layers"], "model": r["model"],
                                        "divergence": r["divergence"], "tolerance": r["tolerance"],
                                        "evidence": [x.peer for x in r["receipts"]], "t": r.get("t")})
                    elif get_ids:
                        got = await request(n, peer, rg.encode_request(get=list(get_ids)))
                        for blob in got["receipts"]:
                            r = rc.decode_stage(blob)
                            out.append({"id": rc.receipt_id(blob), "from": peer, "receipt": r.__dict__})
                    else:
                        got = await request(n, peer, rg.encode_request(list_max=rg.MAX_IDS_PER_REQUEST))
                        out.extend({**d, "from": peer} for d in got["digests"])
                except (ShardnetError, rg.GossipError, rc.ReceiptError, trio.TooSlowError) as e:
                    log.info("%s: %s", peer[:16], e)

            async with trio.open_nursery() as nursery:
                for p in targets:
                    nursery.start_soon(ask, p)
            return out

    found = run(_main) or []
    if get_ids:
        missing = set(get_ids) - {f["id"] for f in found}
        say(json.dumps({f["id"]: f["receipt"] for f in found}, indent=1))
        if missing:
            fail(f"not found: {', '.join(sorted(missing))}")
        return
    if want_reports:
        found = list({f["id"]: f for f in found}.values())  # the same report, heard by several peers
    if as_json:
        say(json.dumps(found, indent=1))
        return
    if want_reports:
        say(f"{len(found)} report(s)")
        for r in found:
            say(f"{r['id'][:16]}…  accused {r['accused'][:16]}…  layers {r['layers'][0]}:{r['layers'][1]}  "
                 f"off by {r['divergence']:.3g} (tolerance {r['tolerance']:.2g})  by {r['reporter'][:16]}…  "
                 f"{len(r['evidence'])} signed receipt(s)")
        return
    say(f"{len(found)} receipt(s)")
    for d in found:
        place = "".join(f"  {k} {d[k]}" for k in ("region", "gpu_uuid") if d.get(k))
        say(f"{d['id'][:16]}…  peer {d['peer'][:16]}…  layers {d['layers'][0]}:{d['layers'][1]}  "
             f"steps {d['steps']}  session {d['session'][:8]}…{place}")
