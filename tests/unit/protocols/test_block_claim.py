import dataclasses
import random
from functools import partial

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardnet.errors import NoRouteError
from shardnet.inference.client.routing import plan_route
from shardnet.protocols import block_claim as bc
from shardnet.testing import factories
from shardnet.transport import identity

KP = identity.generate()
ME = str(identity.peer_id_of(KP))
MODEL = "ab" * 32


claim = partial(factories.claim, model=MODEL, peer=ME, kv_tokens=1000, tput=12.5,
                addrs=("/ip4/127.0.0.1/tcp/1",), expires=4e9)


def test_roundtrip_and_signature():
    c = claim()
    assert bc.decode(bc.encode(KP, c)) == c
    full = dataclasses.replace(c, reach="private", load=0.25, rtts=(("12D3KooWpeer", 0.012),), dtype="bfloat16",
                               quant="int8", sub_spans=True)
    assert bc.decode(bc.encode(KP, full)) == full
    # sub_spans absent (as an older peer's claim has it) reads as whole spans only
    assert "sub_spans" not in cbor2.loads(bc.encode(KP, c))["body"] and not bc.decode(bc.encode(KP, c)).sub_spans


def test_optional_fields_are_checked():
    for bad in ({"reach": "sometimes"}, {"load": 1.5}, {"tput": float("nan")},
                {"rtts": (("p", -1.0),)}, {"rtts": (("p", "soon"),)}, {"rtts": ((7, 0.1),)},
                {"quant": "int3"}, {"dtype": "float64"}, {"sub_spans": "yes"}):
        blob = bc.encode(KP, dataclasses.replace(claim(), **bad))
        with pytest.raises(bc.ClaimError):
            bc.decode(blob)


def test_tampered_forged_and_expired_claims_are_refused():
    blob = bc.encode(KP, claim())
    m = cbor2.loads(blob)
    m["body"]["end"] = 8  # claim more layers than signed
    with pytest.raises(bc.ClaimError, match="signature"):
        bc.decode(cbor2.dumps(m))
    other = identity.generate()
    with pytest.raises(bc.ClaimError, match="signed by the peer it names"):
        bc.encode(other, claim())
    m = cbor2.loads(blob)
    m["pk"] = other.public_key.serialize()  # swap in another key: the signature no longer holds
    with pytest.raises(bc.ClaimError, match="signature"):
        bc.decode(cbor2.dumps(m))
    from dataclasses import asdict

    from shardnet.transport import envelope

    body = {**asdict(claim()), "addrs": ["/ip4/127.0.0.1/tcp/1"]}  # validly signed, by someone else
    forged = envelope.seal(other, domain=bc.SIGNING_DOMAIN, version=bc.CLAIM_VERSION, body=body,
                           max_bytes=bc.MAX_CLAIM_BYTES, error=bc.ClaimError, what="claim")
    with pytest.raises(bc.ClaimError, match="key other than its peer's"):
        bc.decode(forged)
    with pytest.raises(bc.ClaimError, match="expired"):
        bc.decode(bc.encode(KP, claim(expires=1000.0)))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=500))
def test_arbitrary_bytes_raise_only_claim_errors(blob):
    with pytest.raises(bc.ClaimError):
        bc.decode(blob)


def test_route_covers_every_layer_exactly_and_names_gaps():
    cs = [claim(start=0, end=3, peer="a"), claim(start=0, end=2, peer="b"), claim(start=3, end=6, peer="c"), claim(start=2, end=6, peer="d"),
          claim(start=6, end=8, peer="e")]
    routes = {tuple((c.start, c.end) for c in plan_route(cs, 8, rng=random.Random(seed))) for seed in range(20)}
    assert routes == {((0, 3), (3, 6), (6, 8)), ((0, 2), (2, 6), (6, 8))}  # both 3 hops: either
    with pytest.raises(NoRouteError, match=r"serves layers 6-7 \(model has 8"):
        plan_route(cs[:4], 8)
    with pytest.raises(NoRouteError, match=r"serves layer 0 "):
        plan_route([claim(start=1, end=8)], 8)
    with pytest.raises(NoRouteError, match="no chain of spans lines up"):
        plan_route([claim(start=0, end=4), claim(start=2, end=8)], 8)


def test_route_is_the_lowest_latency_chain_over_peer_to_peer_edges():
    """Dijkstra over (layer, peer): the cost of a hop depends on the peer before it."""
    cs = [claim(start=0, end=4, peer="a1"), claim(start=0, end=4, peer="b1"), claim(start=4, end=8, peer="a2"), claim(start=4, end=8, peer="b2"),
          claim(start=0, end=8, peer="slow")]
    rtt = {(None, "a1"): 0.010, (None, "b1"): 0.001, ("a1", "a2"): 0.001, ("a1", "b2"): 0.050,
           ("b1", "a2"): 0.080, ("b1", "b2"): 0.040, (None, "slow"): 0.001}
    compute = {"a1": 0.002, "b1": 0.002, "a2": 0.002, "b2": 0.002, "slow": 0.5}

    def cost(prev, c):
        return rtt[(prev.peer if prev else None, c.peer)] + compute[c.peer]

    for seed in range(10):  # b1 is the closest first hop, but a1 -> a2 is the cheapest chain
        assert [c.peer for c in plan_route(cs, 8, cost=cost, rng=random.Random(seed))] == ["a1", "a2"]
    # the return to the client counts too
    back = {"a2": 0.5, "b2": 0.0, "slow": 0.0}
    assert [c.peer for c in plan_route(cs, 8, cost=cost, finish=lambda c: back[c.peer])] == ["b1", "b2"]


