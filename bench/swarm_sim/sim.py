"""A discrete-event simulation of a shardnet swarm: peers that join, serve, move and leave, and
requests that gateways route through them and heal around departures.

No sockets and no torch: a simulated clock, and the project's own decisions called as the
network code calls them -- placement through ``policies`` (``shardnet`` is
``shardnet.inference.server.placement``), routes through ``routing.plan_route`` with
``routing.ChainCost`` over real ``Claim`` objects, healing through ``heal_plan.plan_heal`` (as
``HealingSession`` decides it) and ``find_route(avoid=..., keep=...)``, the KV budget, queue and
step timeouts of the client and server.

``Sim`` composes three parts, each with what it models (docs/scale.md says what that leaves out):

- ``events.EventLoop``: the simulated clock, the heap of events, the tick and the samples;
- ``swarm.Swarm``: the peers (joins, leaves, churn), their placement and claims, and the DHT and
  gossip messages those cost;
- ``traffic.Traffic``: gateways, requests, their routes, sessions and KV use, and healing.

Three random streams, so that every policy meets the same world: the peers (who comes, when,
with what, for how long), the requests, and the decisions the code under test draws.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from bench.swarm_sim.events import EventLoop
from bench.swarm_sim.models import ModelSpec
from bench.swarm_sim.stats import Stats
from bench.swarm_sim.swarm import Policy, Swarm, lp_bound, placement_flow
from bench.swarm_sim.traffic import Traffic


class Sim:
    """One run: ``peers`` peers of ``model`` placed by ``policy`` for ``hours`` simulated hours,
    with requests at ``load`` times what their KV caches hold (see ``Swarm`` and ``Traffic`` for
    the other settings)."""

    def __init__(self, *, model: ModelSpec, policy: Policy, peers: int, hours: float, seed: int = 1,
                 load: float = 0.5, cohort: int | None = None, warmup_s: float = 600.0,
                 probe_order: str = "stalest", cohorts_per_s: float = 4.0, announce_loading: bool = True,
                 route_by_load: bool = True, suffix_entry: bool = False, reroute_busy: bool = False,
                 load_step: float | None = None) -> None:
        self.model, self.policy, self.target_peers = model, policy, peers
        self.warmup_s = warmup_s
        self.clock = EventLoop(hours * 3600.0)
        self.stats = Stats()
        rng = random.Random(f"{seed}/decisions")
        self.swarm = Swarm(model=model, policy=policy, target_peers=peers, clock=self.clock, stats=self.stats,
                           world_rng=random.Random(f"{seed}/peers"), rng=rng, warmup_s=warmup_s,
                           announce_loading=announce_loading, load_step=load_step)
        self.traffic = Traffic(model=model, swarm=self.swarm, clock=self.clock, stats=self.stats,
                               requests_rng=random.Random(f"{seed}/requests"), rng=rng, warmup_s=warmup_s,
                               load=load, cohort=cohort, cohorts_per_s=cohorts_per_s, probe_order=probe_order,
                               route_by_load=route_by_load, suffix_entry=suffix_entry, reroute_busy=reroute_busy)

    def run(self, progress: Callable[[float], None] | None = None) -> Stats:
        """Simulate to the end; ``progress(simulated seconds)`` is called every simulated
        ``events.PROGRESS_S``."""
        self.swarm.start()
        self.clock.run(self.tick, self.each_sample, progress)
        self.swarm.close_gaps()
        return self.stats

    def tick(self, dt: float) -> None:
        self.swarm.tick(dt)
        self.traffic.tick(dt)

    def each_sample(self) -> None:
        self.sample()
        self.policy.tick(self.swarm)

    def sample(self) -> None:
        """After the warm-up: the placement's max flow and LP bound, and what requests get."""
        now = self.clock.now
        if now < self.warmup_s:
            return
        swarm, requests = self.swarm, self.traffic.requests
        present = [p for p in swarm.peers.values() if not p.gone]
        bound = lp_bound(present, self.model.num_layers)
        flow = placement_flow(present, self.model.num_layers, suffix_entry=self.traffic.suffix_entry)
        delivered = sum(r.rate * r.cohort for r in requests if r.open and now >= r.stalled_until)
        self.stats.samples.append({"t": now, "peers": len(present), "bound": bound, "flow": flow,
                                   "delivered": delivered, "covered": min(swarm.layer_count) > 0,
                                   "routable": flow > 0,
                                   "served_min": min(swarm.layer_count), "active": sum(r.cohort for r in requests)})
