"""Receipts without a network: stage receipts sign every field, run receipts verify offline, and
every single-field tamper, a missing stage and a reordered chain fail naming the problem."""

import base64
import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardnet.protocols import receipts as rc
from shardnet.transport import identity

MODEL = "ab" * 32
SESSION = "cd" * 16


def frames(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode() * 10 for i in range(n)]


def build_run(n_stages=3, n_layers=8, head_tokens=None, output=(5, 6, 7), salt="", device=None, **stage_extra):
    """A consistent run: client -> stages -> client, with real keys and real hash chains."""
    keys = [identity.generate() for _ in range(n_stages)]
    client_key = identity.generate()
    bounds = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    links = [rc.chain_of(frames(f"{salt}edge{i}", 4)) for i in range(n_stages + 1)]  # edge i feeds stage i
    stages = []
    for i, k in enumerate(keys):
        r = rc.StageReceipt(model=MODEL, session=SESSION, layers=[bounds[i], bounds[i + 1]], in_chain=links[i],
                            out_chain=links[i + 1], steps_in=4, steps_out=4, t_start=1.0, t_end=2.0,
                            peer=_pid(k),
                            observed={"upstream": "127.0.0.1:1", "downstream": f"10.0.0.{i + 2}:4001"},
                            device=device or {"kind": "cpu", "name": "test"},
                            version="0.0.0", tokens=head_tokens if i == n_stages - 1 else None, **stage_extra)
        stages.append(base64.b64encode(rc.encode_stage(k, r)).decode())
    body = {"schema": rc.SCHEMA, "model": MODEL, "num_layers": n_layers, "client": _pid(client_key),
            "prompt_sha256": rc.sha256_hex(b"prompt"), "output_ids": list(output),
            "output_sha256": rc.tokens_hash(list(output)), "sampling": {"temperature": 0, "top_p": 1.0, "top_k": 0},
            "seed": None,
            "sessions": [{"session": SESSION, "sent_chain": links[0], "received_chain": links[-1], "stages": stages}]}
    return rc.seal_run(client_key, body), client_key, keys


def _pid(key):
    from libp2p.peer.id import ID

    return str(ID.from_pubkey(key.public_key))


def failed(checks):
    bad = [c for c in checks if not c.ok]
    return bad[0].name if bad else None


def test_a_consistent_run_verifies():
    doc, _, _ = build_run(head_tokens=[5, 6, 7])
    checks = rc.verify_run(doc, manifest_model_id=MODEL)
    assert failed(checks) is None, checks
    names = [c.name for c in checks]
    assert "session 1 layer ranges" in names and "session 1 hash chain stage 3 -> client" in names
    assert names[-1] == "model ID"


def resign(doc, client_key, mutate):
    body = copy.deepcopy(doc["body"])
    mutate(body)
    return rc.seal_run(client_key, body)


@pytest.mark.parametrize("what,mutate,want", [
    ("run signature", lambda d: d.__setitem__("sig", "00" * 64), "run signature"),
    ("a token (not re-signed)", lambda d: d["body"]["output_ids"].__setitem__(0, 9), "run signature"),
])
def test_tampering_without_the_clients_key_breaks_the_run_signature(what, mutate, want):
    doc, _, _ = build_run()
    doc = copy.deepcopy(doc)
    mutate(doc)
    assert failed(rc.verify_run(doc)) == want


def _edit_stage(body, i, edit):
    """Change a field inside stage i's signed envelope (not re-signed: the peer's key is not ours)."""
    import cbor2

    sess = body["sessions"][0]
    env = cbor2.loads(base64.b64decode(sess["stages"][i]))
    edit(env["body"])
    sess["stages"][i] = base64.b64encode(cbor2.dumps(env)).decode()


@pytest.mark.parametrize("mutate,want", [
    (lambda b: _edit_stage(b, 1, lambda s: s.__setitem__("layers", [3, 6])), "session 1 stage 2 signature"),
    (lambda b: _edit_stage(b, 0, lambda s: s.__setitem__("out_chain", rc.ZERO)), "session 1 stage 1 signature"),
    (lambda b: b["sessions"][0].__setitem__("sent_chain", rc.ZERO), "session 1 hash chain client -> stage 1"),
    (lambda b: b["sessions"][0].__setitem__("received_chain", rc.ZERO), "session 1 hash chain stage 3 -> client"),
    (lambda b: b.__setitem__("model", "ef" * 32), "session 1 stage 1 model"),
    (lambda b: b["sessions"][0]["stages"].pop(1), "session 1 layer ranges"),
    (lambda b: b["sessions"][0]["stages"].reverse(), "session 1 layer ranges"),
    (lambda b: b.__setitem__("output_ids", [5, 6, 8]), "output hash"),
    (lambda b: b["sessions"][0].__setitem__("session", "00" * 16), "session 1 stage 1 session"),
    (lambda b: b.__setitem__("client", "12D3KooWsomeoneelse"), "client"),
])
def test_each_tamper_re_signed_by_the_client_is_named(mutate, want):
    doc, client_key, _ = build_run()
    assert failed(rc.verify_run(resign(doc, client_key, mutate))) == want


def test_swapping_two_stages_of_the_same_span_breaks_the_chain():
    # a stage receipt of another run (same session ID even) cannot be spliced in
    doc, client_key, _ = build_run()
    other, _, _ = build_run(salt="other")
    bad = resign(doc, client_key, lambda b: b["sessions"][0]["stages"].__setitem__(
        1, other["body"]["sessions"][0]["stages"][1]))
    assert failed(rc.verify_run(bad)) == "session 1 hash chain stage 1 -> stage 2"