def test_route_prefers_peers_reached_directly_over_relayed_ones():
    cs = [claim(start=0, end=4, peer="relayed"), claim(start=0, end=4, peer="direct"), claim(start=0, end=4, peer="unknown"), claim(start=4, end=8, peer="x")]
    cost = {"direct": 1.0, "unknown": 1.5, "relayed": 3.0, "x": 1.0}
    for seed in range(20):  # never a relayed or unknown peer while a direct one serves the same span
        route = plan_route(cs, 8, rng=random.Random(seed), cost=lambda prev, c: cost[c.peer])
        assert [c.peer for c in route] == ["direct", "x"]
    picked = {plan_route(cs, 8, rng=random.Random(s))[0].peer for s in range(40)}
    assert picked == {"relayed", "direct", "unknown"}  # equal costs: any of them, at random


def test_a_claim_names_the_span_it_is_loading():
    moving = dataclasses.replace(claim(start=0, end=4), loading=(4, 8))
    assert bc.decode(bc.encode(KP, moving)) == moving and moving.serving
    joining = dataclasses.replace(claim(start=2, end=6), loading=(2, 6))
    assert bc.decode(bc.encode(KP, joining)) == joining and not joining.serving
    # absent from a claim that loads nothing, as in claims from before the key existed
    body = cbor2.loads(bc.encode(KP, claim()))
    assert b"loading" not in cbor2.dumps(body)
    for bad in ((4, 4), (5, 2), (-1, 2)):
        with pytest.raises(bc.ClaimError, match="loading"):
            bc.decode(bc.encode(KP, dataclasses.replace(claim(), loading=bad)))


def test_routes_never_go_through_a_peer_that_is_only_loading():
    joining = dataclasses.replace(claim(start=0, end=4, peer="j"), loading=(0, 4))
    with pytest.raises(NoRouteError, match="layers 0-3"):
        plan_route([joining], 4)
    assert plan_route([joining, claim(start=0, end=4, peer="s")], 4)[0].peer == "s"


def test_a_claims_version_travels_and_old_claims_have_none():
    c = claim(seq=1_700_000_000_123)
    assert bc.decode(bc.encode(KP, c)).seq == 1_700_000_000_123
    assert "seq" not in cbor2.loads(bc.encode(KP, claim()))["body"]  # unversioned: as before the key
    for bad in (-1, True, 1 << 63):
        with pytest.raises(bc.ClaimError):
            bc.decode(bc.encode(KP, claim(seq=bad)))


def test_a_claims_signature_is_checked_once_and_its_expiry_every_time():
    blob = bc.encode(KP, claim(expires=5000.0, tput=99.0))
    before = bc.Verifications.count
    for _ in range(5):
        assert bc.decode(blob, now=1000.0).tput == 99.0
    assert bc.Verifications.count - before == 1
    with pytest.raises(bc.ClaimError, match="expired"):
        bc.decode(blob, now=6000.0)  # the cached verdict is about the signature, not the time
    m = cbor2.loads(blob)
    m["body"]["tput"] = 100.0
    with pytest.raises(bc.ClaimError, match="signature"):
        bc.decode(cbor2.dumps(m), now=1000.0)  # other bytes: checked


def test_what_is_news():
    old = claim(load=0.30, rtts=(("a", 0.020), ("b", 0.050)), seq=7)
    assert bc.news(None, old) == "first claim"
    assert bc.news(old, dataclasses.replace(old, expires=old.expires + 600, seq=8)) is None  # a refresh
    quiet = dataclasses.replace(old, load=0.36, tput=14.0, kv_tokens=900, rtts=(("b", 0.053), ("a", 0.022)))
    assert bc.news(old, quiet) is None  # the same step of load, < 25 % elsewhere, rtts' order
    assert bc.news(old, dataclasses.replace(old, start=1, end=5)) == "start"
    assert bc.news(old, dataclasses.replace(old, loading=(4, 8))) == "loading"
    assert bc.news(old, dataclasses.replace(old, addrs=("/ip4/10.0.0.1/tcp/1",))) == "addrs"
    assert bc.news(old, dataclasses.replace(old, addrs=old.addrs * 2)) is None  # the same set
    assert bc.news(old, dataclasses.replace(old, load=0.38)) == "load"  # into the next eighth
    assert bc.news(old, dataclasses.replace(old, tput=9.0)) == "tput"
    assert bc.news(old, dataclasses.replace(old, kv_tokens=700)) == "kv_tokens"
    assert bc.news(old, dataclasses.replace(old, rtts=())) == "successors"  # none left
    assert bc.news(dataclasses.replace(old, rtts=()), old) == "successors"  # measured at last
    assert bc.news(old, dataclasses.replace(old, rtts=(("c", 0.021), ("b", 0.080)))) is None  # others, as fast
    assert bc.news(old, dataclasses.replace(old, rtts=(("a", 0.035), ("b", 0.050)))) == "rtts"  # the fastest slower
    # a round trip's jitter under RTT_FLOOR_S is not news, whatever its share
    assert bc.news(old, dataclasses.replace(old, rtts=(("a", 0.024), ("b", 0.050)))) is None


def test_a_table_takes_higher_versions_and_refreshes_of_the_same_one():
    table = bc.ClaimTable(MODEL)
    v2 = claim(seq=2, expires=2000.0)
    assert table.note(v2, now=1000.0)
    assert not table.note(claim(seq=1, expires=3000.0), now=1000.0)  # an older version, however fresh
    assert table.note(claim(seq=2, expires=2600.0), now=1000.0)  # a refresh
    assert not table.note(claim(seq=2, expires=2600.0), now=1000.0)  # the same copy again
    assert table.note(claim(seq=3, expires=1500.0), now=1000.0)  # news, even expiring sooner
    assert table.get(ME).seq == 3
