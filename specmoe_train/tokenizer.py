"""Byte-level BPE tokenizer of the small model family (the `tokenizers` library), about 8k tokens.

Special tokens: ``<|endoftext|>`` (end of a document; also bos/eos), ``<|pad|>`` and ``<|mask|>`` (the
mask token the DFlash drafter fills). Saved as ``tokenizer.json`` plus a transformers
``PreTrainedTokenizerFast`` config, so ``AutoTokenizer.from_pretrained(dir)`` loads it offline.
"""

from __future__ import annotations

import os
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>", "<|mask|>")
EOS, PAD, MASK = SPECIAL_TOKENS


def train_tokenizer(texts: list[str], vocab_size: int = 8192):
    """Train a byte-level BPE of exactly `vocab_size` tokens (specials first: ids 0, 1, 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def save_tokenizer(tokenizer, directory: str | os.PathLike) -> Path:
    """Write tokenizer.json and the transformers tokenizer config into `directory`."""
    from transformers import PreTrainedTokenizerFast

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOS, eos_token=EOS, pad_token=PAD,
                                   mask_token=MASK, model_max_length=4096)
    fast.save_pretrained(str(directory))
    return directory


def load_tokenizer(directory: str | os.PathLike):
    """The raw tokenizers.Tokenizer saved in `directory`."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