def test_head_tokens_and_the_manifest():
    doc, client_key, _ = build_run(head_tokens=[5, 6, 7])
    lied = resign(doc, client_key, lambda b: (b.__setitem__("output_ids", [5, 6, 9]),
                                               b.__setitem__("output_sha256", rc.tokens_hash([5, 6, 9]))))
    assert failed(rc.verify_run(lied)) == "session 1 head tokens"
    assert failed(rc.verify_run(doc, manifest_model_id="ef" * 32)) == "model ID"


def test_a_stage_receipt_signed_by_another_key_is_refused():
    k1, k2 = identity.generate(), identity.generate()
    r = rc.StageReceipt(model=MODEL, session=SESSION, layers=[0, 4], in_chain=rc.ZERO, out_chain=rc.ZERO,
                        steps_in=0, steps_out=0, t_start=0, t_end=0, peer=_pid(k1), observed={}, device={},
                        version="x")
    with pytest.raises(rc.ReceiptError, match="signed by the peer it names"):
        rc.encode_stage(k2, r)
    assert rc.decode_stage(rc.encode_stage(k1, r)) == r


def test_hash_chains_depend_on_order_and_content():
    a, b = b"first", b"second"
    assert rc.chain_of([a, b]) != rc.chain_of([b, a]) != rc.chain_of([a]) != rc.ZERO
    assert rc.chain_of([]) == rc.ZERO


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_stage_receipts_raise_only_receipt_errors(blob):
    with pytest.raises(rc.ReceiptError):
        rc.decode_stage(blob)


@settings(max_examples=100, deadline=None)
@given(st.recursive(st.none() | st.integers() | st.text(max_size=8), lambda c: st.lists(c, max_size=3)
                    | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=10))
def test_garbage_run_receipts_fail_the_signature_check(doc):
    checks = rc.verify_run(doc)
    assert checks and not checks[0].ok and checks[0].name == "run signature"


# -- the facts a recomputation depends on (optional fields) ---------------------------------------

def stage_body(key, **extra) -> dict:
    body = dict(model=MODEL, session=SESSION, layers=[0, 8], in_chain=rc.ZERO, out_chain=rc.ZERO, steps_in=1,
                steps_out=1, t_start=1.0, t_end=2.0, peer=_pid(key), observed={}, device={"kind": "cpu"},
                version="0.0.0", tokens=None, schema=rc.SCHEMA)
    return body | extra


def sealed(key, body) -> bytes:
    from shardnet.transport import envelope

    return envelope.seal(key, domain=rc.STAGE_DOMAIN, version=rc.SCHEMA, body=body, max_bytes=rc.MAX_STAGE_BYTES,
                         error=rc.ReceiptError, what="stage receipt")


def test_stage_receipts_record_dtype_quant_and_batching_and_older_ones_still_decode():
    key = identity.generate()
    r = rc.decode_stage(sealed(key, stage_body(key, dtype="float16", quant="none", batched_steps=3)))
    assert (r.dtype, r.quant, r.batched_steps) == ("float16", "none", 3)
    old = rc.decode_stage(sealed(key, stage_body(key)))  # written before these fields existed
    assert (old.dtype, old.quant, old.batched_steps) == (None, None, None)
    # a newer peer's field is ignored (the signature still covers it)
    assert rc.decode_stage(sealed(key, stage_body(key, future_fact="x"))).dtype is None
    with pytest.raises(rc.ReceiptError, match="wrong types"):
        rc.decode_stage(sealed(key, stage_body(key, batched_steps="many")))


def test_stages_state_their_region_and_gpu_next_to_the_address_seen():
    doc, _, _ = build_run(region="eu-west")
    checks = rc.verify_run(doc)
    assert failed(checks) is None, checks
    place = {c.name: c.detail for c in checks if c.name.endswith(" place")}
    assert "region 'eu-west' (declared)" in place["session 1 stage 2 place"]
    assert "seen at 10.0.0.2:4001 by the stage before" in place["session 1 stage 2 place"]
    assert "first stage" in place["session 1 stage 1 place"] and "cpu test" in place["session 1 stage 1 place"]
    gpu = {"kind": "cuda", "name": "H100", "uuid": "GPU-1234"}
    assert failed(rc.verify_run(build_run(device=gpu, gpu_uuid="GPU-1234")[0])) is None
    # signed, but not consistent with the rest of what the peer signed
    assert failed(rc.verify_run(build_run(gpu_uuid="GPU-1234")[0])) == "session 1 stage 1 place"  # on a CPU
    assert failed(rc.verify_run(build_run(device=gpu, gpu_uuid="GPU-9")[0])) == "session 1 stage 1 place"
    assert failed(rc.verify_run(build_run(region="x" * 65)[0])) == "session 1 stage 1 place"
    assert failed(rc.verify_run(build_run(region="a\nb")[0])) == "session 1 stage 1 place"
    assert rc.region_problem("eu-west") is None and rc.region_problem("") is not None


def test_a_stage_receipt_with_a_device_or_addresses_of_the_wrong_shape_is_refused():
    key = identity.generate()
    for bad in (dict(device=["cuda"]), dict(observed="127.0.0.1:1"), dict(region=7)):
        with pytest.raises(rc.ReceiptError, match="wrong types"):
            rc.decode_stage(sealed(key, stage_body(key, **bad)))
