"""Data for training: tokenizers, the ChatML template, built-in tasks, JSONL chat files, packing, loading.

NumPy only; the training code converts batches to JAX arrays. Nothing here knows about the model.
"""

from eqmoe.data.chat import ROLES, Conversation, check_messages, encode_chat, prompt_ids, render
from eqmoe.data.jsonl import JsonlData, load_jsonl
from eqmoe.data.loader import PackedDataset
from eqmoe.data.packing import Packed, PackedRows, pack, pack_conversations, target_mask
from eqmoe.data.tasks import (
    ALL_KINDS,
    KINDS,
    TRAIN_MIX,
    Example,
    TaskKind,
    distinct_kinds,
    make_example,
    split_of,
    synthetic_split,
)
from eqmoe.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer, tokenizer_vocab_size

__all__ = [
    "ALL_KINDS",
    "KINDS",
    "TRAIN_MIX",
    "ROLES",
    "PackedRows",
    "ByteTokenizer",
    "Conversation",
    "Example",
    "HFTokenizer",
    "JsonlData",
    "Packed",
    "TaskKind",
    "PackedDataset",
    "Tokenizer",
    "check_messages",
    "encode_chat",
    "load_jsonl",
    "load_tokenizer",
    "tokenizer_vocab_size",
    "make_example",
    "pack",
    "pack_conversations",
    "prompt_ids",
    "render",
    "split_of",
    "synthetic_split",
    "distinct_kinds",
    "target_mask",
]
