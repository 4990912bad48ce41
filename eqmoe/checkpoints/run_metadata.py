"""What a checkpoint records beside its arrays, as one typed record: every writer and every reader goes through it.

A model written by ``save_model`` (``convert``) and a training run's checkpoint both store a :class:`RunMetadata`
as JSON in the checkpoint's ``metadata`` item; reading it back checks each field's type and names the checkpoint
when one is wrong. Keys it does not know (written by a newer eqmoe) are kept, untouched.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from eqmoe.checkpoints.base import BaseModel
from eqmoe.config import ModelConfig
from eqmoe.config_io import config_from_dict, config_to_dict
from eqmoe.lora import LoRAConfig

MODEL_KIND = "eqmoe-model"  # ``kind`` of a model saved alone (not a training run's state)


@dataclass(frozen=True)
class RunMetadata:
    """The record, every field optional but the model config.

    - ``config``: the model's config (:func:`eqmoe.config_io.config_to_dict` in the JSON).
    - ``kind``: ``"eqmoe-model"`` for a model saved alone (its tree is the model), ``None`` for a run's state.
    - ``step``, ``data_step``, ``seed``: where a training run stands (its data order depends on seed and data step).
    - ``tokenizer``: the tokenizer (a ``tokenizer.json`` or ``tiktoken.model``, or its folder) the run read text
      with; ``bytes_tokenizer``: the run used eqmoe's byte tokenizer; neither: not recorded (a converted checkpoint).
    - ``chat_template``, ``template_vars``: the chat template file and variables the run rendered with.
    - ``lora``: the LoRA settings (:class:`eqmoe.lora.LoRAConfig`'s fields) of a run that trained adapters.
    - ``base``: the base model (:class:`eqmoe.checkpoints.base.BaseModel`) a checkpoint holding only what training
      changed reads the rest from.
    - ``source``: the Hugging Face folder a converted checkpoint came from.
    - ``backends``: the backends a run's ``auto`` execution fields resolved to (:mod:`eqmoe.autotune`), e.g.
      ``{"moe.dispatch": "sorted"}``; a resumed run takes them again, so its numbers do not depend on a new timing.
    """

    config: ModelConfig
    kind: str | None = None
    step: int | None = None
    data_step: int | None = None
    seed: int | None = None
    tokenizer: str | None = None
    bytes_tokenizer: bool = False
    chat_template: str | None = None
    template_vars: dict[str, Any] = field(default_factory=dict)
    lora: dict[str, Any] | None = None
    base: BaseModel | None = None
    source: str | None = None
    backends: dict[str, str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys of a newer writer, kept as they are

    def replace(self, **changes) -> "RunMetadata":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = dict(self.extra)
        data["config"] = config_to_dict(self.config)
        for name in ("kind", "step", "data_step", "seed", "chat_template", "lora", "source", "backends"):
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        if self.tokenizer is not None or self.bytes_tokenizer:
            data["tokenizer"] = self.tokenizer  # null: the byte tokenizer
        if self.template_vars:
            data["template_vars"] = self.template_vars
        if self.base is not None:
            data["base"] = self.base.to_json()
        return data

    @classmethod
    def from_json(cls, data: Any, where: str) -> "RunMetadata":
        """The record in a checkpoint's metadata ``data``; ``ValueError`` naming ``where`` and the field when a field
        has the wrong type."""
        if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
            raise ValueError(f"{where}: the checkpoint's metadata has no model config (not an eqmoe model)")
        try:
            config = config_from_dict(data["config"])
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: the checkpoint's model config is invalid ({error})") from None
        expected = {
            "kind": str,
            "step": int,
            "data_step": int,
            "seed": int,
            "tokenizer": str,
            "chat_template": str,
            "template_vars": dict,
            "lora": dict,
            "source": str,
            "backends": dict,
        }
        for name, kind in expected.items():
            value = data.get(name)
            if value is not None and not (isinstance(value, kind) and not isinstance(value, bool)):
                raise ValueError(f"{where}: the checkpoint's metadata field {name}={value!r} is not a {kind.__name__}")
        base = None if data.get("base") is None else BaseModel.from_json(data["base"], where)
        known = {*expected, "config", "base"}
        return cls(
            config=config,
            kind=data.get("kind"),
            step=data.get("step"),
            data_step=data.get("data_step"),
            seed=data.get("seed"),
            tokenizer=data.get("tokenizer"),
            bytes_tokenizer="tokenizer" in data and data["tokenizer"] is None,
            chat_template=data.get("chat_template"),
            template_vars=data.get("template_vars") or {},
            lora=data.get("lora"),
            base=base,
            source=data.get("source"),
            backends=data.get("backends"),
            extra={key: value for key, value in data.items() if key not in known},
        )

    def lora_config(self, where: str) -> LoRAConfig | None:
        """The recorded :class:`eqmoe.lora.LoRAConfig`, or ``None``."""
        if self.lora is None:
            return None
        try:
            return LoRAConfig(**{**self.lora, "targets": tuple(self.lora["targets"])})
        except (TypeError, KeyError, ValueError) as error:
            raise ValueError(f"{where}: the checkpoint's LoRA settings are invalid ({error})") from None
