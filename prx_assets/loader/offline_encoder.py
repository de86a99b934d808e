"""Randomly initialised BERT text encoders built offline, for tests and benchmarks.

Model hubs are out of reach here, and the loader's encoder hook must be exercised end to end
(``AutoTokenizer`` + ``AutoModel`` from a directory) without downloads. The latents are
meaningless; shapes, dtypes and costs are real.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")

TINY = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 64,
}
# Google's BERT-small (L=4, H=512): the size class of a small production text encoder.
SMALL = {
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "intermediate_size": 2048,
}


def build_offline_bert(
    out_dir: str | os.PathLike[str],
    words: Iterable[str],
    *,
    hidden_size: int = 32,
    num_hidden_layers: int = 1,
    num_attention_heads: int = 2,
    intermediate_size: int = 64,
    max_position_embeddings: int = 128,
    seed: int = 0,
) -> str:
    """Save a WordPiece tokenizer (lower-cased ``words`` + characters) and a random BERT."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    vocab: dict[str, None] = dict.fromkeys(SPECIAL_TOKENS)
    for word in words:
        for token in re.findall(r"\w+|[^\w\s]", word.lower()):
            vocab.setdefault(token)
            for ch in token:
                vocab.setdefault(ch)
                vocab.setdefault("##" + ch)
    vocab_path = os.path.join(out, "vocab.txt")
    with open(vocab_path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=vocab_path, do_lower_case=True)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
    )
    # The weights' seed only: the caller's global torch RNG state is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BertModel(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
