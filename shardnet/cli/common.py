"""What every ``shardnet`` command shares: running under trio with one-line failures, the
network options and the NodeConfig they make, output helpers."""

from __future__ import annotations

import functools
import json
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import click
import trio

from shardnet.transport.config import NodeConfig, parse_multiaddr, parse_peer_addr
from shardnet.transport.errors import ShardnetError

from .profiling import profiled_if_asked

# One logger for every command module: its name shows in each stderr line, as before the split.
log = logging.getLogger("shardnet.cli")


def fail(message: str, code: int = 1) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``main`` under trio; SIGINT/SIGTERM stop it cleanly; ShardnetError -> one line."""

    async def _guarded() -> Any:
        result: list[Any] = []
        async with trio.open_nursery() as nursery:

            async def _signals() -> None:
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        log.info("received %s, shutting down", signal.Signals(signum).name)
                        nursery.cancel_scope.cancel()
                        return

            async def _main() -> None:
                result.append(await main())
                nursery.cancel_scope.cancel()

            nursery.start_soon(_signals)
            nursery.start_soon(_main)
        return result[0] if result else None

    try:
        with profiled_if_asked():  # $SHARDNET_PROFILE (a developer's look at where CPU time goes)
            return trio.run(_guarded)
    except (ShardnetError, BaseExceptionGroup) as e:
        first = _first_shardnet_error(e)
        if first is None:
            _unexpected(e)
        fail(str(first))
    except Exception as e:
        _unexpected(e)


def _unexpected(e: BaseException) -> None:
    """A bug, not a user error: still one line, with the traceback in the debug log."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    log.debug("unexpected failure", exc_info=e)
    fail(f"unexpected {type(e).__name__}: {e} (run with -v for the traceback)")


def _first_shardnet_error(e: BaseException) -> ShardnetError | None:
    if isinstance(e, ShardnetError):
        return e
    if isinstance(e, BaseExceptionGroup):
        for sub in e.exceptions:
            found = _first_shardnet_error(sub)
            if found is not None:
                return found
    return None


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def say(text: str) -> None:
    click.echo(text)
    sys.stdout.flush()


def identity_option(f):
    return click.option(
        "--identity",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="Identity key file (default $SHARDNET_IDENTITY or ~/.shardnet/identity.key).",
    )(f)


def network_options(default_listen: str | None):
    def deco(f):
        f = click.option("--listen", "listen", multiple=True, metavar="MADDR",
                         help=f"Listen multiaddr, repeatable (default {default_listen or '/ip4/0.0.0.0/tcp/0'}).")(f)
        f = click.option("--announce", multiple=True, metavar="MADDR",
                         help="Advertise this multiaddr instead of the listen addresses (repeatable).")(f)
        f = click.option("--bootstrap", multiple=True, metavar="MADDR", envvar="SHARDNET_BOOTSTRAP",
                         help="Bootstrap peer (/ip4/../tcp/../p2p/ID), repeatable (default: $SHARDNET_BOOTSTRAP, "
                              "addresses separated by spaces).")(f)
        f = click.option("--quic", is_flag=True, help="Also enable the QUIC transport.")(f)
        f = click.option("--mdns", is_flag=True, help="Discover peers on the LAN with mDNS.")(f)
        f = click.option("--relay", "relays", multiple=True, metavar="MADDR",
                         help="Hold a slot at this circuit relay (/ip4/../tcp/../p2p/ID), repeatable: peers "
                              "that cannot dial us (NAT) reach us through it.")(f)
        f = click.option("--no-hole-punch", is_flag=True, expose_value=False, callback=_remember,
                         help="Keep relayed connections relayed (no DCUtR hole punching).")(f)
        f = click.option("--no-auto-relay", is_flag=True, expose_value=False, callback=_remember,
                         help="Without --relay, do not reserve relay slots when AutoNAT finds us behind NAT.")(f)
        f = click.option("--no-autonat", is_flag=True, expose_value=False, callback=_remember,
                         help="Do not ask peers whether we are reachable (for bootstrap and relay nodes whose "
                              "reachability is known); still answer their questions.")(f)
        return limit_option(swarm_key_option(f))

    return deco


