"""Models by Hugging Face Hub id (`org/name`, `org/name:file.gguf`): downloaded, then converted once.

`huggingface_hub.snapshot_download` fetches only the files jserve reads (the safetensors the index
names, config, generation config and tokenizer files; or the one GGUF file) into its cache
(`--download-dir`, else HF_HUB_CACHE / HF_HOME), honouring HF_TOKEN and HF_HUB_OFFLINE, with its
progress bar. `jserve.model.checkpoint.resolve_model` converts the snapshot into
`<checkpoint root>/hub/<org>--<name>/<commit>/<variant>` (`checkpoint_dir`). A failure is one
line naming the id and what to do (`HubError`, a ValueError).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

__all__ = ["HubError", "HubModel", "TOKENIZER_FILES", "checkpoint_dir", "download", "download_tokenizer",
           "download_weights", "parse_hub_id"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")
_CONFIG_FILES = ("config.json", *TOKENIZER_FILES)
_INDEX = "model.safetensors.index.json"
# The Hub's repo id rules (huggingface_hub.utils.validate_repo_id): letters, digits, - _ . ; no -- or ..
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
_LOCAL_SUFFIXES = (".gguf", ".json", ".safetensors")  # a missing file, not a repo


class HubError(ValueError):
    """A model could not be fetched from the Hub; the message names the id and what to do."""


@dataclasses.dataclass(frozen=True)
class HubModel:
    """A Hub model: its repo id and, for a GGUF repo, the one file served."""

    repo_id: str
    gguf_file: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f":{self.gguf_file}" if self.gguf_file else "")


def parse_hub_id(spec: str | os.PathLike | None, gguf_file: str | None = None) -> HubModel | None:
    """The Hub model `spec` names (`org/name`, `org/name:file.gguf`), or None if it does not look
    like one. The caller has ruled out local paths and named models."""
    if spec is None or isinstance(spec, os.PathLike):
        return None
    repo_id, _, file = str(spec).partition(":")
    if not _REPO_ID.fullmatch(repo_id) or "--" in repo_id or ".." in repo_id or repo_id.endswith(
            (".", "-", *_LOCAL_SUFFIXES)):
        return None
    if file and gguf_file and file != gguf_file:
        raise HubError(f"{spec!r} names the GGUF file {file!r} but gguf_file is {gguf_file!r}: give one")
    file = file or gguf_file
    if file and not file.endswith(".gguf"):
        raise HubError(f"{spec!r}: the file after ':' must be a .gguf file, got {file!r}")
    return HubModel(repo_id, file or None)


def download(model: HubModel, *, revision: str | None = None, download_dir: str | os.PathLike | None = None,
             weights: bool = True) -> Path:
    """The local snapshot folder of `model` at `revision` (default: main), its name the commit hash;
    with `weights` False only its config and tokenizer files (a GGUF repo's file all the same)."""
    if model.gguf_file is not None:
        folder = _snapshot(model, revision, download_dir, [model.gguf_file])
        if not (folder / model.gguf_file).is_file():
            raise HubError(f"{model.repo_id} (commit {folder.name}) has no file {model.gguf_file!r}: "
                           f"name one of its .gguf files (https://huggingface.co/{model.repo_id}/tree/main)")
        return folder
    folder = _snapshot(model, revision, download_dir, [*_CONFIG_FILES, _INDEX])
    if not (folder / "config.json").is_file():
        raise HubError(f"{model.repo_id} has no config.json: for a GGUF repo name its file "
                       f"({model.repo_id}:FILE.gguf or --gguf-file FILE.gguf)")
    return download_weights(model, folder, download_dir=download_dir) if weights else folder


def download_weights(model: HubModel, snapshot: Path, *, download_dir: str | os.PathLike | None = None) -> Path:
    """`snapshot` (a folder `download(weights=False)` gave) with its weights: the safetensors its
    index names (not a repo's other copies, as Mistral's consolidated.safetensors), else all."""
    index = snapshot / _INDEX
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "*.safetensors"]
    folder = _snapshot(model, snapshot.name, download_dir, files)  # the same commit
    missing = [f for f in files if "*" not in f and not (folder / f).is_file()]
    if missing or not any(folder.glob("*.safetensors")):
        raise HubError(f"the cached snapshot of {model.repo_id} (commit {folder.name}) lacks its weights "
                       f"({', '.join(missing) or '*.safetensors'}): run once online to download them")
    return folder


def download_tokenizer(model: HubModel, *, download_dir: str | os.PathLike | None = None) -> Path:
    """The snapshot folder of a tokenizer's Hub repo (`--tokenizer ID`): its tokenizer files only."""
    folder = _snapshot(model, None, download_dir, list(TOKENIZER_FILES))
    if not ((folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file()):
        raise HubError(f"{model.repo_id} has no tokenizer.json or tokenizer.model: give another tokenizer")
    return folder


def checkpoint_dir(root: Path, model: HubModel, commit: str, dtype: str, keep_quantized: bool) -> Path:
    """Where a Hub model's conversion goes: keyed by repo, commit, file, dtype and quantization."""
    variant = (Path(model.gguf_file).stem + "-" if model.gguf_file else "") + dtype + ("-gguf" if keep_quantized
                                                                                      else "")
    return root / "hub" / model.repo_id.replace("/", "--") / commit / variant


def _snapshot(model: HubModel, revision: str | None, download_dir: str | os.PathLike | None,
              patterns: list[str]) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    rid = model.repo_id
    at = f" at revision {revision!r}" if revision not in (None, "main") else ""
    try:
        return Path(snapshot_download(rid, revision=revision, cache_dir=download_dir, allow_patterns=patterns))
    except GatedRepoError:
        raise HubError(f"{rid} is gated: accept the license at https://huggingface.co/{rid} and set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise HubError(f"{rid} has no revision {revision!r}: give --revision a branch, tag or commit hash "
                       f"that exists (https://huggingface.co/{rid}/tree/main)") from None
    except RepositoryNotFoundError:
        raise HubError(f"model {rid!r} is not a local path, and the Hugging Face Hub has no model {rid} (a "
                       f"private one needs HF_TOKEN): check the id, or pass a folder or .gguf file") from None
    except LocalEntryNotFoundError as e:
        cache = Path(download_dir or constants.HF_HUB_CACHE).expanduser()
        if type(e).__name__ == "IncompleteSnapshotError":  # (newer huggingface_hub: a partial download)
            raise HubError(f"the cached snapshot of {rid}{at} in {cache} is incomplete: run once online to finish "
                           f"downloading it") from None
        if constants.HF_HUB_OFFLINE:
            raise HubError(f"HF_HUB_OFFLINE is set and {rid}{at} is not in the cache {cache}; run once online or "
                           f"pass a folder") from None
        raise HubError(f"the Hugging Face Hub cannot be reached and {rid}{at} is not in the cache {cache}: check "
                       f"the network (HF_ENDPOINT, proxies), or pass a folder") from None
    except HfHubHTTPError as e:
        raise HubError(f"downloading {rid}{at} failed: {str(e).splitlines()[0]}") from None
