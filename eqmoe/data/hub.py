"""Hugging Face Hub ids wherever a model or tokenizer folder is typed: ``Qwen/Qwen3-30B-A3B`` or
``Qwen/Qwen3-30B-A3B@REVISION`` (a branch, tag or commit hash) is the snapshot ``huggingface_hub`` keeps in its
cache (``HF_HUB_CACHE``, else ``$HF_HOME/hub``), downloaded there first when missing. With ``HF_HUB_OFFLINE=1``
nothing is fetched and a cached snapshot is used as it is.

Only the files eqmoe reads are fetched: configs, tokenizer files (``tokenizer.json``, or ``tiktoken.model`` with
the ``tokenization_*.py`` transformers reads it with), chat templates and the safetensors weights of the top folder
(never a subfolder's weights or Mistral's ``consolidated`` copy of them); a tokenizer alone needs no weights.
This lives in ``eqmoe.data`` rather than beside the checkpoint readers because the tokenizer loader resolves ids
too, and ``eqmoe.data`` imports nothing above it.
"""

import os
import re
import sys
from pathlib import Path
from typing import Literal

ID_FORM = "ORG/NAME[@REVISION]"
_HUB_ID = re.compile(r"(?P<repo>[^/@\s]+/[^/@\s]+)(?:@(?P<revision>[^@\s]+))?")

# tiktoken.model: the Kimi family's tokenizer (no tokenizer.json); tokenization_*.py: the transformers code reading it,
# never run by eqmoe, carried into exports so that transformers (trust_remote_code) reads them as it read the source.
TIKTOKEN_FILES = ("tiktoken.model", "tokenization_*.py")
MODEL_FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model", *TIKTOKEN_FILES)
TOKENIZER_FILES = (
    "tokenizer.json",
    *TIKTOKEN_FILES,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "*.jinja",
)
_NEVER_READ = ("*/*.safetensors", "consolidated*")


def resolve_folder(source: str | os.PathLike, *, files: Literal["model", "tokenizer"] = "model") -> Path:
    """The local folder ``source`` names: ``source`` itself when it is on disk or does not look like a Hub id
    ``ORG/NAME[@REVISION]`` (the caller says what it needed), else the Hub snapshot holding its ``files`` (the model's
    weights, configs and tokenizer, or the tokenizer alone). ``FileNotFoundError`` or ``ValueError`` in one line
    when the id cannot be resolved."""
    path = Path(source)
    match = _HUB_ID.fullmatch(os.fspath(source))
    if match is None or path.exists():
        return path
    return _snapshot(os.fspath(source), match["repo"], match["revision"], files)


def _snapshot(source: str, repo: str, revision: str | None, files: str) -> Path:
    from huggingface_hub import constants, errors, snapshot_download

    # httpx errors (a proxy, a reset connection) are not OSErrors; which library huggingface_hub uses varies.
    network = tuple(module.HTTPError for module in map(sys.modules.get, ("httpx", "httpx2")) if module is not None)
    try:
        folder = snapshot_download(
            repo,
            revision=revision,
            allow_patterns=list(MODEL_FILES if files == "model" else TOKENIZER_FILES),
            ignore_patterns=list(_NEVER_READ),
        )
    except errors.HFValidationError:
        raise ValueError(f"{source}: no such folder, and not a Hub id {ID_FORM}") from None
    except errors.RevisionNotFoundError:
        raise FileNotFoundError(f"{source}: {repo} has no revision {revision!r} on the Hugging Face Hub") from None
    except errors.GatedRepoError:
        raise FileNotFoundError(
            f"{source}: a gated model: accept its terms on the Hugging Face Hub, then log in (hf auth login, HF_TOKEN)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise FileNotFoundError(
            f"{source}: no such folder, and no model {repo} on the Hugging Face Hub "
            "(a private one needs hf auth login or HF_TOKEN)"
        ) from None
    except errors.LocalEntryNotFoundError as error:
        if type(error).__name__ == "IncompleteSnapshotError":
            raise FileNotFoundError(
                f"{source}: only part of it is in the Hugging Face cache and the Hub cannot be reached; "
                "run once online to finish the download"
            ) from None
        if constants.HF_HUB_OFFLINE:
            raise FileNotFoundError(
                f"{source}: no such folder, and not in the Hugging Face cache (HF_HUB_OFFLINE=1); "
                "run once online or pass a folder"
            ) from None
        raise FileNotFoundError(
            f"{source}: no such folder, not in the Hugging Face cache, and the Hub cannot be reached "
            f"({_first_line(error.__cause__ or error)})"
        ) from None
    except (OSError, *network) as error:
        raise FileNotFoundError(
            f"{source}: cannot be fetched from the Hugging Face Hub ({_first_line(error)})"
        ) from None
    return Path(folder)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
