"""Honest-compute checks without a network: the sampling schedule's bound, the comparison and its
tolerances, which tokens a trusted pass withdraws, the reputation table, and the gossip report
codec (signed, evidence checked, bad input named)."""

import math
import random

import cbor2
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.peer.id import ID

from shardnet.inference.client.audit import AuditSchedule, divergence, tolerance
from shardnet.inference.client.decode import Token, _first_wrong
from shardnet.inference.client.reputation import MAX_REPORTED_FACTOR, Reputation
from shardnet.inference.client.sampling import Randomness, SamplingParams
from shardnet.protocols import receipt_gossip as rg
from shardnet.protocols import receipts as rc
from shardnet.transport import identity

MODEL = "ab" * 32


def pid(key) -> str:
    return str(ID.from_pubkey(key.public_key))


# -- schedule --------------------------------------------------------------------------------------

@pytest.mark.parametrize("rate", [0.1, 0.25, 0.05, 1.0])
def test_the_schedule_samples_exactly_one_step_per_window_at_varying_places(rate):
    s = AuditSchedule(rate, random.Random(1))
    picks = [i for i in range(200 * s.window) if s.sample()]
    assert len(picks) == 200
    # one per window: a peer that always cheats is checked at least once every window
    assert [p // s.window for p in picks] == list(range(200))
    if s.window > 1:
        assert len({p % s.window for p in picks}) > 1  # not a predictable place


def test_rate_zero_samples_nothing_and_bad_rates_are_refused():
    s = AuditSchedule(0.0)
    assert not any(s.sample() for _ in range(100))
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError):
            AuditSchedule(bad)


# -- comparison ------------------------------------------------------------------------------------

def test_divergence_measures_relative_difference_and_rejects_garbage():
    x = torch.randn(1, 5, 64)
    assert divergence(x, x) == 0
    assert divergence(x * 1.02, x) == pytest.approx(0.02, rel=1e-3)
    assert divergence(x[:, :4], x) == math.inf
    bad = x.clone()
    bad[0, 0, 0] = float("nan")
    assert divergence(bad, x) == math.inf
    assert divergence(x.to(torch.bfloat16), x) < tolerance("bfloat16")


def test_tolerance_is_the_widest_of_the_dtypes_involved():
    assert tolerance("float32") == 1e-3
    assert tolerance("float32", "bfloat16") == tolerance("bfloat16") > tolerance("float16")
    assert tolerance("int8q", "float32") > tolerance("bfloat16")
    assert tolerance("float32", "unknown") == tolerance("bfloat16")  # an unknown peer is not trusted to be exact


# -- which tokens a trusted pass withdraws -------------------------------------------------------

def rows_for(tokens: list[int], vocab: int = 11) -> torch.Tensor:
    logits = torch.zeros(len(tokens), vocab)
    for i, t in enumerate(tokens):
        logits[i, t] = 5.0
    return logits


def test_greedy_tokens_stand_until_the_first_the_trusted_logits_disagree_with():
    greedy, rng = SamplingParams(), Randomness(0)
    trusted = [3, 4, 5, 6, 7]  # rows: tokens 0..3 of the output, and the next one
    assert _first_wrong([3, 4, 5, 6], rows_for(trusted), greedy, rng, 10) == (4, 7)
    assert _first_wrong([3, 4, 9, 9], rows_for(trusted), greedy, rng, 10) == (2, 5)
    assert _first_wrong([], rows_for([2]), greedy, rng, 10) == (0, 2)


def test_sampled_tokens_are_rechecked_with_the_same_keyed_randomness():
    params, rng = SamplingParams(temperature=1.0, top_k=2), Randomness(42)
    rows = torch.randn(6, 11)
    from shardnet.inference.client.sampling import next_token

    honest = [next_token(rows[i], params, rng, 20 + i) for i in range(5)]
    assert _first_wrong(honest, rows, params, rng, 20)[0] == 5
    impossible = [int(rows[2].argsort()[0])]  # outside the top 2: can never be sampled
    wrong = honest[:2] + impossible + honest[3:]
    assert _first_wrong(wrong, rows, params, rng, 20) == (2, honest[2])
    # tokens accepted from chunks with drafts were decided with the draft's distribution: only
    # impossible ones go; the others are held to the target's own rule
    drafted = set(range(5))
    assert _first_wrong(wrong, rows, params, rng, 20, drafted)[0] == 2
    assert _first_wrong(honest, rows, params, rng, 20, drafted)[0] == 5
    other = next(t for t in range(11) if t != honest[1] and rows[1, t] >= rows[1].topk(2).values[-1])
    unlucky = honest[:1] + [other] + honest[2:]  # possible, but not what the keyed draw gives
    assert _first_wrong(unlucky, rows, params, rng, 20, {1})[0] == 5
    assert _first_wrong(unlucky, rows, params, rng, 20, {0, 2, 3})[0] == 1


def test_a_retraction_rewrites_the_received_ids():
    ids = [1, 2, 3, 4]
    Token(9, "x", retracted=2).apply(ids)
    assert ids == [1, 2, 9]
    Token(None, "", retracted=1).apply(ids)
    assert ids == [1, 2]


# -- reputation --------------------------------------------------------------------------------------

def test_convicted_peers_are_excluded_and_reported_ones_only_cost_more():
    rep = Reputation()
    rep.passed("a", "b")
    rep.dispute("b", "c")
    rep.convict("c", {"layers": [4, 8]})
    assert rep.excluded() == {"c"}
    assert rep.cost_factor("a") == 1.0
    for i in range(10):
        rep.note_report({"accused": "a", "reporter": f"r{i}", "layers": [0, 4], "divergence": 0.5})
        if i == 0:
            assert rep.cost_factor("a") == 2.0
    assert rep.cost_factor("a") == MAX_REPORTED_FACTOR
    assert "a" not in rep.excluded()  # others' word alone never excludes
    j = rep.to_json()
    assert j["c"]["excluded"] and j["b"]["disputes"] == 1 and len(j["a"]["reported_by"]) == 10