def metrics_options(f):
    """``--metrics-port`` (and ``--metrics-host``): serve the node's Prometheus metrics."""
    f = click.option("--metrics-host", default="127.0.0.1", show_default=True, metavar="HOST", expose_value=False,
                     callback=_remember, help="Address --metrics-port listens on (0.0.0.0: every interface).")(f)
    return click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, metavar="PORT",
                        expose_value=False, callback=_remember,
                        help="Serve Prometheus metrics at http://HOST:PORT/metrics (default: not served).")(f)


@asynccontextmanager
async def metrics_if_asked(node, ctx_meta: dict):
    """Serve ``node``'s metrics while inside when the command was given --metrics-port (pass
    ``click.get_current_context().meta``, read before trio starts)."""
    port = ctx_meta.get("shardnet.metrics_port")
    if port is None:
        yield
        return
    from shardnet.gateway.metrics_endpoint import metrics_served
    from shardnet.inference.services import inference_services

    host = ctx_meta.get("shardnet.metrics_host") or "127.0.0.1"
    async with metrics_served(inference_services(node).metrics, host, port) as url:
        click.echo(f"metrics at {url}", err=True)  # (stderr: stdout may carry --events' JSON)
        yield


def limit_option(f):
    return click.option("--limit", "limits", multiple=True, metavar="NAME=VALUE", expose_value=False,
                        callback=_remember, help="Set a resource limit (repeatable; `shardnet limits` lists them).")(f)


def swarm_key_option(f):
    return click.option("--swarm-key", type=click.Path(dir_okay=False, path_type=Path), default=None,
                        envvar="SHARDNET_SWARM_KEY", expose_value=False, callback=_remember,
                        help="Private swarm: connect only with peers holding this key file "
                             "(make one with `shardnet swarm-key PATH`).")(f)


def load_swarm_key(cfg: NodeConfig) -> NodeConfig:
    """--swarm-key (or $SHARDNET_SWARM_KEY), remembered in the click context, into ``cfg``."""
    meta = click.get_current_context(silent=True)
    path = meta.meta.get("shardnet.swarm_key") if meta is not None else None
    if path:
        from shardnet.transport.swarm_key import SwarmKey

        cfg.swarm_key = SwarmKey.load(path)
        log.info("private swarm: key %s (%s)", cfg.swarm_key.fingerprint, path)
    return cfg


def _remember(ctx: click.Context, param: click.Parameter, value) -> None:
    """Network flags every command shares reach make_config through the click context."""
    ctx.meta[f"shardnet.{param.name}"] = value


def make_config(*, identity: Path | None, listen, announce, bootstrap, quic: bool, mdns: bool,
                default_listen: str, persistent: bool = True, dht_mode: str = "server", relays=()) -> NodeConfig:
    from shardnet.transport import identity as ident

    for a in listen:
        parse_multiaddr(a, what="--listen")
    for a in announce:
        parse_multiaddr(a, what="--announce")
    for a in bootstrap:
        parse_peer_addr(a, what="--bootstrap")
    for a in relays:
        parse_peer_addr(a, what="--relay")
    cfg = NodeConfig(
        listen=list(listen) or [default_listen],
        announce=list(announce),
        bootstrap=list(bootstrap),
        enable_quic=quic,
        enable_mdns=mdns,
        dht_mode=dht_mode,
        relays=list(relays),
    )
    meta = click.get_current_context(silent=True)
    meta = meta.meta if meta is not None else {}
    cfg.hole_punch = not meta.get("shardnet.no_hole_punch", False)
    for assignment in meta.get("shardnet.limits", ()):
        cfg.limits.set(assignment)
    load_swarm_key(cfg)
    if meta.get("shardnet.no_auto_relay", False):
        cfg.auto_relays = 0
    if meta.get("shardnet.no_autonat", False):
        cfg.autonat_client = False
    if persistent:
        path = identity or ident.default_identity_path()
        kp, created = ident.load_or_create(path)
        log.info("%s identity %s (%s)", "created" if created else "using", ident.peer_id_of(kp), path)
        cfg.key_pair = kp
    return cfg


def wrap_errors(f):
    """Turn ShardnetError raised while parsing options into the one-line failure."""

    @functools.wraps(f)
    def inner(*a, **kw):
        try:
            return f(*a, **kw)
        except ShardnetError as e:
            fail(str(e))

    return inner


