"""What a request through the swarm needs of the client that makes it (``RequestContext``).

Sessions (session.py), healing (healing.py), honest-compute checks (audit.py) and run receipts
(run_receipt.py) each read a few of the client's settings; they get this small frozen object
instead of the whole ``Client`` (as Petals' ``InferenceSession`` gets its sequence manager and a
length), so none of them imports client.py. Routing is the planner's: they call it directly.
What the client's node shares among its clients (the session slots; the probes, through the
planner) comes with it, handed over by the ``Client`` from the node's ``InferenceServices``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardnet.inference.client.timing import QUEUE_TIMEOUT

if TYPE_CHECKING:
    from shardnet.inference.client.reputation import Reputation
    from shardnet.inference.client.route_planner import RoutePlanner
    from shardnet.inference.client.session_slots import SessionSlots
    from shardnet.inference.model.local_model import LocalModel
    from shardnet.inference.probes import Probes
    from shardnet.transport.node import Node


@dataclass(frozen=True)
class RequestContext:
    """The node a request runs from, the model whose head it holds, the chain's settings, the
    planner that picks (and replaces) the chain's peers, and the node's session slots."""

    node: Node
    model: LocalModel
    planner: RoutePlanner
    #: the line for a session slot at a first hop (the node's, shared by all its clients)
    session_slots: SessionSlots
    #: how hidden states travel between hops (None: the model's dtype, uncompressed)
    wire: str | None = None
    #: the last peer applies the final norm and LM head and returns logits
    logits_on_last: bool = False
    #: keep what a run receipt needs (hash chains over every frame of a session)
    receipts: bool = True
    #: how long a request waits in line for a busy chain before failing "busy" (``open_session``)
    queue_timeout: float = QUEUE_TIMEOUT
    #: prefix reuse on every hop (server/prefix_store.py): None for none, "shared" for the scope
    #: every client shares (public prompts), any other scope name private to this node
    prefix: str | None = None

    @property
    def reputation(self) -> Reputation:
        """What this client saw of each peer's honesty (the planner routes by it)."""
        return self.planner.reputation

    @property
    def probes(self) -> Probes:
        """The node's round-trip probes (the planner's; healing asks them which peers still answer)."""
        return self.planner.probes
