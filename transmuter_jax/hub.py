"""A model repository: a local folder, or a hub id resolved with huggingface_hub."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any


def folder(repo: str | os.PathLike, patterns: Sequence[str] | None = None) -> str:
    """The local folder of ``repo``.

    Args:
        repo: a local folder, or a hub id ("org/name") fetched with ``snapshot_download`` (from
            the local cache when ``HF_HUB_OFFLINE=1``).
        patterns: the files to fetch for a hub id (glob patterns); all files when None.
    """
    path = os.fspath(repo)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise ValueError(f"{path!r} is a file, not a model folder")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(path, allow_patterns=list(patterns) if patterns else None)
    except Exception as error:  # noqa: BLE001 - name the repo whatever the hub said
        raise ValueError(f"cannot find model {path!r} locally or on the hub: {error}") from error


def read_json(repo: str | os.PathLike, name: str) -> dict[str, Any]:
    """The JSON file ``name`` of ``repo``, or {} when it has none."""
    path = os.path.join(folder(repo, [name]), name)
    if not os.path.exists(path):
        return {}
    with open(path) as file:
        return json.load(file)