def model_path_option(f):
    return click.option("--model", "model_path", default=None, metavar="DIR|ORG/NAME|NAME|ID",
                        help="A checkpoint directory, a Hugging Face repo in the local hub cache, or a model the "
                             "swarm serves by name or model ID (fetched into --cache-dir as needed). Default: "
                             "the shipped tiny-llama.")(f)


def cache_dir_option(f):
    return click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                        envvar="SHARDNET_CACHE",
                        help="Where models fetched from the swarm are kept (default $SHARDNET_CACHE or "
                             "~/.cache/shardnet/models).")(f)


def local_model(spec: str | None, *, download: bool = True) -> Path | None:
    """The directory ``--model`` names without asking the swarm: a directory, or a Hugging Face
    repo found in the local hub cache (with ``download``, fetched from the hub where one is
    reachable: for commands with no swarm to ask); None: ask the swarm. A model ID never goes
    to the hub."""
    from shardnet.models import default_model_path

    if spec is None:
        return default_model_path()
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        fail(f"--model {spec}: not a directory")
    from shardnet.inference.weights.cards import MODEL_ID_RE

    if MODEL_ID_RE.match(spec):
        return None
    from shardnet.inference.weights.names import parse_model_spec

    if parse_model_spec(spec)[1] is not None:  # NAME@ID-PREFIX: a name the swarm serves, pinned
        return None
    from shardnet.inference.model.hub import looks_like_repo_id, resolve_hub_checkpoint

    if looks_like_repo_id(spec):
        found = resolve_hub_checkpoint(spec, download=download)
        if found is not None:
            log.info("model %s from the Hugging Face cache: %s", spec, found)
            return Path(found)
    return None


async def model_from_swarm(node, spec: str, *, cache_dir: Path | None, events: bool = False) -> Path:
    """The directory of ``spec`` when no files are here: the model the swarm serves by that
    name or ID (manifest and files fetched into the cache; tensors come later, as needed); if
    the swarm serves none, a Hugging Face repo of that name downloaded where a hub is reachable
    (the swarm first: joining by name should fetch one span, not the whole model)."""
    from shardnet.inference.model.hub import looks_like_repo_id, resolve_hub_checkpoint
    from shardnet.inference.weights.cards import MODEL_ID_RE, ModelNotFound
    from shardnet.inference.weights.swarm_model import open_from_swarm

    try:
        path, _card = await open_from_swarm(node, spec, cache_root=cache_dir,
                                            progress=FetchProgressBar("model files", events=events))
        return path
    except ModelNotFound:
        if MODEL_ID_RE.match(spec) or not looks_like_repo_id(spec):
            raise
        found = await trio.to_thread.run_sync(lambda: resolve_hub_checkpoint(spec, download=True))
        if found is None:
            raise
        return Path(found)


def model_dir(spec: str | None) -> Path:
    """``--model`` for commands that need the files here: a directory or a cached hub repo."""
    path = local_model(spec)
    if path is None:
        fail(f"--model {spec}: no such directory, and no Hugging Face repo of that name in the local cache")
    return path


async def client_model(node, spec: str | None, path: Path | None, *, dtype: str, logits_on_last: bool,
                       cache_dir: Path | None):
    """What a client holds of the model (LocalModel): read from ``path``, or with no files here
    fetched from the swarm: the config, tokenizer, embedding and (unless the last peer applies
    them) the final norm and LM head; never a layer."""
    from shardnet.inference.model.local_model import LocalModel

    if path is None:
        from shardnet.inference.model.checkpoint import Checkpoint
        from shardnet.inference.weights.swarm_model import fetch_tensors, head_tensor_names

        path = await model_from_swarm(node, spec, cache_dir=cache_dir)
        ckpt = Checkpoint(path)
        await fetch_tensors(node, ckpt, head_tensor_names(ckpt, lm_head=not logits_on_last),
                            progress=FetchProgressBar("the model's head"))
    log.info("loading the model's head from %s…", path)
    return await trio.to_thread.run_sync(lambda: LocalModel(path, dtype=dtype, lm_head=not logits_on_last))


