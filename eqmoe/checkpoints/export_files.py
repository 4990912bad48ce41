"""The files an exported Hugging Face folder carries beside its weights, so that transformers tokenizes, templates
and stops as the eqmoe run did: the run's tokenizer files, the chat template it rendered with and a
``generation_config.json`` whose ``eos_token_id`` lists the ids it stopped on.

The run's tokenizer is the one given, else the one its metadata records, else the checkpoint folder's own (a
converted checkpoint carries its source's). Its template is the run's ``--chat-template`` file, else the tokenizer
folder's. transformers reads ``chat_template.jinja`` before ``tokenizer_config.json``'s ``chat_template``, so the
template is written one way only: a single template as ``chat_template.jinja`` with no ``chat_template`` left in
``tokenizer_config.json``; named templates (``default``, ``tool_use``) as ``tokenizer_config.json``'s list with no
``chat_template.jinja``, which eqmoe and transformers both read. Template variables (``enable_thinking=false``)
have no place in those files: :attr:`ExportFiles.note` states them, and a ``README.md`` says how to pass them.
"""

import json
import shutil
from pathlib import Path
from typing import Any, NamedTuple

from eqmoe.checkpoints import hf
from eqmoe.checkpoints.run_metadata import RunMetadata
from eqmoe.data import end_of_turn_ids, load_tokenizer
from eqmoe.data.template import ChatTemplate, special_tokens
from eqmoe.data.tokenizer import TIKTOKEN_FILE, check_tokenizer_fits, tokenizer_file

_BUILT_IN = "built-in ChatML"  # the origin of the template a tokenizer without one renders with


class ExportFiles(NamedTuple):
    files: list[Path]  # to copy beside the weights, each under its own name
    note: str  # what the command's output line says about them


def run_tokenizer(metadata: RunMetadata | None, folder: Path, tokenizer: Path | None = None) -> Path | None:
    """The tokenizer (a folder, a ``tokenizer.json`` or a ``tiktoken.model``) the run read text with: ``tokenizer``
    when given, else the one ``metadata`` records, else ``folder``'s own (its ``tokenizer.json`` or
    ``tiktoken.model``); ``None`` for a run on eqmoe's byte tokenizer or when nothing names one.
    ``FileNotFoundError`` when the given or recorded one is gone."""
    if tokenizer is not None:
        if not tokenizer.exists():
            raise FileNotFoundError(f"{tokenizer}: tokenizer not found")
        return tokenizer
    recorded = None if metadata is None else metadata.tokenizer
    if recorded is not None and Path(recorded).exists():
        return Path(recorded)
    if tokenizer_file(folder) is not None:
        return folder
    if recorded is not None:
        raise FileNotFoundError(f"{recorded}: the tokenizer the run trained with is gone (pass --tokenizer DIR)")
    return None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _write_json(path: Path, value: dict[str, Any]) -> Path:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def _tokenizer_code(source: Path, config: dict[str, Any]) -> list[Path]:
    """The ``tokenization_*.py`` files in ``source`` and any other module in it that ``tokenizer_config.json``'s
    ``auto_map`` names for ``AutoTokenizer``: the transformers code a ``tiktoken.model`` is read with."""
    auto_map = config.get("auto_map")
    named = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    named = [named] if isinstance(named, str) else named if isinstance(named, list) else []
    # "tokenization_kimi.TikTokenTokenizer", or "ORG/NAME--tokenization_kimi.TikTokenTokenizer" (another repo's)
    modules = [name.split("--")[-1].rsplit(".", 1)[0] for name in named if isinstance(name, str)]
    found = [source / f"{module}.py" for module in modules] + sorted(source.glob("tokenization_*.py"))
    return list(dict.fromkeys(path for path in found if path.is_file()))


def _ids(value: object) -> list[object]:
    return [value] if isinstance(value, int) else list(value or [])


