"""The model a command runs and the tokenizer it reads text with, from ``--hf DIR`` or ``--checkpoint DIR``: one
way for every experiment (generate, analyze_routing, check_logits, convert). A Hugging Face folder or tokenizer may
also be a Hub id ``ORG/NAME[@REVISION]``, read from the Hub's cache (:mod:`eqmoe.data.hub`).

A Hugging Face folder is read by its family (:func:`eqmoe.checkpoints.hf.load`); an eqmoe checkpoint (``convert``
output or a training run's ``checkpoints``) by :func:`eqmoe.checkpoints.model_checkpoint.load_model`, with the
:class:`RunMetadata` it recorded. The tokenizer is the one named, else the folder's own (its ``tokenizer.json``, else
its ``tiktoken.model``: :func:`eqmoe.data.tokenizer.tokenizer_file`), else the one the run recorded (with the chat
template and template variables it trained with), else eqmoe's byte tokenizer when the run trained on bytes.
"""

import os
from pathlib import Path
from typing import NamedTuple

from eqmoe.checkpoints import hf
from eqmoe.checkpoints.model_checkpoint import load_model
from eqmoe.checkpoints.run_metadata import RunMetadata
from eqmoe.data import ByteTokenizer, HFTokenizer, load_tokenizer
from eqmoe.data.hub import resolve_folder
from eqmoe.data.tokenizer import TOKENIZER_FILE_NAMES, tokenizer_file
from eqmoe.model import Transformer


class ModelSource(NamedTuple):
    model: Transformer
    folder: Path  # where its tokenizer and generation settings sit
    metadata: RunMetadata | None  # what an eqmoe checkpoint recorded (None: a Hugging Face folder)


def load_source(
    *,
    hf_folder: str | os.PathLike | None = None,
    checkpoint: str | os.PathLike | None = None,
    step: int | None = None,
    base: str | os.PathLike | None = None,
    dtype: str | None = None,
) -> ModelSource:
    """The model of exactly one of ``hf_folder`` or ``checkpoint`` (``step``: default the latest; ``base``: its base
    model where it moved), its parameters and compute in ``dtype`` (default: as stored, which for a Hugging Face
    folder is the dtype its ``config.json`` declares). ``ValueError`` / ``FileNotFoundError`` in one line otherwise."""
    if (hf_folder is None) == (checkpoint is None):
        raise ValueError("give one of --hf DIR (a Hugging Face folder) or --checkpoint DIR (an eqmoe checkpoint)")
    folder = resolve_folder(hf_folder) if hf_folder is not None else Path(checkpoint)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: model folder not found")
    if step is not None and checkpoint is None:
        raise ValueError("--step goes with --checkpoint")
    if hf_folder is not None:
        return ModelSource(hf.load(folder, dtype=dtype), folder, None)
    model, metadata = load_model(folder, step=step, dtype=dtype, base=base)
    return ModelSource(model, folder, metadata)


def source_tokenizer(
    source: ModelSource, tokenizer: str | os.PathLike | None = None, **options
) -> HFTokenizer | ByteTokenizer:
    """The tokenizer to read and write ``source``'s text with: :func:`folder_tokenizer` of its folder and record, with
    its keyword ``options``."""
    return folder_tokenizer(source.folder, source.metadata, tokenizer, **options)


def folder_tokenizer(
    folder: Path,
    recorded: RunMetadata | None,
    tokenizer: str | os.PathLike | None = None,
    *,
    chat: bool = True,
    chat_template: str | os.PathLike | None = None,
    template_vars: dict | None = None,
    bytes_if_none: bool = False,
) -> HFTokenizer | ByteTokenizer:
    """The tokenizer of the model in ``folder`` whose run recorded ``recorded`` (``None``: a Hugging Face folder),
    found without reading the model (see the module docstring), with the chat template and variables given or else
    those the run recorded (with ``chat`` only: text read without a template needs none, so a moved template file
    does not stop it). ``bytes_if_none``: eqmoe's byte tokenizer when nothing names one (else a
    ``FileNotFoundError`` saying to pass ``--tokenizer``)."""
    variables = dict(template_vars or {})
    if chat and recorded is not None:
        variables = {**recorded.template_vars, **variables}
        if chat_template is None and recorded.chat_template:
            chat_template = recorded.chat_template
    path = None if tokenizer is None else resolve_folder(tokenizer, files="tokenizer")
    if path is None and tokenizer_file(folder) is not None:
        path = folder
    if path is None and recorded is not None and recorded.tokenizer is not None:
        path = Path(recorded.tokenizer)
    if path is None and not (bytes_if_none or (recorded is not None and recorded.bytes_tokenizer)):
        raise FileNotFoundError(
            f"{folder}: no tokenizer in this folder (looked for {' and '.join(TOKENIZER_FILE_NAMES)}; "
            "pass --tokenizer DIR or a tokenizer file)"
        )
    if path is not None and not path.exists():
        raise FileNotFoundError(f"{path}: tokenizer not found (pass --tokenizer DIR or a tokenizer file)")
    return load_tokenizer(path, chat=chat, chat_template=chat_template, template_vars=variables)
