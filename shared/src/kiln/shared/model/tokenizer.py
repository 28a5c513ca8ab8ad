"""The policy's tokenizer: a byte-level BPE trained offline on the task suite.

Byte-level means every string round-trips, so whatever the model writes can be
decoded and whatever a tool returns can be encoded. The special tokens of
``kiln.shared.chat`` are single ids. Saved as ``tokenizer.json`` plus a
``tokenizer_config.json`` carrying the chat template, so transformers and vLLM load
the same tokenizer from a checkpoint folder.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kiln.shared.chat import CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS


def train_tokenizer(corpus: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, folder: str | Path) -> None:
    folder = Path(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "pad_token": PAD,
                "bos_token": None,
                "additional_special_tokens": SPECIAL_TOKENS[1:],
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 2048,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )


def load_tokenizer(folder: str | Path) -> Tokenizer:
    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))


def special_id(tok: Tokenizer, token: str) -> int:
    i = tok.token_to_id(token)
    if i is None:
        raise KeyError(f"tokenizer has no special token {token!r}")
    return i
