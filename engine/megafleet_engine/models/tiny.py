"""Tiny Llama-shaped models with random weights and a tokenizer built in code.

Used by tests, the demo fleet (``model.source: tiny://llama``) and refit tests, where trainer and
engines must start from identical weights: the weights depend only on the source string and seed.
Nothing is downloaded. Source grammar: ``tiny://llama[?layers=N&hidden=N&heads=N&kv_heads=N&seed=N]``.
"""

from __future__ import annotations

import dataclasses
import urllib.parse

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SCHEME = "tiny"
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class TinyShape:
    """Architecture of a tiny model; every field can be set in the source's query string."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    max_positions: int = 2048
    seed: int = 0


def is_tiny(source: str) -> bool:
    return source.startswith(f"{SCHEME}://")


def parse(source: str) -> TinyShape:
    """The shape a ``tiny://`` source names; unknown keys or bad values raise ``ValueError``."""
    parsed = urllib.parse.urlparse(source)
    if parsed.scheme != SCHEME or parsed.netloc != "llama":
        raise ValueError(f"unsupported tiny model {source!r}: only tiny://llama exists")
    fields = {field.name for field in dataclasses.fields(TinyShape)}
    values: dict[str, int] = {}
    for key, value in urllib.parse.parse_qsl(parsed.query, strict_parsing=bool(parsed.query)):
        if key not in fields:
            raise ValueError(f"unknown tiny model option {key!r}; known: {', '.join(sorted(fields))}")
        values[key] = int(value)
    return TinyShape(**values)


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level tokenizer (every byte is a token) with chat special tokens and a chat template."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(alphabet):
        vocab[symbol] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_config(shape: TinyShape, tokenizer: transformers.PreTrainedTokenizerFast) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_tiny(
    source: str = "tiny://llama", *, dtype: torch.dtype = torch.float32
) -> tuple[transformers.LlamaForCausalLM, transformers.PreTrainedTokenizerFast]:
    """The model (eval mode, random weights fixed by the seed) and its tokenizer."""
    shape = parse(source)
    tokenizer = build_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(shape.seed)
        model = transformers.LlamaForCausalLM(build_config(shape, tokenizer))
    model.to(dtype=dtype)
    model.eval()
    return model, tokenizer


def reference_weights(source: str, *, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The weights :func:`build_tiny` produces for ``source``, by parameter name."""
    model, _ = build_tiny(source, dtype=dtype)
    return {name: parameter.detach() for name, parameter in model.named_parameters()}
