"""Patches to py-libp2p's gossipsub (``libp2p.pubsub``).

4. gossipsub: per-peer outbound RPC queues of 32 and subscription queues of 32, whose overflow
   is a debug line at most (a burst of 400 publishes delivered 32). Both queues are enlarged and
   every drop, outbound or inbound, is counted (``dropped_pubsub_messages()``) and logged at
   WARNING, naming whether a control message was lost.
16. blacklisting a peer (shardnet mutes peers whose gossip keeps failing validation) tears its
   stream down in a task that resets the stream and then deletes the peer with ``del``: when the
   peer's connection went away meanwhile, the dead-peer handler had already removed it, and the
   KeyError ended pubsub's task manager and the node with it (seen once under the gossip-flood
   attack of tests/system/test_hostile_peers.py). The teardown forgets the peer if it is still
   there.
22. gossipsub names a message by its sender and sequence number (seen ones are dropped for
   2 minutes), and a node's numbers started at the Unix time in *seconds*, one more per message:
   a peer restarted with its identity fewer seconds after its last start than it had published
   messages numbered its new ones like old ones, and every peer that had seen those dropped them
   (a replica restarted under load: its new claim never reached the gateway). They now start at
   the time in nanoseconds, as go-libp2p's do.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

log = logging.getLogger(__name__)

#: Subscription queue length for gossipsub topics (py-libp2p default: 32).
SUBSCRIPTION_QUEUE_SIZE = 4096
#: Outbound RPC queue length per gossipsub peer (py-libp2p default: 32).
OUTBOUND_QUEUE_SIZE = 4096

_pubsub_drops = 0


def dropped_pubsub_messages() -> int:
    """How many gossipsub messages were dropped because a subscriber's queue was full."""
    return _pubsub_drops


def enlarge_subscription_queues() -> None:
    from libp2p.pubsub import pubsub as pmod

    pmod.SUBSCRIPTION_CHANNEL_SIZE = SUBSCRIPTION_QUEUE_SIZE


def enlarge_outbound_queues() -> None:
    from libp2p.pubsub import rpc_queue as qmod

    # The default is bound at definition time, so the module constant alone changes nothing.
    defaults = list(qmod.RpcQueue.__init__.__defaults__)
    defaults[0] = OUTBOUND_QUEUE_SIZE
    qmod.RpcQueue.__init__.__defaults__ = tuple(defaults)


def _drop_rpc(peer_id: Any, rpc: Any) -> None:
    global _pubsub_drops
    _pubsub_drops += 1
    log.warning(
        "pubsub: outbound queue to %s is full (%d RPCs); dropped an RPC with %d message(s)%s "
        "(%d dropped so far)",
        peer_id, OUTBOUND_QUEUE_SIZE, len(rpc.publish),
        " and CONTROL messages" if rpc.HasField("control") else "", _pubsub_drops,
    )


# ``drop_rpc`` is imported by name into gossipsub too: each binding is its own patch.
def count_outbound_drops_in_pubsub() -> None:
    from libp2p.pubsub import pubsub as pmod

    pmod.drop_rpc = _drop_rpc


def count_outbound_drops_in_gossipsub() -> None:
    from libp2p.pubsub import gossipsub as gmod

    gmod.drop_rpc = _drop_rpc


def count_subscription_drops() -> None:
    from libp2p.pubsub import pubsub as pmod

    def notify_subscriptions(self: Any, publish_message: Any) -> None:
        global _pubsub_drops
        for topic in publish_message.topicIDs:
            if topic not in self.topic_ids:
                continue
            try:
                self.subscribed_topics_send[topic].send_nowait(publish_message)
            except trio.WouldBlock:
                _pubsub_drops += 1
                log.warning(
                    "pubsub: subscriber of %r is %d messages behind; dropped one (%d dropped so far)",
                    topic,
                    SUBSCRIPTION_QUEUE_SIZE,
                    _pubsub_drops,
                )

    pmod.Pubsub.notify_subscriptions = notify_subscriptions


def forget_blacklisted_peers_once() -> None:
    from libp2p.pubsub import pubsub as pmod

    async def _teardown_if_connected(self: Any, peer_id: Any) -> None:
        stream = self.peers.get(peer_id)
        if stream is not None:
            try:
                await stream.reset()
            except Exception:
                pass
            self.peers.pop(peer_id, None)  # the dead-peer handler may have forgotten it meanwhile
        self._forget_all_subscriptions(peer_id)

    pmod.Pubsub._teardown_if_connected = _teardown_if_connected


def number_messages_from_the_time_in_nanoseconds() -> None:
    import time

    from libp2p.pubsub import pubsub as pmod

    original = pmod.Pubsub.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.counter = time.time_ns()  # (8 bytes hold it until 2554)

    pmod.Pubsub.__init__ = __init__
