"""Model sources of the megatron backend: what a ``MEGAFLEET_MODEL_SOURCE`` string names, and the
tokenizer that goes with it.

Called by :func:`megafleet_engine.backends.megatron.backend.load` and the backend's
``load_checkpoint`` (and by the benchmarks, for a source's shape). Sources:

* ``tiny://llama[?layers=N&hidden=N&...]``: the tiny Llama of :mod:`megafleet_engine.models.tiny`,
  with the very weights the ``transformers`` backend gets for the same string (mapped through
  :mod:`~megafleet_engine.backends.weight_maps`), and its byte-level tokenizer.
* ``random://PRESET[?seed=N&layers=N&hidden=N&heads=N&kv_heads=N&intermediate=N&vocab=N&head_dim=N]``:
  a Llama-shaped model with random weights (normal, std 0.02; norms 1) drawn on the GPU from
  ``seed`` (default 0), for benchmarks and refit tests without a checkpoint. Presets:
  ``llama-8b`` (Llama-3.1-8B), ``llama-1b`` (Llama-3.2-1B), ``llama-70b`` (Llama-3.1-70B). The
  tokenizer is the tiny byte-level one (ids above 262 decode to nothing).
* a local folder holding a Hugging Face Llama checkpoint (``config.json``, ``*.safetensors``,
  tokenizer files): each rank reads only the slices of each tensor it holds.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.parse
from pathlib import Path
from typing import Any, Literal

from megafleet_engine.backends.weight_maps import LlamaShape

__all__ = ["PRESETS", "RANDOM_SCHEME", "ModelSource", "load_tokenizer", "parse_source"]

RANDOM_SCHEME = "random"
PRESETS: dict[str, LlamaShape] = {
    "llama-8b": LlamaShape(
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        intermediate=14336,
        vocab=128256,
        rope_theta=500000.0,
        rope_scaling_factor=8.0,
        max_positions=131072,
    ),
    "llama-1b": LlamaShape(
        layers=16,
        hidden=2048,
        heads=32,
        kv_heads=8,
        intermediate=8192,
        vocab=128256,
        head_dim=64,
        tied_embeddings=True,
        rope_theta=500000.0,
        rope_scaling_factor=32.0,
        max_positions=131072,
    ),
    "llama-70b": LlamaShape(
        layers=80,
        hidden=8192,
        heads=64,
        kv_heads=8,
        intermediate=28672,
        vocab=128256,
        rope_theta=500000.0,
        rope_scaling_factor=8.0,
        max_positions=131072,
    ),
}
_SHAPE_KEYS = ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "head_dim")


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """What a model source string names."""

    kind: Literal["tiny", "random", "checkpoint"]
    shape: LlamaShape
    seed: int = 0
    path: str = ""  # the checkpoint folder, or the tiny:// string
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None


def parse_source(source: str) -> ModelSource:
    """Parse a model source (see the module docstring); bad sources raise ``ValueError``."""
    from megafleet_engine.models import tiny

    if tiny.is_tiny(source):
        tokenizer = tiny.build_tokenizer()
        config = tiny.build_config(tiny.parse(source), tokenizer)
        return ModelSource(
            "tiny",
            LlamaShape.from_hf_config(config.to_dict()),
            path=source,
            eos_token_ids=(int(tokenizer.eos_token_id),),
            bos_token_id=int(tokenizer.bos_token_id),
        )
    parsed = urllib.parse.urlparse(source)
    if parsed.scheme == RANDOM_SCHEME:
        if parsed.netloc not in PRESETS:
            raise ValueError(f"unknown random model {parsed.netloc!r}; presets: {', '.join(sorted(PRESETS))}")
        overrides: dict[str, Any] = {}
        seed = 0
        for key, value in urllib.parse.parse_qsl(parsed.query, strict_parsing=bool(parsed.query)):
            if key == "seed":
                seed = int(value)
            elif key in _SHAPE_KEYS:
                overrides[key] = int(value)
            else:
                raise ValueError(f"unknown random model option {key!r}; known: seed, {', '.join(_SHAPE_KEYS)}")
        preset = PRESETS[parsed.netloc]
        if "hidden" in overrides or "heads" in overrides:
            overrides.setdefault("head_dim", 0)  # recomputed as hidden // heads
        shape = dataclasses.replace(preset, **overrides)
        tokenizer = tiny.build_tokenizer()
        return ModelSource(
            "random",
            shape,
            seed=seed,
            eos_token_ids=(int(tokenizer.eos_token_id),),
            bos_token_id=int(tokenizer.bos_token_id),
        )
    if "://" in source:
        raise ValueError(f"unsupported model source {source!r}: use tiny://, random:// or a checkpoint folder")
    folder = Path(source)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{source} is not a Hugging Face checkpoint folder (no config.json)")
    config = json.loads(config_file.read_text())
    eos = config.get("eos_token_id")
    eos_ids = tuple(int(i) for i in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    bos = config.get("bos_token_id")
    return ModelSource(
        "checkpoint",
        LlamaShape.from_hf_config(config),
        path=str(folder),
        eos_token_ids=eos_ids,
        bos_token_id=None if bos is None else int(bos),
    )


def load_tokenizer(source: ModelSource) -> Any:
    """The tokenizer the frontend uses for ``source`` (``None``: a checkpoint without tokenizer files)."""
    from megafleet_engine.models import tiny

    if source.kind != "checkpoint":
        return tiny.build_tokenizer()
    if not any((Path(source.path) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    import transformers

    return transformers.AutoTokenizer.from_pretrained(source.path, local_files_only=True)