# -- reports ---------------------------------------------------------------------------------------

def stage(key, session="11" * 16, layers=(4, 8), model=MODEL) -> bytes:
    r = rc.StageReceipt(model=model, session=session, layers=list(layers), in_chain=rc.ZERO, out_chain=rc.ZERO,
                        steps_in=3, steps_out=3, t_start=1.0, t_end=2.0, peer=pid(key), observed={},
                        device={"kind": "cpu"}, version="0", tokens=None)
    return rc.encode_stage(key, r)


def report_body(reporter, accused, witness, evidence):
    return {"schema": 1, "model": MODEL, "accused": pid(accused), "reporter": pid(reporter), "layers": [4, 8],
            "session": "11" * 16, "step_pos": 12, "divergence": 0.3, "tolerance": 0.001,
            "witnesses": [{"peer": pid(witness), "session": "22" * 16, "divergence": 0.3}],
            "evidence": evidence, "t": 5.0}


@pytest.fixture
def keys():
    return identity.generate(), identity.generate(), identity.generate()  # reporter, accused, witness


def test_a_report_round_trips_with_its_evidence_verified(keys):
    reporter, accused, witness = keys
    blob = rg.encode_report(reporter, report_body(reporter, accused, witness,
                                                  [stage(accused), stage(witness, "22" * 16)]))
    got = rg.decode_report(blob)
    assert got["accused"] == pid(accused) and {r.peer for r in got["receipts"]} == {pid(accused), pid(witness)}


@pytest.mark.parametrize("problem", ["tampered", "wrong signer", "self accusation", "stranger's receipt",
                                     "other model", "no witness receipt", "forged receipt", "too many receipts",
                                     "wrong types", "unknown version"])
def test_bad_reports_are_refused_naming_the_problem(keys, problem):
    reporter, accused, witness = keys
    evidence = [stage(accused), stage(witness, "22" * 16)]
    body = report_body(reporter, accused, witness, evidence)
    signer = reporter
    if problem == "wrong signer":
        signer = witness
    elif problem == "self accusation":
        body["accused"] = body["reporter"]
    elif problem == "stranger's receipt":
        body["evidence"] = [stage(identity.generate())] + evidence[1:]
    elif problem == "other model":
        body["evidence"] = [evidence[0], stage(witness, model="cd" * 32)]
    elif problem == "no witness receipt":
        body["evidence"] = evidence[:1]
    elif problem == "forged receipt":
        body["evidence"] = [evidence[0], evidence[1][:-3] + b"xyz"]
    elif problem == "too many receipts":
        body["evidence"] = evidence * 3
    elif problem == "wrong types":
        body["divergence"] = "a lot"
    if problem in ("wrong signer", "too many receipts"):
        with pytest.raises(rg.GossipError):
            rg.encode_report(signer, body)
        return
    blob = rg.encode_report(signer, body)
    if problem == "tampered":
        m = cbor2.loads(blob)
        m["body"]["accused"] = pid(witness)
        blob = cbor2.dumps(m)
    elif problem == "unknown version":
        m = cbor2.loads(blob)
        m["v"] = 9
        blob = cbor2.dumps(m)
    with pytest.raises(rg.GossipError) as e:
        rg.decode_report(blob)
    assert str(e.value)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2048))
def test_garbage_is_never_a_report(data):
    with pytest.raises(rg.GossipError):
        rg.decode_report(data)


def test_an_oversize_report_is_refused_before_parsing():
    with pytest.raises(rg.GossipError, match="exceeds"):
        rg.decode_report(b"\xa0" * (rg.MAX_REPORT_BYTES + 1))


def test_peers_serve_the_reports_they_heard_on_request(keys):
    reporter, accused, witness = keys
    blob = rg.encode_report(reporter, report_body(reporter, accused, witness,
                                                  [stage(accused), stage(witness, "22" * 16)]))
    assert rg.decode_request(rg.encode_request(reports_max=100)) == ("reports", rg.MAX_REPORTS_PER_RESPONSE)
    got = rg.decode_response(rg.encode_response(reports=[blob] * 20))
    assert got == {"reports": [blob] * rg.MAX_REPORTS_PER_RESPONSE}
    with pytest.raises(rg.GossipError):
        rg.decode_request(cbor2.dumps({"v": 1, "reports": "all"}))


def test_a_witness_serves_the_hops_span_or_covers_it_and_runs_sub_spans():
    from shardnet.inference.client.audit import covering_witnesses
    from shardnet.testing.factories import claim

    hop = claim(peer="target", start=3, end=5, sub_spans=True)
    claims = [claim(peer="same", start=3, end=5), claim(peer="wide", start=0, end=8, sub_spans=True),
              claim(peer="wide-whole", start=0, end=8), claim(peer="short", start=4, end=8, sub_spans=True),
              claim(peer="in-chain", start=3, end=5), claim(peer="int4", start=0, end=8, sub_spans=True, quant="int4"),
              claim(peer="target", start=0, end=8, sub_spans=True),
              claim(peer="loading", start=0, end=8, sub_spans=True, loading=(0, 8), tput=0.0)]
    got = covering_witnesses(claims, hop, {"target", "in-chain"})
    assert [(w.peer, w.start, w.end) for w in got] == [("same", 3, 5), ("wide", 3, 5)]
