"""The base model a LoRA or partly frozen run builds on: where it is and a digest of what it holds.

A run that starts from a folder (a Hugging Face model or an eqmoe checkpoint) records its :class:`BaseModel`
in every checkpoint and saves only what training changes (adapters, unfrozen weights, router biases, the
optimizer state): the rest is read back from the base. The digest is a SHA-256 over the files that hold the
weights (names, sizes, bytes), so a moved copy is accepted and any changed byte is refused. Each file's own
digest is cached under ``$EQMOE_CACHE/digests.json`` by path, size and modification time, so a 60 GB base is
read in full once per machine.
"""

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from eqmoe.cache import cache_root

_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class BaseModel:
    """A base model folder: ``format`` ``hf`` (config.json + safetensors) or ``eqmoe`` (an orbax checkpoint,
    at ``step``), and the SHA-256 of its weight files."""

    path: Path
    format: Literal["hf", "eqmoe"]
    step: int | None
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "format": self.format, "step": self.step, "sha256": self.sha256}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "BaseModel":
        try:
            base = cls(Path(data["path"]), data["format"], data["step"], data["sha256"])
        except (TypeError, KeyError) as error:
            raise ValueError(f"{where}: the recorded base model is malformed ({error!r})") from None
        if base.format not in ("hf", "eqmoe") or not isinstance(base.sha256, str):
            raise ValueError(f"{where}: the recorded base model is malformed ({data!r})")
        return base


def _weight_files(folder: Path, format: str, step: int | None) -> list[Path]:
    if format == "hf":
        names = ["config.json", *sorted(p.name for p in folder.glob("*.safetensors*"))]
        return [folder / name for name in names if (folder / name).is_file()]
    return sorted(p for p in (folder / str(step)).rglob("*") if p.is_file())


def _file_digest(path: Path, cache: dict[str, str]) -> str:
    stat = path.stat()
    key = f"{path.absolute()}|{stat.st_size}|{stat.st_mtime_ns}"
    if key not in cache:
        with open(path, "rb", buffering=0) as handle:
            cache[key] = hashlib.file_digest(handle, "sha256").hexdigest()
    return cache[key]


def _read_cache(path: Path) -> dict[str, str]:
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _write_cache(path: Path, cache: dict[str, str]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".digests.", delete=False) as handle:
            json.dump(cache, handle)
        os.replace(handle.name, path)
    except OSError:
        pass  # a cache that cannot be written only costs a re-read next time


def folder_digest(folder: Path, format: str, step: int | None) -> str:
    """SHA-256 over the weight files of ``folder`` (relative names, sizes and contents)."""
    files = _weight_files(folder, format, step)
    if not files:
        raise ValueError(f"{folder}: no weight files to identify the base model by")
    root = folder if format == "hf" else folder / str(step)
    cache_path = cache_root() / "digests.json"
    cache = _read_cache(cache_path)
    known = len(cache)
    digest = hashlib.sha256(b"eqmoe base model 1\0")
    for file in files:
        digest.update(f"{file.relative_to(root).as_posix()}\0{file.stat().st_size}\0".encode())
        digest.update(bytes.fromhex(_file_digest(file, cache)))
    if len(cache) != known:
        _write_cache(cache_path, cache)
    return digest.hexdigest()


def identify(folder: str | os.PathLike, *, step: int | None = None) -> BaseModel:
    """The :class:`BaseModel` of a Hugging Face folder or an eqmoe checkpoint (``step`` None: its latest)."""
    folder = Path(folder).absolute()
    if (folder / "config.json").is_file():
        return BaseModel(folder, "hf", None, folder_digest(folder, "hf", None))
    from eqmoe.checkpoints.orbax import Checkpointer

    with Checkpointer(folder, keep_last=None) as checkpointer:
        step = checkpointer.latest_step() if step is None else step
    if step is None or not (folder / str(step)).is_dir():
        raise ValueError(f"{folder}: neither a Hugging Face folder nor an eqmoe checkpoint with step {step}")
    return BaseModel(folder, "eqmoe", step, folder_digest(folder, "eqmoe", step))


def locate(base: BaseModel, where: str, override: str | os.PathLike | None = None) -> BaseModel:
    """``base`` found where it was recorded (or at ``override``, e.g. after a move), after checking that its
    digest is the recorded one; ``ValueError`` naming the folder otherwise."""
    folder = Path(override).absolute() if override is not None else base.path
    if not folder.is_dir():
        hint = "" if override is not None else "; pass --base DIR where it is now"
        raise ValueError(f"{where}: its base model {folder} is not found{hint}")
    found = identify(folder, step=base.step)
    if found.sha256 != base.sha256:
        raise ValueError(
            f"{where}: the base model in {folder} differs from the one it was trained on "
            f"(content sha256 {found.sha256[:16]}, recorded {base.sha256[:16]})"
        )
    return found
