"""This rank's weights in the megatron backend: Hugging Face-named views over megatron-layout
tensors (the live parameters, or the staging copy beside them), and every way weights get into them.

Called by :class:`.backend.MegatronBackend` (``parameters``, ``shard_map``, ``write_weights``,
``load_checkpoint``, ``zero_weights``, ``settle_weight_update``), :mod:`.staging` (the same views
over the staging copy) and :func:`.backend.load`. The views alias the tensors (fused QKV and gate/up
included), and every write is an in-place ``copy_`` into the same storage, never a rebinding: captured
CUDA graphs read the live parameters' storage at replay. In a refit every rank writes its own
weights; a following rank records the outcome by weight version (:class:`Settlement`) for the first
rank's settle question.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from megafleet_engine.backends import base, weight_maps
from megafleet_engine.backends.megatron import model_sources
from megafleet_engine.backends.weight_maps import Layout, LlamaShape

__all__ = ["RANDOM_STD", "Settlement", "Weights", "parameter_tensors"]

log = logging.getLogger(__name__)

RANDOM_STD = 0.02


def parameter_tensors(model: Any) -> Callable[[], dict[str, torch.Tensor]]:
    """The live parameters of ``model`` by megatron name, read afresh at each call."""
    return lambda: {name: parameter.data for name, parameter in model.named_parameters()}


class Weights:
    """Megatron-layout tensors by megatron name (this rank's part, ``layout``, of a model of
    ``shape``: the live parameters, or a staging copy of them) and the weight map between them and
    the HF tensors. ``tensors`` returns them; it is read once here and again by :meth:`shard_map`."""

    def __init__(self, tensors: Callable[[], dict[str, torch.Tensor]], shape: LlamaShape, layout: Layout) -> None:
        self.tensors = tensors
        self.shape = shape
        self.layout = layout
        self.live: dict[str, torch.Tensor] = tensors()
        self.specs = weight_maps.shard_map(shape, layout)
        missing, extra = set(self.specs) - set(self.live), set(self.live) - set(self.specs)
        if missing or extra:
            raise RuntimeError(
                f"megatron's parameters differ from the weight map: missing {sorted(missing)[:4]}, "
                f"unexpected {sorted(extra)[:4]}"
            )
        self.by_hf: dict[str, list[tuple[str, weight_maps.Piece]]] = {}
        for spec in self.specs.values():
            for piece in spec.pieces:
                self.by_hf.setdefault(piece.hf_name, []).append((spec.name, piece))

    def views(self) -> dict[str, torch.Tensor]:
        """This rank's part of every HF parameter, as views of the megatron tensors."""
        views = {}
        for hf_name, targets in self.by_hf.items():
            megatron_name, piece = targets[0]
            views[hf_name] = weight_maps.megatron_view(self.live[megatron_name], piece)
        return views

    def shard_map(self) -> base.ShardMap:
        """The megatron tensors (read afresh: a live parameter rebound since shows), their specs
        and the HF shapes."""
        return base.ShardMap(live=self.tensors(), specs=self.specs, hf_shapes=weight_maps.hf_shapes(self.shape))

    @property
    def bytes(self) -> int:
        """The bytes the megatron tensors take."""
        return sum(tensor.numel() * tensor.element_size() for tensor in self.live.values())

    def write(
        self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *, sliced: bool = False
    ) -> None:
        """Copy HF tensors (whole, or with ``sliced`` only this rank's range) into the megatron
        tensors in place; names this rank does not hold are ignored."""
        items = weights.items() if isinstance(weights, Mapping) else weights
        with torch.no_grad():
            for hf_name, tensor in items:
                for megatron_name, piece in self.by_hf.get(hf_name, ()):
                    source_piece = dataclasses.replace(piece, hf_start=0) if sliced else piece
                    view = weight_maps.megatron_view(self.live[megatron_name], piece)
                    view.copy_(weight_maps.hf_view(tensor, source_piece))

    def load(self, source: str) -> None:
        """Load weights from a ``tiny://``, ``random://`` or checkpoint-folder source, in place."""
        parsed = model_sources.parse_source(source)
        if parsed.shape != self.shape:
            raise ValueError(f"{source} has shape {parsed.shape}, the loaded model {self.shape}")
        if parsed.kind == "tiny":
            from megafleet_engine.models import tiny

            self.write(tiny.reference_weights(parsed.path))
        elif parsed.kind == "random":
            self.fill_random(parsed.seed)
        else:
            self.read_checkpoint(Path(parsed.path))

    def zero(self) -> None:
        """Deferred init: the parameters exist but hold zeros until the first refit writes them."""
        with torch.no_grad():
            for tensor in self.live.values():
                tensor.zero_()

    def fill_random(self, seed: int) -> None:
        """Random weights drawn on the GPU from ``seed`` (normal, std :data:`RANDOM_STD`; norms 1)."""
        device = next(iter(self.live.values())).device
        generator = torch.Generator(device=device)
        generator.manual_seed(seed * 1_000_003 + self.layout.pp_rank * 1_009 + self.layout.tp_rank)
        with torch.no_grad():
            for name in sorted(self.live):
                tensor = self.live[name]
                if name.endswith(("layernorm.weight", "layer_norm_weight")):
                    tensor.fill_(1.0)
                else:
                    tensor.normal_(0.0, RANDOM_STD, generator=generator)

    def read_checkpoint(self, folder: Path) -> None:
        """Read only this rank's slices of each tensor of the ``*.safetensors`` files in ``folder``."""
        from safetensors import safe_open

        needed = set(self.by_hf)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{folder} holds no *.safetensors files")
        with torch.no_grad():
            for path in files:
                with safe_open(str(path), framework="pt", device="cpu") as handle:
                    for hf_name in sorted(needed & set(handle.keys())):
                        full = handle.get_slice(hf_name)
                        for megatron_name, piece in self.by_hf[hf_name]:
                            dim, start, stop = piece.hf_range
                            part = full[start:stop] if dim == 0 else full[:, start:stop]
                            view = weight_maps.megatron_view(self.live[megatron_name], piece)
                            view.copy_(weight_maps.hf_view(part, dataclasses.replace(piece, hf_start=0)))
                        needed.discard(hf_name)
        if needed:
            raise ValueError(f"checkpoint {folder} lacks {len(needed)} parameters, e.g. {sorted(needed)[:3]}")


class Settlement:
    """A following rank's record of its own writes: the outcome by weight version, recorded from
    any thread, waited for when the first rank asks (settle)."""

    def __init__(self) -> None:
        self._written: dict[int, bool] = {}
        self._written_changed = threading.Condition()

    def forget(self) -> None:
        """A new refit begins: old outcomes no longer answer anything."""
        with self._written_changed:
            self._written.clear()

    def record(self, version: int, ok: bool) -> None:
        with self._written_changed:
            self._written[version] = ok
            self._written_changed.notify_all()

    def wait(self, version: int, timeout_seconds: float) -> bool:
        """The outcome of ``version``, waiting up to ``timeout_seconds`` for it (``False`` if none)."""
        deadline = time.monotonic() + timeout_seconds
        with self._written_changed:
            while version not in self._written:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.error("weight version %d: this rank's writes did not end in time", version)
                    return False
                self._written_changed.wait(left)
            return self._written[version]