def _template_files(template: ChatTemplate, config: dict[str, Any], scratch: Path) -> dict[str, Path | None]:
    """``chat_template.jinja`` and, when it must change, ``tokenizer_config.json`` holding ``template`` alone
    (``None``: leave the file out)."""
    changed = dict(config)
    if len(template.sources) == 1:
        jinja = scratch / "chat_template.jinja"
        jinja.write_text(next(iter(template.sources.values())), encoding="utf-8")
        changed.pop("chat_template", None)
    else:
        jinja = None
        changed["chat_template"] = [{"name": name, "template": text} for name, text in template.sources.items()]
    files = {"chat_template.jinja": jinja}
    if changed != config:
        files["tokenizer_config.json"] = _write_json(scratch / "tokenizer_config.json", changed)
    return files


def _render_note(variables: dict[str, Any]) -> str:
    arguments = ", ".join(f"{key}={value!r}" for key, value in variables.items())
    return (
        "# Chat template variables\n\n"
        "This model was trained on conversations rendered with chat-template variables that tokenizer files cannot "
        "hold. Pass them to every render to reproduce training:\n\n"
        f"    tokenizer.apply_chat_template(messages, {arguments})\n"
    )


def export_files(
    metadata: RunMetadata | None, folder: Path, scratch: Path, vocab_size: int, tokenizer: Path | None = None
) -> ExportFiles:
    """The tokenizer, template and generation files for an export of the checkpoint in ``folder`` whose run recorded
    ``metadata`` (``tokenizer``: use this one instead of the run's; see :func:`run_tokenizer`). Files that must
    differ from the tokenizer folder's are written in ``scratch``. ``ValueError`` when the tokenizer has more ids
    than the model's vocabulary (``vocab_size``; a vocabulary padded beyond the tokenizer is fine)."""
    path = run_tokenizer(metadata, folder, tokenizer)
    if path is None:
        if metadata is not None and metadata.bytes_tokenizer:
            return ExportFiles([], "no tokenizer files (trained on eqmoe's byte tokenizer)")
        return ExportFiles([], "no tokenizer files (none recorded)")
    source, file = (path, tokenizer_file(path) or path / "tokenizer.json") if path.is_dir() else (path.parent, path)
    template_file = None if metadata is None else metadata.chat_template
    if template_file is not None and not Path(template_file).is_file():
        raise FileNotFoundError(f"{template_file}: the chat template the run trained with is gone")
    variables = {} if metadata is None else dict(metadata.template_vars)
    # chat=False also loads a plain-text run's tokenizer; the template and stop ids do not depend on it.
    text = load_tokenizer(path, chat=False, chat_template=template_file, template_vars=variables)
    check_tokenizer_fits(text.vocab_size, vocab_size, file)
    config = _read_json(source / "tokenizer_config.json")
    files: dict[str, Path | None] = {p.name: p for p in hf.side_files(source)}
    if file.name == TIKTOKEN_FILE:  # with the code transformers reads it with (trust_remote_code)
        files.update({p.name: p for p in [file, *_tokenizer_code(source, config)]})
        files["tokenizer.json"] = None  # transformers would read a tokenizer.json first
    else:
        files["tokenizer.json"] = (
            file if file.name == "tokenizer.json" else shutil.copyfile(file, scratch / "tokenizer.json")
        )
    note = f"tokenizer from {path}"
    # The built-in ChatML without its special tokens: a plain-text tokenizer, which rendered no conversation.
    if text.chat_template.origin == _BUILT_IN and text.im_start_id is None:
        return ExportFiles([p for p in files.values() if p is not None], note)

    files.update(_template_files(text.chat_template, config, scratch))
    stops = list(end_of_turn_ids(text))
    generation = _read_json(source / "generation_config.json")
    if stops and _ids(generation.get("eos_token_id")) != stops:
        generation = {**generation, "eos_token_id": stops}  # an existing key keeps its place
        files["generation_config.json"] = _write_json(scratch / "generation_config.json", generation)
    note += f", chat template from {text.chat_template.origin}, stops on ids {stops}"
    named = special_tokens(config)
    unstored = {key: value for key, value in variables.items() if named.get(key) != value}
    if unstored:
        files["README.md"] = scratch / "README.md"
        files["README.md"].write_text(_render_note(unstored), encoding="utf-8")
        shown = " ".join(f"{key}={json.dumps(value)}" for key, value in unstored.items())
        note += f"; render with the template variables {shown} (tokenizer files cannot hold them; see README.md)"
    return ExportFiles([p for p in files.values() if p is not None], note)
