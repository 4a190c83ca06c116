"""A source given as a Hugging Face Hub id (``Qwen/Qwen3-30B-A3B``) instead of a directory.

The id resolves to its snapshot directory in the local Hugging Face cache through huggingface_hub's own cache API
(``snapshot_download`` with ``local_files_only``: ``refs/<revision>`` names the commit, ``snapshots/<commit>`` holds
the files as links into ``blobs/``), offline. ``download`` fetches what is missing through huggingface_hub first:
the files fp4kit reads (``FILES``), not a repository's other weight formats. A path that exists is always a path.
"""

from __future__ import annotations

from pathlib import Path

from fp4kit.errors import Fp4kitError
from fp4kit.io.shard_io import SIDE_FILES

# what fp4kit reads of a model repository: its safetensors, the index and the side files it copies
FILES = ("*.safetensors", "*.safetensors.index.json", *SIDE_FILES)


def is_hub_id(text: str) -> bool:
    """Whether ``text`` can name a Hub repository (``org/name`` or ``name``), by huggingface_hub's own rule."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if text.startswith((".", "~")) or Path(text).is_absolute():
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def hub_cache() -> Path:
    """The Hugging Face cache huggingface_hub uses (``HF_HUB_CACHE``, or ``HF_HOME``/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def resolve_source(source: str | Path, revision: str | None = None, download: bool = False,
                   option: str = "SRC") -> Path:
    """The directory ``source`` names: itself when it exists, else the cached snapshot of Hub id ``source`` at
    ``revision`` (default: the ``main`` branch). ``download``: fetch it through huggingface_hub where the cache lacks
    it. ``option`` names the argument in errors."""
    path = Path(source)
    if path.exists():
        if revision is not None or download:
            flag = "--revision" if revision is not None else "--download"
            raise Fp4kitError(f"{flag}: {option} {path} is a local path, not a Hub id")
        return path
    if not is_hub_id(str(source)):
        return path  # the reader's own error names it
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
    )

    where = f"{source}" + (f" at revision {revision}" if revision else "")
    try:
        found = snapshot_download(str(source), revision=revision, allow_patterns=list(FILES),
                                  local_files_only=not download)
    except IncompleteSnapshotError as error:  # its message names the missing files
        raise Fp4kitError(f"{option} {where}: {str(error).split(' Re-run')[0]}") from None
    except LocalEntryNotFoundError:
        if download:
            raise Fp4kitError(f"{option} {where}: not a directory, and not downloadable now (the Hub cannot be "
                              f"reached) nor in the Hugging Face cache {hub_cache()}") from None
        raise Fp4kitError(f"{option} {where}: not a directory, and not in the Hugging Face cache {hub_cache()} "
                          "(--download fetches it)") from None
    except (HfHubHTTPError, HFValidationError, OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise Fp4kitError(f"{option} {where}: {first_line} (Hugging Face cache {hub_cache()})") from None
    return Path(found)
