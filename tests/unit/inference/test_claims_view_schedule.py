"""When a claims view looks up next (dissemination 3, docs/protocols.md): every ``refresh_s``, the
first time after a random share of it, and before a claim the last lookup refreshed expires."""

import time

from shardnet.inference import claims_view
from shardnet.inference.claims_view import ClaimsView
from shardnet.protocols import block_claim as bc
from shardnet.testing.factories import claim as make_claim

MODEL = "m" * 64


def expiring_claim(peer: str, expires_in: float) -> bc.Claim:
    return make_claim(model=MODEL, peer=peer, expires=time.time() + expires_in, seq=1)


def view_holding(*claims: bc.Claim, refreshed: set[str]) -> ClaimsView:
    view = ClaimsView(None, MODEL, None, refresh_s=1200.0, num_layers=8)
    for c in claims:
        view._table.note(c, time.time())
    view._refreshed = refreshed
    return view


def test_a_view_looks_up_every_refresh_period_and_first_after_a_random_share_of_it():
    view = view_holding(expiring_claim("a", 3600), refreshed={"a"})
    assert view.next_lookup_in() == 1200.0
    firsts = [view.next_lookup_in(first=True) for _ in range(200)]
    assert all(0.05 * 1200 <= w <= 1200 for w in firsts)
    assert min(firsts) < 300 and max(firsts) > 900  # spread over the period, not one phase


def test_a_view_looks_up_before_a_refreshed_short_lived_claim_expires():
    # a dissemination-2 peer's claim lives 600 s and only lookups bring it refreshed
    view = view_holding(expiring_claim("old", 400), expiring_claim("new", 3000), refreshed={"old", "new"})
    assert abs(view.next_lookup_in() - (400 - claims_view.EXPIRY_MARGIN_S)) < 2
    soon = view_holding(expiring_claim("old", 20), refreshed={"old"})
    assert soon.next_lookup_in() == claims_view.MIN_EXPIRY_LOOKUP_S


def test_a_claim_the_last_lookup_did_not_refresh_does_not_bring_the_next_one_forward():
    # its peer is gone (or silent): looking again would not keep its claim, and in a churning
    # swarm such claims expire all the time
    view = view_holding(expiring_claim("gone", 100), expiring_claim("live", 3000), refreshed={"live"})
    assert view.next_lookup_in() == 1200.0


def test_only_the_second_lookup_comes_at_a_random_share_of_the_period():
    import trio
    import trio.testing

    async def main() -> list[float]:
        view = ClaimsView(None, MODEL, None, refresh_s=100.0, num_layers=8)
        at: list[float] = []

        async def lookup(timeout: float = 0.0) -> None:
            at.append(trio.current_time())

        view.lookup = lookup
        with trio.move_on_after(1000):
            await view._run()
        return at

    at = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    gaps = [b - a for a, b in zip(at, at[1:])]
    assert 5 <= gaps[0] <= 100 and all(abs(g - 100) < 1e-6 for g in gaps[1:]), gaps
