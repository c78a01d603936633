"""A model repository: a local folder, or a hub id resolved with huggingface_hub.

:func:`files` finds the ONNX files of a repository in the layout of one of three exporters:

- ``genai`` (onnxruntime-genai): ``genai_config.json`` names the decoder (``model.onnx``), and
  for some models an encoder and an embedding model. The config may lie at the top or in one
  subfolder per variant (``cpu-int4-rtn-block-32/``), which then also holds the tokenizer.
- ``optimum``: ``model.onnx`` or ``decoder_model_merged.onnx`` (+ ``encoder_model.onnx``) at the
  top, with variants such as ``model_quantized.onnx``.
- ``transformers.js`` (onnx-community, Xenova): the same names under ``onnx/``, one file per
  dtype (``onnx/model_q4.onnx``), and ``onnx/embed_tokens*.onnx`` for decoders of embeddings.
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import re
import stat
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .runtime.errors import ModelFileError

SMALL_FILES = ("*.json", "*.jinja", "*.txt", "*.model")
"""The files fetched first from the hub: configs, tokenizer and chat templates."""

_ALIASES = {"q8": "quantized"}  # transformers.js names the "q8" files "_quantized"
_NAME = re.compile(
    r"(model|decoder_model_merged|encoder_model|embed_tokens)(?:_([A-Za-z0-9]+))?\.onnx"
)
_UNMERGED = re.compile(r"decoder(?:_with_past)?_model(?!_merged)(?:_[A-Za-z0-9]+)?\.onnx")
_PRECISIONS = frozenset({"fp32", "fp16", "bf16", "int4", "int8", "uint8", "q4", "q4f16", "q8"})
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclasses.dataclass(frozen=True)
class Files:
    """The ONNX files of a model repository, as local paths.

    Attributes:
        folder: the local folder of the model's config and tokenizer files (for a hub id, in the
            snapshot folder).
        family: the exporter's layout: "genai", "optimum" or "transformers.js".
        decoder: absolute path of the decoder .onnx file.
        encoder: absolute path of the encoder of an encoder-decoder model, else None.
        embed: absolute path of the token embeddings model of a decoder of inputs_embeds, else
            None.
        dtype: the variant chosen: "fp32" (no suffix), "fp16", "q4", "q4f16", "int8", "uint8",
            "quantized", "bnb4", ...; for genai, the precision its folder or file name tells
            ("int4", "fp16", ...) or "default".
    """

    folder: str
    family: str
    decoder: str
    encoder: str | None
    embed: str | None
    dtype: str


@dataclasses.dataclass(frozen=True)
class _Variant:
    """One choice of files, as posix paths relative to the repository."""

    family: str
    folder: str
    decoder: str
    encoder: str | None
    embed: str | None
    dtype: str
    rank: int  # 0 genai at the top, 1 optimum, 2 transformers.js, 3 genai in a subfolder

    @property
    def paths(self) -> list[str]:
        return [p for p in (self.decoder, self.encoder, self.embed) if p]

    def __str__(self) -> str:
        return f"{self.dtype} ({self.decoder})"


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
    return _fetch(path, patterns)


MAX_CONFIG_BYTES = 64 << 20
"""The largest config, generation or preprocessor JSON file read (64 MiB)."""
MAX_TOKENIZER_BYTES = 512 << 20
"""The largest tokenizer.json read (512 MiB)."""
_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a folder"),
)


def _allowed_root(folder: str) -> str:
    """The folder a model file may resolve into: ``folder``, or for a hub cache snapshot
    (``models--org--name/snapshots/<commit>``) the repository's cache folder, whose blobs its
    links name."""
    real = os.path.realpath(folder)
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots":
        return os.path.dirname(parent)
    return real


def read_file(
    path: str | os.PathLike, limit: int = MAX_CONFIG_BYTES, folder: str | None = None
) -> bytes:
    """The bytes of the model file ``path``, read with a bound.

    Args:
        path: the file.
        limit: the most bytes it may hold.
        folder: the model's folder, which the file (after its links) must lie in; by default
            the file's own folder.

    Raises:
        ModelFileError: the file is not a regular file (a FIFO, a device, a folder), a link
            that leads outside the model's folder, larger than ``limit``, or unreadable.
    """
    path = os.fspath(path)
    root = _allowed_root(folder if folder is not None else os.path.dirname(path) or ".")
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise ModelFileError(
            f"{path!r} is a link to {real!r}, outside the model's folder; refusing to read it "
            "(copy the file into the folder)"
        )
    try:
        info = os.stat(real)
        for test, kind in _KINDS:
            if test(info.st_mode):
                raise ModelFileError(f"{path!r} is {kind}, not a regular file; refusing to read it")
        if not stat.S_ISREG(info.st_mode):
            raise ModelFileError(f"{path!r} is not a regular file; refusing to read it")
        if info.st_size > limit:
            raise ModelFileError(
                f"{path!r} holds {info.st_size:,} bytes, more than the limit of {limit:,} for "
                "this file; refusing to read it"
            )
        descriptor = os.open(real, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(descriptor, "rb") as stream:
            if not stat.S_ISREG(os.fstat(stream.fileno()).st_mode):  # swapped since the stat
                raise ModelFileError(f"{path!r} is not a regular file; refusing to read it")
            data = stream.read(limit + 1)
    except OSError as error:
        raise ModelFileError(f"cannot read {path!r}: {error}") from error
    if len(data) > limit:
        raise ModelFileError(
            f"{path!r} holds more than the limit of {limit:,} bytes for this file; refusing to "
            "read it"
        )
    return data


def parse_json(path: str | os.PathLike, folder: str | None = None) -> dict[str, Any]:
    """The JSON object of the model file ``path``, read with :func:`read_file`'s bounds.

    Raises:
        ModelFileError: as :func:`read_file`, or the file is not valid UTF-8 JSON, is nested
            too deep, or does not hold a JSON object.
    """
    path = os.fspath(path)
    data = read_file(path, MAX_CONFIG_BYTES, folder)
    try:
        value = json.loads(data.decode("utf-8"))
    except RecursionError as error:
        raise ModelFileError(
            f"{path!r} is JSON nested too deep to read (more than about "
            f"{sys.getrecursionlimit():,} levels); fix or delete it"
        ) from error
    except (UnicodeDecodeError, ValueError) as error:
        raise ModelFileError(f"{path!r} is not valid JSON: {error}; fix or delete it") from error
    if not isinstance(value, dict):
        raise ModelFileError(
            f"{path!r} must hold a JSON object ({{...}}), not a {type(value).__name__}; "
            "fix or delete it"
        )
    return value


def read_json(repo: str | os.PathLike, name: str) -> dict[str, Any]:
    """The JSON file ``name`` of ``repo``, or {} when it has none.

    A folder that the onnxruntime-genai builder wrote has no config.json or
    generation_config.json: for those names, the equivalents of its ``genai_config.json``
    (:func:`genai_equivalent`).

    Raises:
        ModelFileError: the file is not valid JSON, or not a JSON object, or not a regular file
            inside the folder of at most :data:`MAX_CONFIG_BYTES`.
    """
    if name in GENAI_EQUIVALENTS:
        root = folder(repo, [name, "genai_config.json"])
        if not os.path.lexists(os.path.join(root, name)):
            genai = os.path.join(root, "genai_config.json")
            if os.path.lexists(genai):
                return genai_equivalent(parse_json(genai, root), name)
            return {}
        return parse_json(os.path.join(root, name), root)
    root = folder(repo, [name])
    path = os.path.join(root, name)
    if not os.path.lexists(path):
        return {}
    return parse_json(path, root)


def stands_in(repo: str | os.PathLike, name: str) -> bool:
    """Whether :func:`read_json` gives genai_config.json's equivalent for ``name`` of ``repo``
    (a folder as the onnxruntime-genai builder writes it: ``name`` absent, genai_config.json
    there)."""
    if name not in GENAI_EQUIVALENTS:
        return False
    root = folder(repo, [name, "genai_config.json"])
    return not os.path.lexists(os.path.join(root, name)) and os.path.lexists(
        os.path.join(root, "genai_config.json")
    )


# The search options of genai_config.json that are generation options of the same name.
GENAI_SEARCH = (
    "do_sample",
    "num_beams",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "max_length",
    "min_length",
    "no_repeat_ngram_size",
    "length_penalty",
    "early_stopping",
    "num_return_sequences",
)
GENAI_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
GENAI_EQUIVALENTS = ("config.json", "generation_config.json")
GENAI_VISION_IDS = ("image_token_id", "video_token_id", "vision_start_token_id")
GENAI_VISION = ("spatial_merge_size", "tokens_per_second")  # model.vision -> vision_config


def genai_equivalent(genai: Mapping[str, Any], name: str) -> dict[str, Any]:
    """What ``name`` (config.json or generation_config.json) would say, from a genai_config.json.

    config.json: model_type, vocab_size, the decoder's heads, head size, hidden size and layers,
    context_length as max_position_embeddings, and the token ids; for a vision-language model,
    its image, video and vision-start token ids and ``model.vision``'s spatial_merge_size and
    tokens_per_second (as ``vision_config``). generation_config.json: the token ids and the
    ``search`` options (generation defaults).
    """
    model = genai.get("model") if isinstance(genai.get("model"), Mapping) else {}
    ids = {k: model[k] for k in GENAI_TOKEN_IDS if model.get(k) is not None}
    if name == "generation_config.json":
        search = genai.get("search") if isinstance(genai.get("search"), Mapping) else {}
        return {**{k: search[k] for k in GENAI_SEARCH if k in search}, **ids}
    decoder = model.get("decoder") if isinstance(model.get("decoder"), Mapping) else {}
    config: dict[str, Any] = {}
    fields = {
        "model_type": model.get("type"),
        "vocab_size": model.get("vocab_size"),
        "max_position_embeddings": model.get("context_length"),
        "num_attention_heads": decoder.get("num_attention_heads"),
        "num_key_value_heads": decoder.get("num_key_value_heads"),
        "head_dim": decoder.get("head_size"),
        "hidden_size": decoder.get("hidden_size"),
        "num_hidden_layers": decoder.get("num_hidden_layers"),
    }
    config.update({k: v for k, v in fields.items() if v is not None})
    # a vision-language folder (Olive's recipe): its token ids and the vision section's merge
    config.update({k: model[k] for k in GENAI_VISION_IDS if model.get(k) is not None})
    vision = model.get("vision") if isinstance(model.get("vision"), Mapping) else {}
    merge = {k: vision[k] for k in GENAI_VISION if vision.get(k) is not None}
    if merge:
        config["vision_config"] = merge
    return {**config, **ids}


MAX_VOCAB = (1 << 31) - 1
"""The largest vocabulary a config may declare (token ids are int32 on the device)."""


def vocab_size(config: Mapping[str, Any]) -> int | None:
    """The ``vocab_size`` of a model's config (its ``text_config``'s first), or None when it
    declares none (absent or null).

    Raises:
        ModelFileError: the value is not a whole number from 1 to :data:`MAX_VOCAB` (0, negative,
            a string, a fraction, a bool), naming it.
    """
    text = config.get("text_config")
    sources = [text, config] if isinstance(text, Mapping) else [config]
    for source in sources:
        value = source.get("vocab_size")
        if value is None:
            continue
        whole = isinstance(value, int) and not isinstance(value, bool)
        if not whole or not 1 <= value <= MAX_VOCAB:
            where = "text_config.vocab_size" if source is text else "vocab_size"
            raise ModelFileError(
                f"the model's config (config.json, or genai_config.json's model.vocab_size) has "
                f"{where} {value!r}; it must be a whole number from 1 to {MAX_VOCAB:,} (the "
                "size of the vocabulary): fix the file"
            )
        return value
    return None


def files(repo: str | os.PathLike, *, dtype: str | None = None, file: str | None = None) -> Files:
    """The ONNX files of ``repo``: its decoder, and its encoder or embeddings model if any.

    For a hub id, fetches :data:`SMALL_FILES` first, lists the repository's files (those of the
    cached snapshot when ``HF_HUB_OFFLINE=1`` or the hub cannot be reached), then fetches the
    chosen .onnx files and their external data (``X.onnx_data*``, ``X.onnx.data*``).

    Args:
        repo: a local folder, or a hub id ("org/name").
        dtype: the variant: None picks the genai folder at the top, else the fp32 files (no
            suffix); "q4" picks the ``_q4`` files, "q8" the ``_quantized`` ones; for genai
            subfolders, the precision their name tells ("int4", "fp16", ...).
        file: the decoder, relative to the repository, instead of the one chosen; the encoder
            and embeddings beside it are those of ``dtype``, else of the decoder's suffix.

    Raises:
        ModelFileError: no decoder, or none of ``dtype``, or several, or a missing companion,
            or a decoder split in two (``decoder_model.onnx`` + ``decoder_with_past_model.onnx``)
            without the merged one.
        ValueError: a bad argument, or a hub id neither cached nor on the hub.
    """
    path = os.fspath(repo)
    for name, value in (("dtype", dtype), ("file", file)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ValueError(f"{name} must be None or a non-empty string, not {value!r}")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path!r} is a file, not a model folder; pass its folder and file=")
    local = os.path.isdir(path)
    root = path if local else _fetch(path, SMALL_FILES, partial=True)
    names = _local_names(root) if local else _hub_names(path, root)
    if file is not None:
        chosen = _explicit(path, root, names, file, dtype)
    else:
        chosen = _choose(path, root, names, dtype)
    if not local:
        commit = os.path.basename(os.path.normpath(root))
        patterns = [p for name in chosen.paths for p in (name, name + "_data*", name + ".data*")]
        try:
            root = _fetch(path, patterns, revision=commit if _COMMIT.fullmatch(commit) else None)
        except ValueError as error:
            raise ModelFileError(
                f"{path!r}: cannot fetch {', '.join(chosen.paths)} and their external data: "
                f"{error.__cause__ or error}"
            ) from error
    missing = [p for p in chosen.paths if not os.path.isfile(os.path.join(root, p))]
    if missing:
        raise ModelFileError(
            f"{path!r} lacks {', '.join(missing)} of its {chosen.family} layout in {root!r}; "
            f"its .onnx files: {_onnx_files(names)}"
        )

    def local_path(name: str | None) -> str | None:
        return os.path.abspath(os.path.join(root, name)) if name else None

    return Files(
        folder=os.path.abspath(os.path.join(root, chosen.folder)),
        family=chosen.family,
        decoder=os.path.abspath(os.path.join(root, chosen.decoder)),
        encoder=local_path(chosen.encoder),
        embed=local_path(chosen.embed),
        dtype=chosen.dtype,
    )


def _not_a_folder(path: str) -> None:
    """Refuses a path that names a local folder that does not exist (it is no hub id)."""
    if os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1:
        raise ModelFileError(f"no model folder {path!r}")


def _fetch(
    path: str, patterns: Sequence[str] | None, *, partial: bool = False, revision: str | None = None
) -> str:
    """The snapshot folder of hub id ``path`` with the files of ``patterns``.

    With ``partial``, a cached snapshot that lacks some of them is returned (offline).
    """
    from huggingface_hub import snapshot_download

    _not_a_folder(path)
    allow = list(patterns) if patterns else None
    try:
        return snapshot_download(path, allow_patterns=allow, revision=revision)
    except Exception as error:  # noqa: BLE001 - name the repo whatever the hub said
        snapshot = getattr(error, "snapshot_path", None)  # IncompleteSnapshotError
        if partial and snapshot and os.path.isdir(snapshot):
            return os.fspath(snapshot)
        why = str(error)
        if type(error).__name__ == "LocalEntryNotFoundError":
            why = "not in the local hub cache, and the hub is offline (HF_HUB_OFFLINE=1)"
        raise ValueError(f"cannot find model {path!r} locally or on the hub: {why}") from error


def _local_names(root: str) -> list[str]:
    """The files under ``root`` as sorted posix paths, without hidden folders or broken links."""
    names = []
    for directory, subfolders, filenames in os.walk(root):
        subfolders[:] = [d for d in subfolders if not d.startswith(".")]
        relative = os.path.relpath(directory, root).replace(os.sep, "/")
        for name in filenames:
            if os.path.exists(os.path.join(directory, name)):
                names.append(posixpath.normpath(posixpath.join(relative, name)))
    return sorted(names)


def _hub_names(repo: str, root: str) -> list[str]:
    """The files of hub id ``repo``; offline or unreachable, those of its snapshot ``root``."""
    from huggingface_hub import HfApi, constants

    if not constants.HF_HUB_OFFLINE:
        commit = os.path.basename(os.path.normpath(root))
        revision = commit if _COMMIT.fullmatch(commit) else None
        try:
            return sorted(HfApi().list_repo_files(repo, revision=revision))
        except Exception:  # noqa: BLE001 - whatever failed, the cached files are what is left
            pass
    return _local_names(root)


def _dtype(suffix: str) -> str:
    return suffix or "fp32"


def _suffix(dtype: str) -> str:
    dtype = _ALIASES.get(dtype, dtype)
    return "" if dtype == "fp32" else dtype


def _precision(path: str) -> str:
    """The precision a genai folder or file name tells ("int4" of cpu-int4-rtn), or "default"."""
    for token in re.split(r"[-_./]", path.lower()):
        if token in _PRECISIONS:
            return token
    return "default"


def _onnx_files(names: Iterable[str]) -> str:
    found = [n for n in names if n.endswith(".onnx")]
    return ", ".join(found) if found else "none"


def _genai(repo: str, root: str, config_path: str, rank: int, decoder: str | None) -> _Variant:
    """The files that genai config ``config_path`` names (its decoder, unless ``decoder``)."""
    model = parse_json(os.path.join(root, config_path), root).get("model", {})
    directory = posixpath.dirname(config_path)
    if not isinstance(model, dict):
        raise ModelFileError(f"{repo!r}: {config_path} has a 'model' that is not an object")

    def named(section: str) -> str | None:
        entry = model.get(section)
        filename = entry.get("filename") if isinstance(entry, dict) else None
        if not filename:
            return None
        return _inside(repo, config_path, f"model.{section}.filename", directory, filename)

    decoder = decoder or named("decoder") or posixpath.join(directory, "model.onnx")
    precision = _precision(decoder)
    return _Variant(
        "genai", directory, decoder, named("encoder"), named("embedding"), precision, rank
    )


def _inside(repo: str, config_path: str, field: str, directory: str, filename: object) -> str:
    """``filename`` of ``config_path``, relative to the repository; refused if it leaves it."""
    if not isinstance(filename, str):
        raise ModelFileError(f"{repo!r}: {field} of {config_path} must be a file name")
    path = posixpath.normpath(posixpath.join(directory, filename.replace("\\", "/")))
    if posixpath.isabs(filename) or os.path.isabs(filename) or path.split("/")[0] == "..":
        raise ModelFileError(
            f"{repo!r}: {field} of {config_path} is {filename!r}, which lies outside the model's "
            "folder; refusing to load it (name a file inside the folder)"
        )
    return path


def _layouts(directory: str, names: Sequence[str]) -> tuple[dict[str, dict[str, str]], list[str]]:
    """The optimum names in ``directory``: {kind: {suffix: path}}, and split decoders."""
    found: dict[str, dict[str, str]] = {}
    unmerged = []
    for name in names:
        if posixpath.dirname(name) != directory:
            continue
        base = posixpath.basename(name)
        match = _NAME.fullmatch(base)
        if match:
            found.setdefault(match[1], {})[match[2] or ""] = name
        elif _UNMERGED.fullmatch(base):
            unmerged.append(name)
    return found, unmerged


def _companions(
    repo: str, found: dict[str, dict[str, str]], suffix: str, decoder: str
) -> tuple[str | None, str | None]:
    """The encoder and embeddings of ``suffix`` beside ``decoder``, where its folder has some."""
    chosen = []
    for kind in ("encoder_model", "embed_tokens"):
        have = found.get(kind, {})
        if have and suffix not in have:
            variants = ", ".join(f"{_dtype(s)} ({p})" for s, p in sorted(have.items()))
            raise ModelFileError(
                f"{repo!r}: the decoder {decoder} needs {kind}{'_' + suffix if suffix else ''}"
                f".onnx beside it, which is missing; {kind} variants: {variants}"
            )
        chosen.append(have.get(suffix))
    return chosen[0], chosen[1]


def _optimum(
    repo: str, directory: str, family: str, rank: int, names: Sequence[str]
) -> tuple[list[_Variant], list[str], list[str]]:
    """The complete variants of ``directory``, the incomplete ones, and its split decoders."""
    found, unmerged = _layouts(directory, names)
    decoders = {**found.get("decoder_model_merged", {}), **found.get("model", {})}
    variants, incomplete = [], []
    for suffix in sorted(decoders, key=lambda s: (s != "", s)):
        try:
            encoder, embed = _companions(repo, found, suffix, decoders[suffix])
        except ModelFileError:
            incomplete.append(f"{_dtype(suffix)} ({decoders[suffix]}, lacking its companions)")
            continue
        variants.append(
            _Variant(family, "", decoders[suffix], encoder, embed, _dtype(suffix), rank)
        )
    return variants, incomplete, unmerged


def _choose(repo: str, root: str, names: Sequence[str], dtype: str | None) -> _Variant:
    """The variant of ``dtype`` among the layouts found in ``names``."""
    configs = [n for n in names if posixpath.basename(n) == "genai_config.json"]
    variants: list[_Variant] = []
    incomplete: list[str] = []
    unmerged: list[str] = []
    if "genai_config.json" in configs:
        genai = _genai(repo, root, "genai_config.json", 0, None)
        variants.append(genai)
        # optimum's names at the top beside the genai config's own files: a second layout
        others = [n for n in names if n not in genai.paths]
        variants += _optimum(repo, "", "optimum", 1, others)[0]
    else:
        found, notes, split = _optimum(repo, "", "optimum", 1, names)
        variants += found
        incomplete += notes
        unmerged += split
    found, notes, split = _optimum(repo, "onnx", "transformers.js", 2, names)
    variants += found
    incomplete += notes
    unmerged += split
    variants += [_genai(repo, root, c, 3, None) for c in configs if c != "genai_config.json"]
    if not variants:
        if unmerged and not any("with_past" in posixpath.basename(n) for n in unmerged):
            raise ModelFileError(
                f"{repo!r} has only a decoder without a KV cache ({', '.join(unmerged)}), as "
                "optimum exports BERT and RoBERTa decoders: this engine runs decoders that take "
                "and return past key values (a merged decoder, decoder_model_merged.onnx)"
            )
        if unmerged:
            raise ModelFileError(
                f"{repo!r} has a decoder split in two ({', '.join(unmerged)}) and no merged "
                "decoder (decoder_model_merged.onnx), which is needed: re-export the model with "
                "optimum's default (optimum-cli export onnx without --no-post-process), which "
                "merges them"
            )
        lacking = f"; incomplete variants: {'; '.join(incomplete)}" if incomplete else ""
        raise ModelFileError(
            f"{repo!r} has no decoder: looked for genai_config.json, model[_<dtype>].onnx and "
            "decoder_model_merged[_<dtype>].onnx at the top and under onnx/; its .onnx files: "
            f"{_onnx_files(names)}{lacking}"
        )
    available = ", ".join(str(v) for v in variants)
    if incomplete:
        available += f"; incomplete: {'; '.join(incomplete)}"
    if dtype is None:
        matches = [v for v in variants if v.rank == 0 or v.dtype == "fp32"]
        if not matches and len(variants) == 1 and variants[0].family == "genai":
            matches = variants
        if not matches:
            raise ModelFileError(
                f"{repo!r} has no fp32 decoder (model.onnx or decoder_model_merged.onnx, at the "
                f"top or under onnx/); pass dtype= one of its variants: {available}"
            )
    else:
        want = _ALIASES.get(dtype, dtype)
        matches = [v for v in variants if v.dtype == want]
        if not matches:
            hint = ""
            if any(v.family == "genai" and v.dtype == "default" for v in variants):
                hint = " (a genai folder's dtype is the precision its name tells, else 'default')"
            raise ModelFileError(
                f"{repo!r} has no decoder of dtype {dtype!r}; its variants: {available}{hint}"
            )
    layouts = sorted({v.rank for v in matches})
    if len(layouts) > 1:
        _refuse_layouts(repo, [v for v in matches if v.rank in layouts], dtype)
    best = [v for v in matches if v.rank == matches[0].rank]
    if len(best) > 1:
        raise ModelFileError(
            f"{repo!r} has several decoders of dtype {dtype or 'fp32'!r}: "
            f"{', '.join(v.decoder for v in best)}; pass file= to name one"
        )
    return best[0]


_PLACES = {0: "at the top", 1: "at the top", 2: "under onnx/", 3: "in a subfolder"}


def _refuse_layouts(repo: str, matches: Sequence[_Variant], dtype: str | None) -> None:
    """Refuses a folder that holds decoders of ``dtype`` in more than one exporter's layout:
    their config and tokenizer files may belong to different models, and no rule can tell
    which one the caller means."""
    found = "; ".join(f"{v.family} {_PLACES[v.rank]} ({v.decoder})" for v in matches)
    wanted = f"of dtype {dtype!r}" if dtype else "of the default choice (genai, else fp32)"
    raise ModelFileError(
        f"{repo!r} holds several layouts at once, each with a decoder {wanted}: {found}. Its "
        "config and tokenizer files may belong to only one of them; pass file= (--file) to name "
        "the decoder to use, or keep one layout per folder"
    )


def _explicit(repo: str, root: str, names: Sequence[str], file: str, dtype: str | None) -> _Variant:
    """The variant of the decoder ``file``, with the companions of ``dtype`` beside it."""
    path = posixpath.normpath(file.replace(os.sep, "/"))
    if posixpath.isabs(path) or path.split("/")[0] == "..":
        raise ValueError(f"file={file!r} must be a path inside {repo!r}, relative to it")
    if path not in names:
        raise ModelFileError(
            f"{repo!r} has no file {file!r}; its .onnx files: {_onnx_files(names)}"
        )
    directory = posixpath.dirname(path)
    config = posixpath.join(directory, "genai_config.json")
    if config in names:
        variant = _genai(repo, root, config, 0, path)
        if dtype is not None and _ALIASES.get(dtype, dtype) != variant.dtype:
            raise ModelFileError(
                f"{repo!r}: the genai decoder {path} is of dtype {variant.dtype!r}, not {dtype!r}"
            )
        return variant
    found, _ = _layouts(directory, names)
    match = _NAME.fullmatch(posixpath.basename(path))
    named = match is not None and match[1] in ("model", "decoder_model_merged")
    suffix = (match[2] or "") if named else None
    companion = _suffix(dtype) if dtype is not None else (suffix or "")
    encoder, embed = _companions(repo, found, companion, path)
    family = "transformers.js" if path.split("/")[0] == "onnx" else "optimum"
    variant = _dtype(suffix or "") if named else "default"
    return _Variant(family, "", path, encoder, embed, variant, 0)
