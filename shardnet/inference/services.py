"""The inference layer's node-wide services, assembled in one place (``InferenceServices``).

Some of what inference keeps belongs to the node, not to one client or compute peer: the round-trip
probes (one probe per peer at a time, whoever asks), the line for session slots at a first hop,
the KV this node's open sessions hold at each peer, the clients' activity counters, and the metrics
registry that reports them. A gateway runs several ``Client``s on one node, and a compute peer's
node may run a client too: they must all see the same ones. ``inference_services(node)`` makes
them once per node and keeps them in the node's one slot for them (``Node.inference``; transport
never reads it). ``Client`` and ``ComputePeer`` take them once, when they are built, and hand each
part explicitly to what needs it: the route planner gets the probes and the own load, sessions the
slots (through ``RequestContext``), healing the probes (through the request), the claims views the
probes, the gateway's dashboard the activity, ``/metrics`` the metrics.

The block endpoint is not here: only a compute peer serves a block, so ``ComputePeer`` owns its
``BlockEndpoint`` and hands it to the metrics (``NodeMetrics.watch_block``).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardnet.inference.client.activity import ClientActivity
from shardnet.inference.client.own_load import OwnLoad
from shardnet.inference.client.session_slots import SessionSlots
from shardnet.inference.metrics import NodeMetrics
from shardnet.inference.probes import Probes
from shardnet.transport.node import Node


@dataclass(frozen=True)
class InferenceServices:
    """Every node-wide inference service of one node (see the module's docstring)."""

    #: round-trip probes of peers (routing, healing, the claims views)
    probes: Probes
    #: what the node's clients did (the dashboard and the metrics read it)
    activity: ClientActivity
    #: sessions the node's clients hold open per first hop, and the line for more
    session_slots: SessionSlots
    #: KV tokens the node's open sessions hold at each peer (routing adds it to the claims' load)
    own_load: OwnLoad
    #: the node's Prometheus registry
    metrics: NodeMetrics


def inference_services(node: Node) -> InferenceServices:
    """``node``'s inference services, made on the first call (every later one returns the same)."""
    found = node.inference
    if not isinstance(found, InferenceServices):
        activity = ClientActivity()
        found = node.inference = InferenceServices(
            probes=Probes(node),
            activity=activity,
            session_slots=SessionSlots(node.config.limits.sessions_out_per_peer),
            own_load=OwnLoad(),
            metrics=NodeMetrics(node, activity),
        )
    return found
