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
              help="A local copy of the model: rerun the prompt and compare the tokens.")
@click.option("--prompt", default=None, help="The prompt text, when the receipt does not carry its tokens.")
@wrap_errors
def verify(receipt: Path, manifest: Path | None, recompute: Path | None, prompt: str | None) -> None:
    """Check a run receipt offline: signatures, layer tiling, hash chains linking every stage,
    the output hash, the model ID; optionally recompute the output. One line per check; exit 0
    only if every check passes."""
    from shardnet.protocols import receipts as rc

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
        checks.append(_recompute_check(doc, recompute, prompt))
    for c in checks:
        say(f"{'ok  ' if c.ok else 'FAIL'}  {c.name}: {c.detail}")
    bad = [c for c in checks if not c.ok]
    if bad:
        fail(f"receipt does not verify: {bad[0].name}")
    say(f"receipt verifies: {len(checks)} checks passed")


def _recompute_check(doc: dict, path: Path, prompt: str | None):
    from shardnet.inference.client.decode import GenerationStats, generate_on
    from shardnet.inference.client.sampling import Randomness, SamplingParams
    from shardnet.inference.client.speculative import NGramDrafter
    from shardnet.inference.model.block import Block
    from shardnet.inference.model.local_model import LocalModel
    from shardnet.inference.model.local_session import LocalSession
    from shardnet.protocols import receipts as rc

    body = doc["body"]
    model = LocalModel(path)
    if model.model_id != body["model"]:
        return rc.Check("recompute", False, f"{path} is model {model.model_id[:16]}…, the run used {body['model'][:16]}…")
    ids = model.encode(prompt) if prompt is not None else doc.get("prompt_ids")
    if ids is None:
        return rc.Check("recompute", False, "the receipt carries no prompt tokens: give --prompt")
    if rc.tokens_hash(ids) != body["prompt_sha256"]:
        return rc.Check("recompute", False, "the prompt does not match prompt_sha256")
    sampling = body["sampling"]
    params = SamplingParams(sampling["temperature"], sampling["top_p"], sampling["top_k"], body.get("seed"),
                            frequency_penalty=sampling.get("frequency_penalty", 0.0),
                            presence_penalty=sampling.get("presence_penalty", 0.0),
                            logit_bias=tuple((int(t), float(b)) for t, b in sampling.get("logit_bias", ())))
    spec = body.get("speculative")
    drafter, k, depth = None, 0, 1
    if not params.greedy and spec:  # sampled text depends on the drafting: replay it where it is deterministic
        if spec["drafter"] != "ngram":
            return rc.Check("recompute", False, "a sampled run with a draft model cannot be recomputed here")
        drafter, k, depth = NGramDrafter(), spec["k"], spec["depth"]
    want = body["output_ids"]
    block = Block(model.ckpt, 0, model.ckpt.num_layers, dtype=model.dtype)  # as the peers computed (auto)

    async def _run() -> list[int]:
        out: list[int] = []
        async for tok in generate_on(LocalSession(block), model, ids, params=params, rng=Randomness(params.seed),
                                     drafter=drafter, k=k, depth=depth, max_new=len(want), stop_at_eos=False,
                                     stats=GenerationStats()):
            out.append(tok.id)
        return out

    got = trio.run(_run)
    same = got == want
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    return rc.Check("recompute", same, f"{len(want)} tokens recomputed locally: identical" if same
                    else f"token {first} differs (local {got[first]}, receipt {want[first]})")


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
        say(f"{d['id'][:16]}…  peer {d['peer'][:16]}…  layers {d['layers'][0]}:{d['layers'][1]}  "
             f"steps {d['steps']}  session {d['session'][:8]}…")
