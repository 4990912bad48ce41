"""Tokenizers: a file-free byte tokenizer and a Hugging Face tokenizer folder, each with its chat template.

A folder's tokenizer is its ``tokenizer.json`` (:class:`HFTokenizer`), else its ``tiktoken.model``
(:class:`TiktokenTokenizer`: the Kimi family, whose folders ship no ``tokenizer.json``); a folder with neither is
refused, naming both.

Both follow the :class:`Tokenizer` protocol used by :mod:`eqmoe.data.chat`: ``encode(text)`` returns ids
without added special tokens (a special token spelled out in the text is that token, as in Hugging Face's
``tokenizers``), ``encode_with_offsets`` adds each token's ``[start, end)`` character span, ``decode(ids)``
renders special tokens as their strings, ``chat_template`` renders conversations (:mod:`eqmoe.data.template`)
and ``stop_ids`` are the ids generation stops on besides the template's end of turn (``generation_config.json``'s
``eos_token_id``). ``<|endoftext|>`` is the document delimiter (``bos_id`` and ``eos_id``, as in Qwen).

:class:`ByteTokenizer` needs no files: ids ``0..255`` are the UTF-8 bytes, then ``<|pad|>`` (256),
``<|endoftext|>`` (257), ``<|im_start|>`` (258) and ``<|im_end|>`` (259); ``vocab_size`` is 260. Its
template is the built-in ChatML.

This module finds and loads a tokenizer and checks that it fits a model's vocabulary; the kinds live in
:mod:`eqmoe.data.tokenizers` (``base``: the protocol; ``byte``; ``hf``: both folder kinds; ``tiktoken_model``:
reading a ``tiktoken.model``), their names importable from here too.
"""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eqmoe.data.hub import resolve_folder
from eqmoe.data.template import CHATML, ChatTemplate, folder_template, read_template_file, special_tokens
from eqmoe.data.tokenizers.base import CHAT_SPECIALS, ENDOFTEXT, IM_END, IM_START, PAD, Tokenizer, read_json
from eqmoe.data.tokenizers.byte import ByteTokenizer
from eqmoe.data.tokenizers.hf import HFTokenizer, TiktokenTokenizer, read_tokenizer_json
from eqmoe.data.tokenizers.tiktoken_model import KIMI_PATTERN, RESERVED_SPECIALS, TIKTOKEN_FILE, read_tiktoken

__all__ = [
    "CHAT_SPECIALS",
    "ENDOFTEXT",
    "IM_END",
    "IM_START",
    "KIMI_PATTERN",
    "PAD",
    "RESERVED_SPECIALS",
    "TIKTOKEN_FILE",
    "TOKENIZER_FILE_NAMES",
    "ByteTokenizer",
    "HFTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "check_tokenizer_fits",
    "load_tokenizer",
    "read_tiktoken",
    "tokenizer_file",
    "tokenizer_vocab_size",
]

TOKENIZER_FILE_NAMES = ("tokenizer.json", TIKTOKEN_FILE)  # what a folder's tokenizer loads from, in this order


def tokenizer_file(folder: str | Path) -> Path | None:
    """The file a tokenizer folder loads from: ``tokenizer.json``, else ``tiktoken.model``; ``None`` if neither."""
    return next((Path(folder) / name for name in TOKENIZER_FILE_NAMES if (Path(folder) / name).is_file()), None)


def load_tokenizer(
    path: str | Path | None,
    *,
    chat: bool = True,
    chat_template: str | Path | None = None,
    template_vars: Mapping[str, Any] | None = None,
) -> ByteTokenizer | HFTokenizer:
    """The tokenizer at ``path`` with its chat template; :class:`ByteTokenizer` when ``path`` is ``None``.

    ``path`` is a folder, a ``tokenizer.json``, a ``tiktoken.model`` or a Hub id ``ORG/NAME[@REVISION]``
    (:mod:`eqmoe.data.hub`); a folder's tokenizer is its ``tokenizer.json``, else its ``tiktoken.model``
    (:class:`TiktokenTokenizer`), else ``ValueError`` naming the folder and both files. The folder (the file's, for a
    file) also gives ``tokenizer_config.json`` (named special tokens, ``chat_template``),
    ``chat_template.jinja`` and ``generation_config.json`` (``eos_token_id``: the stop ids). ``chat_template`` (a
    ``.jinja`` file, or a ``tokenizer_config.json``) replaces the folder's template; ``template_vars`` (e.g.
    ``enable_thinking``) are passed to every render."""
    variables = dict(template_vars or {})
    if path is None:
        template = None if chat_template is None else read_template_file(chat_template, variables)
        return ByteTokenizer(template or ChatTemplate(CHATML, "built-in ChatML", variables))
    path = resolve_folder(path, files="tokenizer")
    folder, file = (path, tokenizer_file(path)) if path.is_dir() else (path.parent, path)
    if file is None:
        raise ValueError(f"{folder}: no tokenizer in this folder (looked for {' and '.join(TOKENIZER_FILE_NAMES)})")
    config = read_json(folder / "tokenizer_config.json")
    variables = {**special_tokens(config), **variables}
    if chat_template is not None:
        template = read_template_file(chat_template, variables)
    else:
        template = folder_template(folder, config, variables)
    if template is None and variables.keys() - special_tokens(config).keys():
        template = ChatTemplate(CHATML, "built-in ChatML", variables)
    generation = read_json(folder / "generation_config.json")
    stops = generation.get("eos_token_id", [])
    stops = [stops] if isinstance(stops, int) else stops
    stop_ids = tuple(i for i in stops if isinstance(i, int) and not isinstance(i, bool))
    if file.name == TIKTOKEN_FILE:
        encoding = read_tiktoken(file, config)
        return TiktokenTokenizer(
            encoding, str(file), chat=chat, config=config, chat_template=template, stop_ids=stop_ids
        )
    return HFTokenizer(
        read_tokenizer_json(file), str(file), chat=chat, config=config, chat_template=template, stop_ids=stop_ids
    )


def tokenizer_vocab_size(path: str | Path) -> int:
    """How many ids a ``tokenizer.json`` can produce (added tokens included), or a ``tiktoken.model`` with the
    special tokens of the ``tokenizer_config.json`` beside it; needs no chat specials."""
    path = Path(path)
    if path.name == TIKTOKEN_FILE:
        return read_tiktoken(path, read_json(path.parent / "tokenizer_config.json")).n_vocab
    return read_tokenizer_json(path).get_vocab_size(with_added_tokens=True)


def check_tokenizer_fits(
    tokenizer_ids: int, vocab_size: int, where: str | Path | None = None, *, error: type[Exception] = ValueError
) -> None:
    """Refuse a tokenizer with more ids than the model's vocabulary of ``vocab_size``: ``error`` (a ``ValueError`` by
    default) in one line, after ``where`` (the tokenizer's file) when given. A vocabulary padded beyond the tokenizer
    (Qwen pads to a multiple of 128) is fine."""
    if tokenizer_ids > vocab_size:
        prefix = "" if where is None else f"{where}: "
        raise error(f"{prefix}the tokenizer has {tokenizer_ids} ids but the model's vocabulary has {vocab_size}")
