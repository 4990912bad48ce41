"""Data for training: tokenizers, chat templates, conversations in the file layouts people hold, built-in
tasks, packing, loading.

NumPy only; the training code converts batches to JAX arrays. Nothing here knows about the model.
"""

from eqmoe.data.chat import (
    ROLES,
    Conversation,
    Encoded,
    check_conversation,
    encode_chat,
    encode_chats,
    end_of_turn_ids,
    prompt_ids,
    render,
)
from eqmoe.data.formats import LAYOUTS, Loaded, load_conversations, read_conversations
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
from eqmoe.data.template import CHATML, ChatTemplate, TemplateError
from eqmoe.data.tokenized import TokenizedFile, tokenize_file
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
    "CHATML",
    "ChatTemplate",
    "LAYOUTS",
    "Loaded",
    "TemplateError",
    "TokenizedFile",
    "Packed",
    "TaskKind",
    "PackedDataset",
    "Tokenizer",
    "check_conversation",
    "Encoded",
    "encode_chats",
    "end_of_turn_ids",
    "encode_chat",
    "load_conversations",
    "read_conversations",
    "tokenize_file",
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
