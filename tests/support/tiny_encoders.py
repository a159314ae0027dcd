"""Tiny random embedding models and cross-encoders, saved the way sentence-transformers
saves them, with sentence-transformers itself as the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

WORDS = [f"w{i}" for i in range(120)]
# Specials first, in the order each family numbers them (RoBERTa's padding id is 1).
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
VOCAB = len(BERT_SPECIALS) + len(WORDS)

TEXTS = [
    "w1 w2 w3",
    "w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17",
    "w42",
    "w3 w3 w3 w9 w100 w7",
    " ".join(WORDS[20:60]),
]


def _tokenizer(path: Path, roberta: bool) -> Any:
    from transformers import BertTokenizerFast

    specials = ROBERTA_SPECIALS if roberta else BERT_SPECIALS
    vocab = {token: i for i, token in enumerate(specials + WORDS)}
    names = ("cls_token", "pad_token", "sep_token", "unk_token", "mask_token")
    order = (0, 1, 2, 3, 4) if roberta else (2, 0, 3, 1, 4)
    kwargs: dict[str, Any] = {name: specials[i] for name, i in zip(names, order, strict=True)}
    if roberta:  # RoBERTa tokenizers give no segment ids (a single token type)
        kwargs["model_input_names"] = ["input_ids", "attention_mask"]
    return BertTokenizerFast(vocab=vocab, **kwargs)


def encoder_config(family: str, **overrides: Any) -> Any:
    from transformers import BertConfig, XLMRobertaConfig

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        hidden_act="gelu",
    )
    if family == "bert":
        return BertConfig(**common, max_position_embeddings=96, pad_token_id=0, **overrides)
    return XLMRobertaConfig(
        **common, max_position_embeddings=98, pad_token_id=1, type_vocab_size=1, **overrides
    )


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Larger-than-default random weights, LayerNorms near 1, so differences would show."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            scale = 0.1 if "LayerNorm" in name or "norm" in name else 0.08
            param.copy_((1.0 if "LayerNorm.weight" in name else 0.0) + scale * noise)


def tiny_encoder_dir(root: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """A random bare encoder (HF directory with tokenizer) of `family` (bert, xlm-roberta)."""
    from transformers import AutoModel

    path = root / f"{family}-{seed}-{'-'.join(map(str, overrides.values()))}"
    model = AutoModel.from_config(encoder_config(family, **overrides))
    randomise(model, seed)
    model.save_pretrained(str(path))
    _tokenizer(path, family != "bert").save_pretrained(str(path))
    return path


def tiny_cross_encoder_dir(root: Path, family: str, seed: int = 0) -> Path:
    """A random sequence-classification model (one label), as cross-encoders ship."""
    from transformers import AutoModelForSequenceClassification

    path = root / f"{family}-cross-{seed}"
    config = encoder_config(family, num_labels=1)
    config.architectures = [type(config).__name__.replace("Config", "ForSequenceClassification")]
    model = AutoModelForSequenceClassification.from_config(config)
    randomise(model, seed)
    model.save_pretrained(str(path))
    _tokenizer(path, family != "bert").save_pretrained(str(path))
    return path


def sentence_model_dir(base: Path, pooling: str, normalize: bool, max_seq_length: int) -> Path:
    """`base` wrapped by sentence-transformers (Transformer, Pooling, Normalize?) and saved
    by it, so its own files say how to pool."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    transformer = Transformer(str(base), max_seq_length=max_seq_length)
    dim = transformer.get_embedding_dimension()
    modules = [transformer, Pooling(dim, pooling)]
    if normalize:
        modules.append(Normalize())
    path = base.parent / f"{base.name}-st-{pooling}-{int(normalize)}"
    SentenceTransformer(modules=modules, device="cpu").save(str(path))
    return path


def reference(path: Path, **kwargs: Any) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu", **kwargs)
