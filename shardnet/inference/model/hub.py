"""A model named as a Hugging Face repo (``org/name``), found in the local hub cache.

``--model`` takes a directory, a model ID or a name. A name shaped like a repo ID resolves here: to
the snapshot directory huggingface_hub keeps in its cache (``HF_HUB_CACHE``, by default
``$HF_HOME/hub``: ``models--org--name/snapshots/<commit>/``, whose files link into ``blobs/``), found
without touching the network. A repo that is not cached is downloaded from the hub when one is
reachable and offline mode (``HF_HUB_OFFLINE``) is off; when it is not, the answer is None and the
caller asks the swarm instead.

Only the files a checkpoint is made of are fetched (config, safetensors and their index, tokenizer
and generation files): a repo also holding ``pytorch_model.bin``, ONNX or GGUF copies costs no more.

huggingface_hub is imported where it is used: the CLI imports this module on every start, and
most starts name a directory.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from shardnet.errors import CheckpointError

log = logging.getLogger(__name__)

#: the files of a repo that a checkpoint is made of (checkpoint.MODEL_FILES and the weights)
CHECKPOINT_PATTERNS = (
    "config.json", "generation_config.json", "chat_template.jinja",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json",
    "*.safetensors", "*.safetensors.index.json",
)
#: how long a hub that does not answer may keep us waiting, per request, unless
#: HF_HUB_ETAG_TIMEOUT says otherwise: an unreachable hub should cost seconds, then the swarm
DEFAULT_HUB_TIMEOUT_S = 5.0


def looks_like_repo_id(name: str) -> bool:
    """Whether ``name`` is shaped like a Hugging Face repo ID (``org/name`` or ``name``, as
    huggingface_hub validates them) and is not a path that exists here (a directory wins)."""
    return _valid_repo_id(name) and not Path(name).expanduser().exists()


def resolve_hub_checkpoint(name: str, *, revision: str | None = None, download: bool = True) -> Path | None:
    """The snapshot directory of repo ``name`` (at ``revision``, default its main branch) in the
    local Hugging Face cache, found offline; when it is not cached, downloaded if ``download`` and
    offline mode is off. None when the repo is neither cached nor downloadable (the hub unreachable,
    the repo unknown there): the caller then asks the swarm.

    Raises CheckpointError when the repo is cached (or downloaded) but is not a checkpoint shardnet
    reads: no config.json, no safetensors weights, a shard its index names missing, files missing
    from an interrupted download that cannot be completed now."""
    if not _valid_repo_id(name):
        return None
    cached, problem = _cached_snapshot(name, revision)
    if cached is not None and problem is None:
        log.debug("%s resolves to %s in the Hugging Face cache", name, cached)
        return cached
    if download and not _offline():
        fetched = _download(name, revision)
        if fetched is not None:
            if (fetched_problem := _snapshot_problem(fetched)) is not None:
                raise CheckpointError(f"{name} from the Hugging Face hub {fetched_problem}")
            return fetched
    if cached is not None:
        raise CheckpointError(f"{name} in the Hugging Face cache ({cached}) {problem}")
    return None


def _valid_repo_id(name: str) -> bool:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _offline() -> bool:
    """Offline mode as huggingface_hub read it at import, or as the environment says now (a caller
    may set HF_HUB_OFFLINE after huggingface_hub was imported)."""
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.is_offline_mode() or flag.strip().upper() in ("1", "ON", "YES", "TRUE")


def _hub_timeout_s() -> float:
    try:
        return float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or DEFAULT_HUB_TIMEOUT_S)
    except ValueError:
        return DEFAULT_HUB_TIMEOUT_S


def _cached_snapshot(name: str, revision: str | None) -> tuple[Path | None, str | None]:
    """The cached snapshot of ``name`` and what is wrong with it (None when nothing is), without
    network: (None, None) when the repo is not cached."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError
    from huggingface_hub.file_download import repo_folder_name

    def lookup(rev: str | None) -> tuple[Path | None, str | None]:
        try:
            found = snapshot_download(name, revision=rev, local_files_only=True,
                                      allow_patterns=list(CHECKPOINT_PATTERNS))
        except IncompleteSnapshotError as e:
            # huggingface_hub keeps the repo's file list: files it lists are missing (an
            # interrupted download), so this directory's model is not the repo's
            snapshot = Path(e.snapshot_path)
            return snapshot, f"is an incomplete download (missing {_missing_files(name, snapshot)})"
        except LocalEntryNotFoundError:
            return None, None
        return Path(found), _snapshot_problem(Path(found))

    cached, problem = lookup(revision)
    if cached is None and revision is None:
        # No ref to the main branch (e.g. fetched by commit or tag by another tool): a single
        # snapshot is unambiguous, several are not
        snapshots = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=name, repo_type="model") / "snapshots"
        commits = sorted(p.name for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
        if len(commits) == 1:
            cached, problem = lookup(commits[0])
    return cached, problem


def _missing_files(name: str, snapshot: Path) -> str:
    """The checkpoint files the cached file list of ``name`` names that ``snapshot`` lacks, for a
    message."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError
    from huggingface_hub.utils import filter_repo_objects

    try:
        listed = [f.path for f in get_cached_repo_tree(name, revision=snapshot.name)]
    except (CachedRepoTreeNotFoundError, OSError, ValueError):  # the listing only words the message
        return "files"
    missing = sorted(p for p in filter_repo_objects(listed, allow_patterns=list(CHECKPOINT_PATTERNS))
                     if not (snapshot / p).is_file())
    return ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")


def _snapshot_problem(snapshot: Path) -> str | None:
    """What keeps ``snapshot`` from being a checkpoint, as the end of a one-line sentence, or None."""
    if not (snapshot / "config.json").is_file():
        return "has no config.json"
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return f"has an unreadable {index.name}"
        missing = sorted(s for s in shards if not (snapshot / s).is_file())
        if missing:
            return f"lacks {len(missing)} of the {len(shards)} safetensors shards its index names ({missing[0]}, ...)"
        return None
    # is_file follows the snapshot's links into blobs/: a dangling link is a missing file
    if not any(p.is_file() for p in snapshot.glob("*.safetensors")):
        return "has no *.safetensors weights"
    return None


def _download(name: str, revision: str | None) -> Path | None:
    """Download the checkpoint files of repo ``name`` into the cache; None when the hub cannot be
    reached or does not serve the repo (a warning says why)."""
    import httpx2
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    timeout = _hub_timeout_s()
    try:
        # huggingface_hub's shared client waits without limit, and snapshot_download's first call
        # (the repo's revision) passes no timeout: ask it ourselves first, with one, so that an
        # unreachable hub costs ``timeout`` seconds, not the operating system's connect timeout
        HfApi().repo_info(name, revision=revision, timeout=timeout)
        log.info("downloading %s from the Hugging Face hub", name)
        path = Path(snapshot_download(name, revision=revision, allow_patterns=list(CHECKPOINT_PATTERNS),
                                      etag_timeout=timeout))
    except GatedRepoError:
        log.warning("%s is gated on the Hugging Face hub: accept its terms and log in (hf auth login) "
                    "to download it", name)
        return None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        log.info("%s%s is not on the Hugging Face hub", name, f"@{revision}" if revision else "")
        return None
    except (HfHubHTTPError, httpx2.HTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        log.warning("could not download %s from the Hugging Face hub: %s", name, reason)
        return None
    log.info("downloaded %s to %s", name, path)
    return path
