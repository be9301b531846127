"""Patches to py-libp2p's identify and mDNS (``libp2p.identity.identify``,
``libp2p.discovery.mdns``), and the accessor for the host's observed-address manager.

7. mDNS advertises the raw transport addresses, so a node listening on 0.0.0.0 tells the LAN
   to dial ``/ip4/0.0.0.0/...`` (which only works when both run on one host). It now advertises
   what the host advertises everywhere else (``get_addrs()``: per-interface or announced).
8. Identify's observed address. Once a peer has any relayed connection, py-libp2p reports a
   circuit address as that peer's observed address on *every* connection, and on a relayed one
   it has no IP part (``/p2p/<relay>/p2p-circuit/p2p/<peer>``), which other implementations
   reject and which tells the peer nothing about its NAT. A direct connection now reports its
   socket's remote address and a relayed one reports none (the field is optional).
"""

from __future__ import annotations

from typing import Any


# 7. mDNS addresses ----------------------------------------------------------------------------
def advertise_host_addrs_on_mdns() -> None:
    from libp2p.discovery.mdns import broadcaster

    def _resolve_host_addrs(self: Any) -> list[str]:
        if self.host is None:
            return self.listen_addrs or []
        return [str(a).rsplit("/p2p/", 1)[0] for a in self.host.get_addrs()]

    broadcaster.PeerBroadcaster._resolve_host_addrs = _resolve_host_addrs


# 8. identify's observed address -------------------------------------------------------------
def report_socket_address_as_observed() -> None:
    from libp2p.identity.identify import identify

    # handle_identify passes the stream's socket address as ``fallback``; relayed streams have
    # none (their raw connection is a relay stream), so they now report no observed address.
    identify._prefer_circuit_addr = lambda host, peer_id, fallback: fallback


# accessors ------------------------------------------------------------------------------------
def observed_addr_manager(host: Any) -> Any:
    """The host's manager of the addresses identify says peers see us at (None if it has none)."""
    return getattr(host, "_observed_addr_manager", None)
