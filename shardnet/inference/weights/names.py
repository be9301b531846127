"""Which model a name means on this node: the first binding seen is kept (trust on first use).

Anyone can publish a model card naming any model, so counting publishers would let a few fake
peers take a popular name. Instead a node keeps, per name, the first model ID it resolved the
name to and the publishers (peer IDs: the keys that signed those cards) it saw vouching for it,
in a small JSON file (``$SHARDNET_MODEL_NAMES``, default ``~/.shardnet/model-names.json``), like
ssh's known_hosts. The rules (``choose``):

- a name kept here resolves to its kept model ID only; cards naming another model are ignored,
  whatever their number (a kept model nobody serves now is refused, not replaced);
- a name not kept here that one model ID claims (however many peers publish that card: every
  peer serving a model republishes its card, and the ID is the hash of the manifest, so they
  agree) resolves to it, and the binding is kept;
- a name not kept here that several model IDs claim is refused, listing the candidates;
- ``NAME@ID-PREFIX`` resolves only to a model claiming NAME whose ID starts with the prefix (an
  unknown or ambiguous prefix is refused) and keeps that binding, replacing an older one: the
  way to choose, or to follow a model to a new version.

A model ID given in full needs no binding and changes none.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shardnet.errors import ShardnetError
from shardnet.transport.identity import short

log = logging.getLogger(__name__)

ENV_NAMES = "SHARDNET_MODEL_NAMES"
DEFAULT_NAMES = Path("~/.shardnet/model-names.json")
MIN_PREFIX = 4
PIN_RE = re.compile(r"^(?P<name>.+)@(?P<prefix>[0-9a-fA-F]+)$")
#: publishers kept per binding (those seen first)
MAX_PUBLISHERS_KEPT = 8
SHOWN_ID = 12


class NameConflict(ShardnetError):
    """A model name is claimed by several models and none is bound here (or not the one bound)."""

    code = "model_name_conflict"


class BadModelSpec(ShardnetError):
    """``NAME@ID-PREFIX`` with a prefix too short to mean anything."""

    code = "bad_model_spec"


def default_names_path() -> Path:
    return Path(os.environ.get(ENV_NAMES) or DEFAULT_NAMES).expanduser()


def parse_model_spec(spec: str) -> tuple[str, str | None]:
    """``NAME@ID-PREFIX`` -> (NAME, prefix), lower case; a plain name -> (name, None)."""
    m = PIN_RE.match(spec)
    if m is None:
        return spec, None
    if len(m["prefix"]) < MIN_PREFIX:
        raise BadModelSpec(f"model {spec!r}: give at least {MIN_PREFIX} hex digits of the model ID after '@'")
    return m["name"], m["prefix"].lower()


def model_name(spec: str) -> str:
    """The name of a spec, without its ``@ID-PREFIX`` (for messages and the names a model is kept by)."""
    m = PIN_RE.match(spec)
    return m["name"] if m else spec


@dataclass(frozen=True)
class Binding:
    model_id: str
    publishers: tuple[str, ...]
    since: float


class NameBindings:
    """The bindings kept on this node (one JSON file; a missing file is an empty one)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path) if path is not None else default_names_path()

    def get(self, name: str) -> Binding | None:
        entry = self._read().get(name)
        if entry is None:
            return None
        return Binding(entry["model_id"], tuple(entry.get("publishers", ())), float(entry.get("since", 0)))

    def all(self) -> dict[str, Binding]:
        return {n: Binding(e["model_id"], tuple(e.get("publishers", ())), float(e.get("since", 0)))
                for n, e in self._read().items()}

    def keep(self, name: str, model_id: str, publishers: list[str]) -> None:
        """Bind ``name`` to ``model_id`` (replacing what it was bound to). Best effort: a node that
        cannot write its file resolves the same, but keeps nothing (a warning says so)."""
        try:
            with self._locked():
                names = self._read()
                names[name] = {"model_id": model_id, "publishers": sorted(publishers)[:MAX_PUBLISHERS_KEPT],
                               "since": time.time()}
                tmp = self.path.with_name(f".{self.path.name}.tmp")
                tmp.write_text(json.dumps({"version": 1, "names": names}, indent=1, sort_keys=True))
                os.replace(tmp, self.path)
        except OSError as e:
            log.warning("could not keep the binding of model name %r in %s: %s", name, self.path, e)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.path.with_name(f".{self.path.name}.lock"), "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _read(self) -> dict[str, dict]:
        try:
            raw = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise ShardnetError(f"cannot read the model name bindings {self.path}: {e}") from None
        try:
            names = json.loads(raw)["names"]
            if not all(isinstance(n, str) and isinstance(e, dict) and isinstance(e.get("model_id"), str)
                       for n, e in names.items()):
                raise ValueError
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ShardnetError(f"the model name bindings {self.path} are corrupt: fix or remove the file") from None
        return names


def describe(model_id: str, publishers, *, bound: bool = False) -> str:
    """``3f2a1b2c3d4e (publisher 12D3KooW…abcdef)`` (and ``, bound here``)."""
    pubs = sorted(publishers)
    who = (f"publisher {short(pubs[0])}" if len(pubs) == 1
           else f"{len(pubs)} publishers: {short(pubs[0])}, …" if pubs else "no publisher seen")
    return f"{model_id[:SHOWN_ID]} ({who}{', bound here' if bound else ''})"


def _listing(claims: dict[str, set[str]], kept: Binding | None = None) -> str:
    return ", ".join(describe(m, p, bound=kept is not None and m == kept.model_id)
                     for m, p in sorted(claims.items(), key=lambda kv: (-len(kv[1]), kv[0])))


def choose(name: str, prefix: str | None, claims: dict[str, set[str]], kept: Binding | None, *,
           where: Path | None = None) -> str | None:
    """The model ID ``name`` (pinned to ``prefix`` when given) means, given ``claims`` (model ID
    -> the publishers whose signed cards name it ``name``) and the binding ``kept`` here; None
    when no model claims the name (the caller says what the swarm serves); NameConflict when
    the rules refuse."""
    hint = f"give {name}@ID-PREFIX or the model ID to choose"
    if prefix is not None:
        matches = [m for m in claims if m.startswith(prefix)]
        if len(matches) == 1:
            return matches[0]
        if not claims:
            return None
        if matches:
            raise NameConflict(f"{len(matches)} models called {name!r} have IDs starting with {prefix}: "
                               f"{_listing({m: claims[m] for m in matches}, kept)}; give more of the ID")
        raise NameConflict(f"no model called {name!r} has an ID starting with {prefix} "
                           f"(models called so: {_listing(claims, kept)})")
    if kept is not None:
        if kept.model_id in claims:
            return kept.model_id
        if not claims:
            return None
        raise NameConflict(f"model name {name!r} is bound on this node to {describe(kept.model_id, kept.publishers)}, "
                           f"which no peer serves now; the swarm serves under that name: {_listing(claims)}; "
                           f"{hint} (bindings: {where or default_names_path()})")
    if len(claims) <= 1:
        return next(iter(claims), None)
    raise NameConflict(f"model name {name!r} is claimed by {len(claims)} models: {_listing(claims)}, "
                       f"and none is bound on this node yet; {hint}")