async def draft_model_for(node, model, *, cache_dir: Path | None, required: bool) -> Path | None:
    """``auto_drafter.find_draft`` with a progress bar; with ``required`` (``--speculate draft``)
    no draft at all fails in one line."""
    from shardnet.inference.client.auto_drafter import find_draft

    found = await find_draft(node, model, cache_dir=cache_dir, progress=FetchProgressBar("the draft model"),
                             required=required)
    if found is None and required:
        fail("--speculate draft: the swarm names no draft for this model; give --draft DIR")
    return found


def require_swarm_for(spec: str | None, path: Path | None, bootstrap, mdns) -> None:
    """A ``--model`` with no files here comes from the swarm: there must be a way to reach it."""
    if path is None and not bootstrap and not mdns:
        fail(f"--model {spec}: no such directory or cached Hugging Face repo; to fetch it from the swarm, "
             "give --bootstrap MADDR", 2)


def needs_network_for(spec: str | None, path: Path | None, bootstrap, mdns, command: str) -> None:
    require_swarm_for(spec, path, bootstrap, mdns)
    if not bootstrap and not mdns:
        fail(f"{command} needs --bootstrap MADDR (or --mdns)", 2)


class FetchProgressBar:
    """How a fetch from the swarm shows on stderr: a progress bar on a terminal (bytes, rate,
    ETA, sources), else a log line every few seconds; with ``events``, JSON lines on stdout."""

    def __init__(self, what: str, *, events: bool = False) -> None:
        self.what, self.events = what, events
        self.bar = None
        self._done = False
        self._last_line = 0.0

    def __call__(self, p) -> None:
        if self.events:
            emit({"event": "fetch", "what": self.what, "done": p.done, "reused": p.reused, "total": p.total,
                  "rate": round(p.rate), "sources": p.sources, "bad": p.bad})
            return
        if sys.stderr.isatty():
            if self._done:
                return
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=p.total, initial=p.reused, unit="B", unit_scale=True, unit_divisor=1024,
                                desc=f"fetching {self.what}", file=sys.stderr, leave=True)
            self.bar.n = p.done + p.reused
            self.bar.set_postfix_str(f"{p.sources} sources" + (f", {len(p.bad)} bad" if p.bad else ""),
                                     refresh=False)
            self.bar.refresh()
            if self.bar.n >= p.total:
                self.bar.close()
                self.bar, self._done = None, True
            return
        now = time.monotonic()
        if now - self._last_line >= 3.0 or p.done + p.reused >= p.total:
            self._last_line = now
            eta = f", ETA {p.eta:.0f} s" if p.eta is not None and p.done + p.reused < p.total else ""
            log.info("fetching %s: %.1f of %.1f MB (%.1f MB/s%s, %d sources%s)", self.what, (p.done + p.reused) / 1e6,
                     p.total / 1e6, p.rate / 1e6, eta, p.sources, f", {len(p.bad)} dropped for bad bytes" if p.bad else "")


@asynccontextmanager
async def visiting(cfg: NodeConfig, wait: float):
    """A visitor's node, joined (when it has bootstrap peers) and given ``wait`` s to discover."""
    from shardnet.transport import open_node

    async with open_node(cfg) as n:
        if cfg.bootstrap:
            await n.wait_bootstrapped()
        log.info("discovering peers for %.1f s", wait)
        await trio.sleep(wait)
        yield n


def visitor_config(relays, listen, announce, bootstrap, quic, mdns) -> NodeConfig:
    """A short-lived look at the swarm: throwaway identity, ephemeral port, DHT client only."""
    return make_config(relays=relays, identity=None, listen=listen, announce=announce, bootstrap=bootstrap,
                       quic=quic, mdns=mdns, default_listen="/ip4/0.0.0.0/tcp/0",
                       persistent=False, dht_mode="client")


def client_identity_option(f):
    return click.option("--identity", type=click.Path(dir_okay=False, path_type=Path), default=None,
                        help="Identity key file to use, created if missing (default: a throwaway identity "
                             "for this run).")(f)


def generation_config(identity: Path | None, **net) -> NodeConfig:
    """A generating client's node: DHT client; its own identity with --identity, else a throwaway one."""
    return make_config(identity=identity, persistent=identity is not None, default_listen="/ip4/0.0.0.0/tcp/0",
                       dht_mode="client", **net)
