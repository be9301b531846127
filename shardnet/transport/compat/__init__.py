"""Fixes for measured py-libp2p 0.8.1 behaviour that shardnet cannot live with.

Every change to py-libp2p's behaviour is an entry of :data:`PATCHES`, applied once, in table
order, by :func:`apply`; nothing else in shardnet patches py-libp2p. Each entry names the
upstream object it patches, whether it wraps upstream's code or replaces it, why, and the test
that proves it. The patches are **process-wide**: they change py-libp2p's classes and modules,
so every host in the process (an embedding app's own ones too) gets the fixed behaviour. They
are written for one py-libp2p version, :data:`SUPPORTED_LIBP2P`, and ``apply()`` refuses to run
on another (docs/embedding.md).

One module per upstream subsystem holds the patches and their explanation, under the fix
numbers the docs cite: swarm.py (1, 3, 6, 9, 12, 17), tcp.py (13), yamux.py (2, 3, 6, 10, 15, 17, 21),
noise.py (6), pubsub.py (4, 16, 22), kad.py (11, 14, 18, 19, 20), identify.py (7, 8), logger.py (5); naps.py holds the
trio proxy of fix 3, which swarm.py and yamux.py both install. The same modules
hold the small accessors through which the rest of shardnet reads py-libp2p's private state
(``swarm.forget_failed_dial``, ``kad.providers_from_peer``, ...), so that state is touched only
here (tests/unit/test_layering.py checks it).

Fixes that are settings or wrappers rather than patches live where they are used, each tested
too: host.py (250 ms happy-eyeballs dial delay, auto-connector dialling ~100 peers, dial
retries, SO_REUSEPORT letting two nodes share a port), pubsub.py (120 s heartbeat, 10 msgs/s
spam limit), dht.py (incomplete and duplicated provider lookups, unroutable long keys),
node.py (60 s negative dial cache, listening sockets left open at shutdown), allocator.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Literal

from ...errors import ShardnetError
from . import identify, kad, logger, noise, pubsub, swarm, tcp, yamux
from .kad import RequestRateExceeded, serves_dht  # noqa: F401  (re-exported)
from .noise import NOISE_RECV_CHUNK  # noqa: F401
from .pubsub import (  # noqa: F401
    OUTBOUND_QUEUE_SIZE,
    SUBSCRIPTION_QUEUE_SIZE,
    dropped_pubsub_messages,
)
from .tcp import (  # noqa: F401
    MAX_MULTISTREAM_MESSAGE,
    MAX_TCP_READ,
    MULTISTREAM_HEADER,
    NotMultistream,
)
from .yamux import (  # noqa: F401
    CLOSE_FLUSH_S,
    LARGE_FRAMES_PROTOCOL,
    WRITE_QUEUE_BYTES,
    YAMUX_BODY_TIMEOUT,
    YAMUX_DEFAULT_FRAME,
    YAMUX_INITIAL_TARGET_WINDOW,
    YAMUX_LARGE_FRAME,
    YAMUX_MAX_BATCH,
    _ChunkBuffer,
    _max_frame_for,
    register_peerstore,
    ping_interval,
    pings_sent,
    set_keepalive_interval,
    streams_held,
    unanswered_ping_age,
    wake_keepalive,
)

#: The py-libp2p version every patch below was written for and tested against.
SUPPORTED_LIBP2P = "0.8.1"

#: Set to "1" to leave py-libp2p's data path as shipped (fix 6 off), for side-by-side benchmarks.
ENV_UNTUNED_DATA_PATH = "SHARDNET_UNTUNED_DATA_PATH"


class UnsupportedLibp2pVersion(ShardnetError):
    """The installed py-libp2p is not the version the process-wide patches were written for."""

    code = "unsupported_libp2p"


@dataclass(frozen=True)
class Patch:
    """One change to py-libp2p: ``install`` applies it to ``target``."""

    #: The upstream object patched, "module:qualified.name" (a module alone for the logger).
    target: str
    #: "wrap": upstream's code still runs inside ours; "replace": ours runs instead.
    how: Literal["wrap", "replace"]
    #: One line: the upstream behaviour this fixes.
    why: str
    #: The pytest node id of the test that proves the fix.
    test: str
    #: The fix number the module docstrings and the docs use.
    fix: int
    #: Applies the patch; None for a setting a named compat function sets (see SETTINGS).
    install: Callable[[], None] | None = None
    #: Part of the data-path speed-up: left out with SHARDNET_UNTUNED_DATA_PATH=1.
    data_path: bool = False


_T = "tests/integration/test_compat.py::"
_CANCEL = "tests/integration/test_cancel_safety.py::"
_LIMIT = "tests/integration/test_stream_limits.py::"
_YAMUX = "libp2p.stream_muxer.yamux.yamux:"

#: Every patch, in the order apply() installs them (later wraps of one target wrap earlier ones).
PATCHES: tuple[Patch, ...] = (
    Patch("libp2p", "replace", "import libp2p turns off its logger's propagation: routed back into logging",
          _T + "test_libp2p_logs_reach_shardnet_logging", 5, logger.route_libp2p_logging),
    Patch("libp2p.network.swarm:Swarm._do_handle_inbound_connection", "replace",
          "each inbound connection held a task and a slot until the whole swarm stopped; strangers unbounded",
          _T + "test_inbound_connection_churn_frees_tasks_and_slots", 1,
          swarm.wait_for_each_inbound_connection_only),
    Patch(_YAMUX + "YamuxStream.send_window", "replace",
          "a writer polled the closed send window and reset the stream after 5 s: now it sleeps until it opens",
          _T + "test_stream_survives_a_receiver_busy_longer_than_five_seconds", 2,
          yamux.wake_writers_when_the_window_opens),
    Patch(_YAMUX + "YamuxStream.closed", "replace",
          "a writer waiting for the window must wake when its stream closes",
          _T + "test_writer_blocked_on_window_is_released_when_the_peer_dies", 2,
          yamux.wake_writers_when_the_stream_closes),
    Patch("libp2p.network.connection.swarm_connection:trio", "replace",
          "fixed 100 ms naps on the disconnect path", _T + "test_disconnect_path_has_no_fixed_naps", 3,
          swarm.skip_swarm_connection_naps),
    Patch(_YAMUX + "trio", "replace", "fixed 100 ms naps on the disconnect path",
          _T + "test_disconnect_path_has_no_fixed_naps", 3, yamux.skip_yamux_naps),
    Patch("libp2p.pubsub.pubsub:SUBSCRIPTION_CHANNEL_SIZE", "replace",
          "gossipsub subscription queues of 32 dropped bursts", _T + "test_gossip_burst_is_delivered_whole", 4,
          pubsub.enlarge_subscription_queues),
    Patch("libp2p.pubsub.rpc_queue:RpcQueue.__init__", "replace",
          "per-peer outbound RPC queues of 32 (the default argument) dropped bursts",
          _T + "test_gossip_burst_is_delivered_whole", 4, pubsub.enlarge_outbound_queues),
    Patch("libp2p.pubsub.pubsub:drop_rpc", "replace", "an outbound drop was a debug line: now counted and a warning",
          _T + "test_gossip_burst_is_delivered_whole", 4, pubsub.count_outbound_drops_in_pubsub),
    Patch("libp2p.pubsub.gossipsub:drop_rpc", "replace", "an outbound drop was a debug line: now counted and a warning",
          _T + "test_gossip_burst_is_delivered_whole", 4, pubsub.count_outbound_drops_in_gossipsub),
    Patch("libp2p.pubsub.pubsub:Pubsub.notify_subscriptions", "replace",
          "a subscriber's drop was silent: now counted and a warning",
          _T + "test_gossip_burst_is_delivered_whole", 4, pubsub.count_subscription_drops),
    Patch("libp2p.pubsub.pubsub:Pubsub._teardown_if_connected", "replace",
          "muting a peer whose connection went away meanwhile raised KeyError and ended the node",
          _T + "test_muting_a_peer_that_went_away_meanwhile_is_harmless", 16, pubsub.forget_blacklisted_peers_once),
    Patch("libp2p.pubsub.pubsub:Pubsub.__init__", "wrap",
          "message numbers started at the Unix time in seconds: a peer restarted soon reused them, dropped as seen",
          _T + "test_a_restarted_peers_gossip_is_not_taken_for_what_it_sent_before", 22,
          pubsub.number_messages_from_the_time_in_nanoseconds),
    Patch("libp2p.discovery.mdns.broadcaster:PeerBroadcaster._resolve_host_addrs", "replace",
          "mDNS advertised raw listen addresses (/ip4/0.0.0.0/...) instead of the host's addresses",
          "tests/system/test_lan_discovery.py::test_two_nodes_find_each_other_with_mdns", 7,
          identify.advertise_host_addrs_on_mdns),
    Patch("libp2p.identity.identify.identify:_prefer_circuit_addr", "replace",
          "identify reported a circuit address with no IP as the observed address on every connection",
          "tests/system/test_nat_traversal.py::test_autonat_tells_public_from_private_and_private_peers_find_a_relay",
          8, identify.report_socket_address_as_observed),
    Patch("libp2p.network.swarm:Swarm._trim_connections", "wrap",
          "a hole-punched connection next to a relayed one was trimmed at once, either one",
          "tests/system/test_nat_traversal.py::test_hole_punch_through_two_cone_nats", 9,
          swarm.leave_relayed_connections_to_the_hole_puncher),
    Patch("libp2p.kad_dht.kad_dht:KadDHT.add_peer", "wrap",
          "every peer that sent a KAD request joined the routing table, DHT clients included",
          _T + "test_dht_clients_stay_out_of_routing_tables_and_lookups", 11, kad.add_only_servers_that_sent_requests),
    Patch("libp2p.kad_dht.peer_routing:PeerRouting._query_single_peer_for_closest", "wrap",
          "small-table lookups queried DHT clients", _T + "test_dht_clients_stay_out_of_routing_tables_and_lookups",
          11, kad.query_only_servers),
    Patch("libp2p.kad_dht.peer_routing:PeerRouting.find_closest_peers_network", "wrap",
          "lookups returned DHT clients as closest peers", _T + "test_dht_clients_stay_out_of_routing_tables_and_lookups",
          11, kad.return_only_servers),
    Patch("libp2p.network.connection.swarm_connection:SwarmConn._handle_muxed_stream", "wrap",
          "one peer could take every inbound stream slot, and a handler's exception ended the node",
          "tests/system/test_limits.py::test_streams_per_peer_and_stream_rate", 12, swarm.gate_inbound_streams),
    Patch(_YAMUX + "Yamux.open_stream", "wrap",
          "a 257th stream opened on a connection waited silently for a slot (held until closed here)",
          _LIMIT + "test_streams_the_peer_closed_hold_the_connection_limit_until_closed_here", 17,
          yamux.refuse_streams_over_the_connection_limit_at_once),
    Patch("libp2p.network.swarm:Swarm.new_stream", "wrap",
          "a stream opened past streams_total (both directions, all peers) waited silently for a slot",
          _LIMIT + "test_streams_over_streams_total_fail_at_once", 17, swarm.refuse_streams_over_the_total_at_once),
    Patch("libp2p.utils.varint:read_delim", "replace", "multistream messages of any declared length were read",
          _T + "test_strangers_are_bounded_before_the_handshake", 13, tcp.bound_multistream_messages_in_varint),
    Patch("libp2p.utils:read_delim", "replace", "multistream messages of any declared length were read",
          _T + "test_strangers_are_bounded_before_the_handshake", 13, tcp.bound_multistream_messages_in_utils),
    Patch("libp2p.protocol_muxer.multiselect_communicator:read_delim", "replace",
          "multistream messages of any declared length were read",
          _T + "test_strangers_are_bounded_before_the_handshake", 13, tcp.bound_multistream_messages_in_communicator),
    Patch("libp2p.io.trio:TrioTCPStream.read", "wrap", "a TCP read of n bytes allocated n at once, n from a stranger",
          _T + "test_tcp_reads_never_ask_the_socket_for_more_than_a_bound", 13, tcp.bound_tcp_reads),
    Patch("libp2p.kad_dht.provider_store:BUCKET_SIZE", "replace",
          "a node held the first 20 providers of a key and ignored later ones: now up to 4,096",
          "tests/integration/test_node.py::test_provider_replies_are_bounded_random_samples", 18,
          kad.hold_more_providers_per_key),
    Patch("libp2p.kad_dht.provider_store:ProviderStore.get_providers", "wrap",
          "GET_PROVIDERS answered every provider held: now a random sample of at most 20",
          "tests/integration/test_node.py::test_provider_replies_are_bounded_random_samples", 18,
          kad.answer_a_sample_of_providers),
    Patch("libp2p.kad_dht.kad_dht:ROUTING_TABLE_REFRESH_INTERVAL", "replace",
          "the DHT walked once per non-empty bucket every 10 minutes, beside discovery's walks: now hourly",
          "tests/integration/test_node.py::test_the_dht_leaves_its_routing_table_refresh_to_discovery", 19,
          kad.refresh_the_routing_table_hourly),
    Patch("libp2p.kad_dht.kad_dht:KadDHT.refresh_routing_table", "replace",
          "the DHT's refresh walked once per non-empty bucket, beside discovery's walks: discovery's alone now",
          "tests/integration/test_node.py::test_the_dht_leaves_its_routing_table_refresh_to_discovery", 19,
          kad.leave_routing_table_refresh_to_discovery),
    Patch("libp2p.kad_dht.utils:consume_envelope", "wrap",
          "every signed peer record in a DHT message was checked again, though the same ones recur: once now",
          "tests/integration/test_node.py::test_a_peer_record_is_checked_once", 20,
          kad.check_each_peer_record_once),
    Patch("libp2p.kad_dht.kad_dht:read_varint_prefixed_bytes_limited", "wrap",
          "a DHT request stream was read with no limit on how many messages or how fast",
          "tests/system/test_limits.py::test_dht_requests_per_peer", 14, kad.meter_dht_requests),
    Patch(_YAMUX + "Yamux.__init__", "wrap",
          "a cancelled write could cut a Noise message and kill the connection: one writer task per connection",
          _CANCEL + "test_thousands_of_cut_writes_leave_the_connection_whole", 15, yamux.give_each_connection_a_writer),
    Patch(_YAMUX + "Yamux.start", "replace", "the connection's writer runs beside its reader",
          _CANCEL + "test_thousands_of_cut_writes_leave_the_connection_whole", 15,
          yamux.run_the_writer_beside_the_reader),
    Patch(_YAMUX + "Yamux._write_frame", "replace", "frames go through the writer's queue, never cut on the socket",
          _CANCEL + "test_thousands_of_cut_writes_leave_the_connection_whole", 15, yamux.queue_frames_for_the_writer),
    Patch(_YAMUX + "YamuxStream.read", "wrap",
          "a reset stream read as a clean end once its bytes were read; FIN-then-reset read as reset",
          _CANCEL + "test_a_fin_before_a_reset_reads_as_a_whole_stream_and_a_local_reset_wakes_readers", 15,
          yamux.report_resets_after_the_buffered_bytes),
    Patch(_YAMUX + "YamuxStream.reset", "wrap", "a local reset left a reader of the stream asleep forever",
          _CANCEL + "test_a_fin_before_a_reset_reads_as_a_whole_stream_and_a_local_reset_wakes_readers", 15,
          yamux.note_fin_and_wake_readers_on_reset),
    Patch(_YAMUX + "Yamux._cleanup_on_error", "wrap", "whether a FIN came before the connection died was lost",
          _CANCEL + "test_a_fin_before_a_reset_reads_as_a_whole_stream_and_a_local_reset_wakes_readers", 15,
          yamux.note_fin_when_the_connection_fails),
    Patch("libp2p.security.noise.io:NoiseTransportReadWriter.read_msg", "replace",
          "two exact socket reads per Noise message", _T + "test_data_path_is_byte_exact_under_any_chunking", 6,
          noise.buffer_noise_reads, data_path=True),
    Patch("libp2p.security.noise.io:NoiseTransportReadWriter.write_msg", "replace",
          "one socket write per Noise message and a bytes copy per encryption",
          _T + "test_data_path_is_byte_exact_under_any_chunking", 6, noise.batch_noise_writes, data_path=True),
    Patch("libp2p.security.secure_session:SecureSession._reset_internal_buffer", "replace",
          "the session's read buffer was a BytesIO copied on every partial read",
          _T + "test_data_path_is_byte_exact_under_any_chunking", 6, noise.bytearray_session_buffer, data_path=True),
    Patch("libp2p.security.secure_session:SecureSession.read", "replace",
          "the session's read buffer was a BytesIO copied on every partial read",
          _T + "test_data_path_is_byte_exact_under_any_chunking", 6, noise.read_session_from_bytearray,
          data_path=True),
    Patch(_YAMUX + "YamuxStream.write", "replace",
          "one secure-session write per frame, 64 KiB frames, debug strings built per frame",
          _CANCEL + "test_a_cut_write_resets_its_stream_instead_of_ending_it", 6, yamux.batch_stream_writes,
          data_path=True),
    Patch(_YAMUX + "YamuxStream._auto_tune_and_send_window_update", "replace",
          "one WINDOW_UPDATE frame per read", _T + "test_small_messages_do_not_trigger_a_window_update_each", 6,
          yamux.update_windows_like_go_yamux, data_path=True),
    Patch(_YAMUX + "YamuxStream.__init__", "wrap", "a 256 KiB initial target window and a checkpointing lock",
          _T + "test_receive_window_grows_on_a_long_path", 6, yamux.start_streams_with_a_larger_window,
          data_path=True),
    Patch(_YAMUX + "Yamux.__init__", "wrap",
          "stream buffers consumed with del bytearray[:n] (quadratic) and a checkpointing lock",
          _T + "test_data_path_is_byte_exact_under_any_chunking", 6, yamux.chunk_buffers_and_fast_locks,
          data_path=True),
    Patch(_YAMUX + "Yamux.read_stream", "replace", "a lock and five debug strings per read",
          _T + "test_data_path_is_byte_exact_under_any_chunking", 6, yamux.read_streams_without_lock_or_debug_strings,
          data_path=True),
    Patch(_YAMUX + "Yamux._read_data_body", "wrap", "a deadline scope and an environment lookup per frame",
          _T + "test_data_path_is_byte_exact_under_any_chunking", 6,
          yamux.read_small_frame_bodies_from_the_session_buffer, data_path=True),
    Patch("libp2p.network.stream.net_stream:NetStream.__init__", "wrap",
          "a scheduler round trip for a state lock on every read and write",
          _T + "test_data_path_is_byte_exact_under_any_chunking", 6, swarm.lock_free_net_stream_state,
          data_path=True),
    Patch("libp2p.security.secure_session:SecureSession.read", "wrap",
          "when a connection last brought anything was not known (the keepalive below needs it)",
          _T + "test_only_quiet_connections_are_pinged", 10, yamux.note_when_each_connection_last_heard),
    Patch(_YAMUX + "YamuxStream.write", "wrap",
          "when a connection's streams last wrote was not known (the keepalive below pings idle ones less often)",
          _T + "test_idle_connections_are_pinged_less_often", 10, yamux.note_when_each_connection_last_used),
    Patch("libp2p.network.stream.net_stream:NetStream.set_protocol", "wrap",
          "gossip links' control messages (mesh upkeep, every heartbeat) counted as use of their "
          "connection and brought it back to the short keepalive interval",
          _T + "test_gossip_links_do_not_shorten_the_keepalive_interval", 10, yamux.note_gossip_streams),
    Patch(_YAMUX + "Yamux._stale_stream_sweeper", "replace",
          "every connection's stale-stream sweeper woke every 30 s, streams to reclaim or not",
          _T + "test_the_stale_stream_sweeper_sleeps_while_no_closed_stream_waits", 21,
          yamux.sweep_only_while_a_closed_stream_waits),
    Patch(_YAMUX + "Yamux._measure_rtt_loop", "replace",
          "both sides pinged every connection every interval, busy or not",
          _T + "test_only_quiet_connections_are_pinged", 10, yamux.ping_only_quiet_connections),
)

#: Upstream module constants shardnet sets from a node's config through a named function, not
#: at apply(): listed so that every upstream object shardnet changes is in one place.
SETTINGS: tuple[Patch, ...] = (
    Patch(_YAMUX + "RTT_MEASURE_INTERVAL", "replace",
          "30 s between Yamux pings: a silently dead path looked alive for minutes "
          "(set by yamux.set_keepalive_interval from keepalive_interval)",
          "tests/integration/test_autonat_holepunch.py::test_a_silently_dead_connection_is_closed_by_keepalive", 10),
)

_applied = False


def installed_libp2p_version() -> str | None:
    """The installed py-libp2p's version (None: not installed)."""
    try:
        return metadata.version("libp2p")
    except metadata.PackageNotFoundError:
        return None


def check_libp2p_version() -> None:
    """Raise UnsupportedLibp2pVersion unless the installed py-libp2p is SUPPORTED_LIBP2P."""
    found = installed_libp2p_version()
    if found != SUPPORTED_LIBP2P:
        raise UnsupportedLibp2pVersion(
            f"shardnet needs py-libp2p {SUPPORTED_LIBP2P} and found {found or 'none installed'}: its patches "
            f"change py-libp2p process-wide and are written for {SUPPORTED_LIBP2P} only "
            f"(pip install libp2p=={SUPPORTED_LIBP2P})")


def apply() -> None:
    """Check the py-libp2p version, then install every patch of PATCHES once (safe to call many
    times). The data-path ones are left out when SHARDNET_UNTUNED_DATA_PATH=1."""
    global _applied
    if _applied:
        return
    check_libp2p_version()
    _applied = True
    tuned = os.environ.get(ENV_UNTUNED_DATA_PATH) != "1"
    for patch in PATCHES:
        if patch.install is not None and (tuned or not patch.data_path):
            patch.install()
