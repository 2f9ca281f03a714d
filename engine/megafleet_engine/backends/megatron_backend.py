"""The ``megatron`` backend: megatron-core's dynamic inference engine on one or more GPUs.

Called through :func:`megafleet_engine.backends.load_backend` by the engine process (and by
``bench/engine_megatron.py`` and the GPU tests). megatron-core (>= 0.19, Python >= 3.12) and a
flash-attention kernel (FA2 >= 2.7.3, FA3 or FA4) are needed at run time only: this module imports
megatron lazily, inside functions, so it imports (and type-checks) anywhere.

Model sources (``MEGAFLEET_MODEL_SOURCE``):

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

Generation (continuous batching): a batch is added to megatron's engine as one set of requests and
stepped; before every step the scheduler's ``admit`` hands over sequences that arrived meanwhile
(``add_request`` between steps: megatron schedules them into the next step with the running ones)
and names those it closed, which end through megatron's own early-finish path (the set its
stop-word logic uses), as do sequences that sampled a stop id megatron does not know. Each step
yields the tokens it produced. Sampling maps onto megatron's per-request parameters (greedy =
``top_k=1``; megatron refuses top-k together with top-p and has one sampling generator, so
per-request seeds are ignored). EOS stops through megatron's ``termination_id``. Log-probabilities
are megatron's ``raw_logprobs``: ``log_softmax`` of the raw logits.

Weights: :meth:`MegatronBackend.parameters` returns, by Hugging Face name, views that alias the live
megatron parameters (fused QKV and gate/up included), and :meth:`MegatronBackend.write_weights`
copies HF tensors (whole, or only this rank's slice) into them. Writes are in-place ``copy_`` into
the same storage, which captured CUDA graphs read at replay.

Refits and the KV cache, through megatron's ``KVCacheManagementMode`` (the engine passes its
``kv_cache_mode``, by default ``EngineOptions.kv_cache_mode``):
:meth:`~MegatronBackend.begin_weight_update` suspends megatron's engine and
:meth:`~MegatronBackend.finish_weight_update` resumes it. ``persist`` keeps the KV buffer and CUDA
graphs; ``offload`` frees the KV buffer (into a pinned host copy when built with
``kv_cache_mode="offload"``, else by deleting it) and the graphs, then rebuilds both; ``recompute``
deletes the KV buffer and the graphs and allocates a fresh buffer and block allocator after. The
scheduler drains or aborts every request before a refit and megatron's prefix caching is off, so in
every mode no KV block computed with old weights serves a request after the refit.

Tensor/pipeline parallel > 1: every rank of the model-parallel group builds the backend (same
arguments); the first rank's :meth:`~MegatronBackend.generate` broadcasts one small message per
engine step (sequences joining and leaving) and the refit suspend/resume, and the other ranks run
:meth:`~MegatronBackend.serve_followers`, which applies them and steps in lockstep. In a refit every
rank writes its own weights; the other ranks' ``begin/finish_weight_update`` do nothing (the first
rank's suspend and resume drive them), and before the first rank resumes,
:meth:`~MegatronBackend.settle_weight_update` asks every rank whether it holds the whole new version
(an all-reduce): the shard resumes only if all do, so it never computes with two versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import itertools
import json
import logging
import socket
import threading
import time
import urllib.parse
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from megafleet_engine.backends import base, weight_maps
from megafleet_engine.backends.weight_maps import Layout, LlamaShape
from megafleet_protocol import vocabulary

__all__ = [
    "PRESETS",
    "EngineOptions",
    "MegatronBackend",
    "ModelSource",
    "Parallel",
    "load",
    "parse_source",
    "to_megatron_sampling",
]

log = logging.getLogger(__name__)

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
RANDOM_STD = 0.02
_SHAPE_KEYS = ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "head_dim")
_FIRST_REQUEST_ID = 1 << 30  # megatron keeps ids in int32; its own counter (engine.generate) starts at 0


# -- sources -------------------------------------------------------------------------------------


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


# -- options -------------------------------------------------------------------------------------


Parallel = base.Parallel  # re-exported: how a rank joins the model-parallel group


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Settings of megatron's dynamic engine."""

    max_batch_size: int = 64
    """Most requests decoded together (megatron's ``max_requests``); decode CUDA graphs are
    captured for batch sizes up to it."""
    kv_buffer_gb: float = 20.0
    """GPU memory reserved for the paged KV cache."""
    max_step_tokens: int = 16384
    """Most tokens in one forward pass (prefill chunks included; megatron's ``max_tokens``)."""
    block_size_tokens: int = 256
    cuda_graphs: bool = True
    """Capture decode CUDA graphs (per layer) at start; eager decode is host-bound."""
    seed: int = 0
    """Seed of megatron's RNG trackers (sampling)."""
    kv_cache_mode: vocabulary.KvCacheMode = "persist"
    """The default KV-cache mode of refits (the engine passes it unless told otherwise): see
    :meth:`MegatronBackend.begin_weight_update`. ``offload`` also pins a host copy of the KV
    buffer's size at start (megatron's ``KVCacheManagementMode.OFFLOAD``)."""


# -- the tokenizer stub megatron's engine calls ----------------------------------------------------


class _IdTokenizer:
    """What megatron's controller asks of a tokenizer. Text is never needed here: a token list
    "detokenizes" to its ids, which lets top-n log-probabilities (keyed by text) map back to ids."""

    def __init__(self, eod: int, bos: int | None) -> None:
        self.eod = eod
        self.bos = bos

    def tokenize(self, text: str) -> list[int]:
        return [int(part) for part in text.split()]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return " ".join(str(int(token)) for token in tokens)


# -- sampling ------------------------------------------------------------------------------------


def to_megatron_sampling(params: base.SamplingParams, *, budget: int, termination_id: int) -> dict[str, Any]:
    """Keyword arguments of megatron's ``SamplingParams`` for one sequence (``budget``: tokens it
    may generate). Raises ``ValueError`` for what megatron cannot do (top-k with top-p)."""
    top_p = params.top_p if params.top_p < 1.0 else 0.0  # megatron: 0.0 = no nucleus cut
    if params.greedy:
        temperature, top_k, top_p = 1.0, 1, 0.0
    else:
        temperature, top_k = params.temperature, params.top_k
    if top_k > 0 and top_p > 0.0:
        raise ValueError("the megatron backend cannot combine top_k and top_p")
    return {
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "return_log_probs": params.logprobs is not None,
        "skip_prompt_log_probs": True,
        "top_n_logprobs": params.logprobs or 0,
        "num_tokens_to_generate": min(params.max_tokens, budget),
        "termination_id": -1 if params.ignore_eos else termination_id,
    }


@dataclasses.dataclass
class _Sequence:
    request: base.SequenceRequest
    stops: frozenset[int]
    emitted: int = 0
    done: bool = False


@dataclasses.dataclass(frozen=True)
class _Tick:
    """What the first rank of a model-parallel group tells the others before each engine step
    (``control`` empty: sequences joining, megatron ids leaving), or a control message."""

    join: tuple[base.SequenceRequest, ...] = ()
    leave: tuple[int, ...] = ()
    control: Literal["", "suspend", "resume", "reset", "settle"] = ""
    mode: str = "persist"
    version: int = -1  # settle: the weight version every rank must hold
    timeout_seconds: float = 0.0  # settle: how long a rank may still take to finish its writes


# -- the backend ---------------------------------------------------------------------------------


class MegatronBackend:
    """A :class:`~megafleet_engine.backends.base.Backend` over megatron-core's ``DynamicInferenceEngine``.

    Attributes besides the protocol's: ``engine`` (megatron's engine, usable directly), ``model``
    (the ``GPTModel``), ``shape``, ``layout`` (this rank's part), ``tokenizer`` (for the
    frontend; ``None`` for a checkpoint without tokenizer files) and ``kv_cache_mode``.
    """

    supports_admission = True

    def __init__(
        self,
        *,
        engine: Any,
        model: Any,
        source: ModelSource,
        layout: Layout,
        name: str,
        max_sequence_length: int,
        tokenizer: Any,
        group: Any = None,
        max_requests: int = 64,
        kv_cache_mode: vocabulary.KvCacheMode = "persist",
    ) -> None:
        self.engine = engine
        self.model = model
        self.shape = source.shape
        self.layout = layout
        self.tokenizer = tokenizer
        self._group = group  # model-parallel process group when it spans several ranks
        self._leader = group is None or (layout.tp_rank == 0 and layout.pp_rank == 0)
        self._max_requests = max_requests
        self.kv_cache_mode: vocabulary.KvCacheMode = kv_cache_mode
        self._suspended = False
        # Following ranks: the outcome of this rank's own writes, by weight version, for settle.
        self._written: dict[int, bool] = {}
        self._written_changed = threading.Condition()
        # The running batch (first rank): sequences by megatron id, megatron ids by request id,
        # and the ids to stop at the next tick (a stop token megatron does not know was sampled).
        self._sequences: dict[int, _Sequence] = {}
        self._by_key: dict[str, int] = {}
        self._stops: set[int] = set()
        eos = source.eos_token_ids[0] if source.eos_token_ids else None
        self.info = base.ModelInfo(
            name=name,
            max_sequence_length=max_sequence_length,
            vocab_size=source.shape.vocab,
            eos_token_id=eos,
        )
        self._other_eos = frozenset(source.eos_token_ids[1:])
        self._loop = asyncio.new_event_loop()  # megatron's engine runs its coroutines on this loop
        engine._loop = self._loop
        self._ids = itertools.count(_FIRST_REQUEST_ID)
        self._device = torch.cuda.current_device()  # the current device is per thread
        self._live: dict[str, torch.Tensor] = {name: p.data for name, p in model.named_parameters()}
        self._specs = weight_maps.shard_map(self.shape, layout)
        missing, extra = set(self._specs) - set(self._live), set(self._live) - set(self._specs)
        if missing or extra:
            raise RuntimeError(
                f"megatron's parameters differ from the weight map: missing {sorted(missing)[:4]}, "
                f"unexpected {sorted(extra)[:4]}"
            )
        self._by_hf: dict[str, list[tuple[str, weight_maps.Piece]]] = {}
        for spec in self._specs.values():
            for piece in spec.pieces:
                self._by_hf.setdefault(piece.hf_name, []).append((spec.name, piece))

    # -- weights -------------------------------------------------------------------------------

    def parameters(self) -> dict[str, torch.Tensor]:
        """This rank's part of every HF parameter, as views of the live megatron tensors.

        A view has the shape of the HF slice it holds, except where one strided view covers
        several query groups of a fused QKV (``(groups, rows per group, hidden)``): write with
        ``view.copy_(hf_slice.view(view.shape))``. :attr:`shard_map` says which slice each is.
        """
        views = {}
        for hf_name, targets in self._by_hf.items():
            megatron_name, piece = targets[0]
            views[hf_name] = weight_maps.megatron_view(self._live[megatron_name], piece)
        return views

    @property
    def shard_map(self) -> dict[str, weight_maps.ParamSpec]:
        """Megatron parameters of this rank and the HF slices they are made of."""
        return self._specs

    def write_weights(
        self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *, sliced: bool = False
    ) -> None:
        """Copy HF tensors into the live parameters in place (dtype and device converted).

        ``sliced=False``: each tensor is the whole HF tensor. ``sliced=True``: each tensor is only
        the range this rank needs (``piece.hf_range`` of the name's piece in :attr:`shard_map`).
        Names this rank does not hold are ignored (the refit sender may broadcast everything).
        """
        items = weights.items() if isinstance(weights, Mapping) else weights
        with torch.no_grad():
            for hf_name, tensor in items:
                for megatron_name, piece in self._by_hf.get(hf_name, ()):
                    source_piece = dataclasses.replace(piece, hf_start=0) if sliced else piece
                    view = weight_maps.megatron_view(self._live[megatron_name], piece)
                    view.copy_(weight_maps.hf_view(tensor, source_piece))

    def load_checkpoint(self, source: str) -> None:
        """Load weights from a ``tiny://``, ``random://`` or checkpoint-folder source, in place."""
        parsed = parse_source(source)
        if parsed.shape != self.shape:
            raise ValueError(f"{source} has shape {parsed.shape}, the loaded model {self.shape}")
        if parsed.kind == "tiny":
            from megafleet_engine.models import tiny

            self.write_weights(tiny.reference_weights(parsed.path))
        elif parsed.kind == "random":
            self._fill_random(parsed.seed)
        else:
            self._read_checkpoint(Path(parsed.path))

    def zero_weights(self) -> None:
        """Deferred init: the parameters exist but hold zeros until the first refit writes them."""
        with torch.no_grad():
            for tensor in self._live.values():
                tensor.zero_()

    def _fill_random(self, seed: int) -> None:
        device = next(iter(self._live.values())).device
        generator = torch.Generator(device=device)
        generator.manual_seed(seed * 1_000_003 + self.layout.pp_rank * 1_009 + self.layout.tp_rank)
        with torch.no_grad():
            for name in sorted(self._live):
                tensor = self._live[name]
                if name.endswith(("layernorm.weight", "layer_norm_weight")):
                    tensor.fill_(1.0)
                else:
                    tensor.normal_(0.0, RANDOM_STD, generator=generator)

    def _read_checkpoint(self, folder: Path) -> None:
        from safetensors import safe_open

        needed = set(self._by_hf)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{folder} holds no *.safetensors files")
        with torch.no_grad():
            for path in files:
                with safe_open(str(path), framework="pt", device="cpu") as handle:
                    for hf_name in sorted(needed & set(handle.keys())):
                        full = handle.get_slice(hf_name)
                        for megatron_name, piece in self._by_hf[hf_name]:
                            dim, start, stop = piece.hf_range
                            part = full[start:stop] if dim == 0 else full[:, start:stop]
                            view = weight_maps.megatron_view(self._live[megatron_name], piece)
                            view.copy_(weight_maps.hf_view(part, dataclasses.replace(piece, hf_start=0)))
                        needed.discard(hf_name)
        if needed:
            raise ValueError(f"checkpoint {folder} lacks {len(needed)} parameters, e.g. {sorted(needed)[:3]}")

    # -- refits: KV cache and CUDA graphs ------------------------------------------------------

    def begin_weight_update(self, kv_cache_mode: vocabulary.KvCacheMode) -> None:
        """Suspend megatron's engine for a refit (nothing may be in flight), through megatron's
        ``KVCacheManagementMode``: ``persist`` keeps the KV buffer and CUDA graphs; ``offload``
        frees both (the KV buffer goes to its pinned host copy when the backend was built with
        ``EngineOptions.kv_cache_mode="offload"``, else it is deleted as in ``recompute``: nothing is
        in flight, so its contents are not needed); ``recompute`` deletes the KV buffer (every
        context tensor) and the CUDA graphs. Freed memory goes back to the device. Idempotent; on a
        model-parallel group the first rank leads and the others follow."""
        _check_mode(kv_cache_mode)
        if not self._leader:  # the first rank's suspend reaches serve_followers(); forget old outcomes
            with self._written_changed:
                self._written.clear()
            return
        if self._group is not None:
            self._broadcast(_Tick(control="suspend", mode=kv_cache_mode))
        self._suspend(kv_cache_mode)

    def finish_weight_update(self, kv_cache_mode: vocabulary.KvCacheMode) -> None:
        """Resume megatron's engine after a refit, mirroring :meth:`begin_weight_update`: the KV
        buffer comes back (copied back from the host, or freshly allocated with a fresh block
        allocator, so no block computed with the old weights survives) and the CUDA graphs are
        recaptured; ``persist`` changes nothing (weights were copied into the same storage, which
        the graphs read at replay). Without a :meth:`begin_weight_update` before, ``recompute``
        still drops and rebuilds the KV cache; the other modes have nothing to do. Idempotent."""
        _check_mode(kv_cache_mode)
        if not self._leader:  # the first rank's resume reaches serve_followers()
            return
        if self._group is not None:
            self._broadcast(_Tick(control="resume", mode=kv_cache_mode))
        self._resume(kv_cache_mode)

    @property
    def follows(self) -> bool:
        """Whether this rank follows the first rank of its model-parallel group."""
        return not self._leader

    @property
    def spans_ranks(self) -> bool:
        """Whether this shard has rank processes other than this one (``settle_weight_update`` has
        others to ask; with one rank it would only return its argument)."""
        return self._group is not None

    def settle_weight_update(self, version: int, *, ok: bool, timeout_seconds: float) -> bool:
        """Agree, across the model-parallel group, that every rank holds weight ``version``.

        First rank (on the backend thread, after its own writes, before its resume): tell the others
        to answer, then all-reduce their answers; ``True`` only if every rank wrote the whole
        version. A following rank (any thread) records ``ok`` for that question and returns it; it
        answers when asked, waiting up to ``timeout_seconds`` (the first rank's remaining refit
        time) for its own writes to end, and answers ``False`` if they do not."""
        if self._group is None:
            return ok
        if not self._leader:
            with self._written_changed:
                self._written[version] = ok
                self._written_changed.notify_all()
            return ok
        if not ok:
            return False
        torch.cuda.set_device(self._device)
        self._broadcast(_Tick(control="settle", version=version, timeout_seconds=timeout_seconds))
        return self._agree(True)

    def _await_written(self, version: int, timeout_seconds: float) -> bool:
        deadline = time.monotonic() + timeout_seconds
        with self._written_changed:
            while version not in self._written:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.error("weight version %d: this rank's writes did not end in time", version)
                    return False
                self._written_changed.wait(left)
            return self._written[version]

    def _agree(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=torch.device("cuda", self._device))
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    @property
    def suspended(self) -> bool:
        """Between :meth:`begin_weight_update` and :meth:`finish_weight_update`."""
        return self._suspended

    def _suspend(self, kv_cache_mode: str) -> None:
        torch.cuda.set_device(self._device)
        if self._suspended:
            return
        if self.engine.has_unfinished_requests():
            raise RuntimeError("a weight update cannot begin while megatron's engine has requests in flight")
        # megatron's offload needs the pinned host copy it allocates with the KV buffer
        effective = "recompute" if kv_cache_mode == "offload" and self.kv_cache_mode != "offload" else kv_cache_mode
        modes = _megatron("inference.config").KVCacheManagementMode
        self.engine.context.kv_cache_management_mode = modes(effective)  # read by suspend() and resume()
        self.engine.suspend()
        if effective != "persist":
            torch.cuda.empty_cache()
        self._suspended = True

    def _resume(self, kv_cache_mode: str) -> None:
        torch.cuda.set_device(self._device)
        if not self._suspended:
            if kv_cache_mode != "recompute":
                return
            self._suspend(kv_cache_mode)
        self.engine.resume()  # mirrors the suspend's mode, still set on the context
        modes = _megatron("inference.config").KVCacheManagementMode
        self.engine.context.kv_cache_management_mode = modes(self.kv_cache_mode)
        self._suspended = False

    # -- generation ----------------------------------------------------------------------------

    def generate(
        self, batch: Sequence[base.SequenceRequest], admit: base.Admit | None = None
    ) -> Iterator[list[base.TokenStep]]:
        """Run ``batch`` on megatron's engine, one yielded list per engine step; with ``admit``,
        take new sequences into the running batch between steps (continuous batching)."""
        if not self._leader:
            raise RuntimeError("on a model-parallel rank other than the first, run serve_followers()")
        if self._suspended:
            raise RuntimeError("the backend is suspended for a weight update (finish_weight_update first)")
        return self._lead(list(batch), admit)

    def serve_followers(self) -> None:
        """On model-parallel ranks other than the first: apply every message the first rank
        broadcasts (sequences joining and leaving, suspend, resume) and step in lockstep with it,
        until it broadcasts ``None`` (:meth:`close`)."""
        if self._leader:
            raise RuntimeError("serve_followers() runs on model-parallel ranks other than the first")
        torch.cuda.set_device(self._device)
        while True:
            tick = self._broadcast(None)
            if tick is None:
                return
            try:
                if tick.control == "suspend":
                    self._suspend(tick.mode)
                elif tick.control == "resume":
                    self._resume(tick.mode)
                elif tick.control == "reset":
                    self._reset()
                elif tick.control == "settle":
                    self._agree(self._await_written(tick.version, tick.timeout_seconds))
                else:
                    self._apply(tick)
                    if self.engine.has_unfinished_requests():
                        self._step()
            except Exception:  # the first rank fails alike and sends a reset: stay in lockstep for it
                log.exception("model-parallel follower: applying %s failed", tick.control or "a step")

    def close(self) -> None:
        """Release the followers (first rank only) and this backend's event loop."""
        if self._group is not None and self._leader:
            self._broadcast(None)
        self._loop.close()

    def _broadcast(self, tick: _Tick | None) -> _Tick | None:
        box: list[Any] = [tick]
        source = torch.distributed.get_global_rank(self._group, 0)
        torch.distributed.broadcast_object_list(box, src=source, group=self._group)
        result: _Tick | None = box[0]
        return result

    def _tick(self, tick: _Tick) -> list[base.TokenStep]:
        """First rank: send ``tick`` to the followers and apply it here."""
        if self._group is not None:
            self._broadcast(tick)
        return self._apply(tick)

    def _step(self) -> dict[str, Any]:
        result: dict[str, Any] = self._loop.run_until_complete(self.engine.async_step())
        return result

    def _lead(self, batch: list[base.SequenceRequest], admit: base.Admit | None) -> Iterator[list[base.TokenStep]]:
        """The first rank's batch loop: before every step, one tick (sequences joining: the batch,
        then what ``admit`` hands over; sequences leaving: closed by the scheduler or ended here by
        a stop token megatron does not know), which the followers apply too; then one step."""
        torch.cuda.set_device(self._device)  # generate() runs on the engine's own thread
        joining = batch
        outcome = "failed"
        try:
            while True:
                leaving, self._stops = self._stops, set()
                if admit is not None:
                    room = max(0, self._max_requests - len(self._sequences) - len(joining))
                    admission = admit(room)
                    joining = [*joining, *admission.join]
                    leaving |= {self._by_key[key] for key in admission.leave if key in self._by_key}
                rejected = self._tick(_Tick(join=tuple(joining), leave=tuple(sorted(leaving))))
                joining = []
                if rejected:
                    yield rejected
                if not self.engine.has_unfinished_requests():
                    outcome = "done"
                    return
                steps = self._collect(self._step())
                if steps:
                    yield steps
        except GeneratorExit:
            outcome = "closed"
            raise
        finally:
            if outcome == "closed":
                self._wind_down()
            elif outcome == "failed":
                self._recover()
            self._sequences.clear()
            self._by_key.clear()
            self._stops.clear()

    def _wind_down(self) -> None:
        """The scheduler closed the batch early: stop every request megatron still runs."""
        while self.engine.has_unfinished_requests():
            self._tick(_Tick(leave=tuple(sorted(self.engine.requests))))
            self._step()

    def _recover(self) -> None:
        """A step failed: drop every request so the next batch starts from a clean engine."""
        log.warning("resetting megatron's engine after a failed step")
        with contextlib.suppress(Exception):
            if self._group is not None:
                self._broadcast(_Tick(control="reset"))
            self._reset()

    def _reset(self) -> None:
        self.engine.reset()
        self.engine.stop_word_finished_request_ids.clear()

    def _apply(self, tick: _Tick) -> list[base.TokenStep]:
        """Add the joining sequences to megatron's engine and stop the leaving ones (every rank
        does the same, in the same order). Returns an ``abort`` step for each joining sequence
        that cannot run (first rank only)."""
        sampling_params = _megatron("inference.sampling_params")
        eos = self.info.eos_token_id
        termination = -1 if eos is None else eos
        rejected: list[base.TokenStep] = []
        for request in tick.join:
            request_id = next(self._ids)  # consumed on every rank alike, so the ids agree
            prompt = list(request.prompt_token_ids) or [self.engine.controller.tokenizer.eod]
            budget = self.info.max_sequence_length - len(prompt)
            try:
                if budget <= 0:
                    raise ValueError(f"a prompt of {len(prompt)} tokens leaves no room to generate")
                sampling = sampling_params.SamplingParams(
                    **to_megatron_sampling(request.params, budget=budget, termination_id=termination)
                )
            except ValueError as error:
                if self._leader:
                    log.warning("request %s cannot run: %s", request.request_id, error)
                    rejected.append(_no_token(request.request_id))
                continue
            future = self.engine.add_request(request_id, prompt, sampling)
            if future.done():  # megatron refused it at once (e.g. more blocks than the KV cache has)
                if self._leader:
                    log.warning("megatron refused request %s", request.request_id)
                    rejected.append(_no_token(request.request_id))
                continue
            if self._leader:
                params = request.params
                stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._other_eos)
                self._sequences[request_id] = _Sequence(request, stops)
                self._by_key[request.request_id] = request_id
        for request_id in tick.leave:
            sequence = self._sequences.get(request_id)
            if sequence is not None:
                sequence.done = True
            if request_id in self.engine.requests:  # megatron's own early finish (as for stop words)
                self.engine.stop_word_finished_request_ids.add(request_id)
        return rejected

    def _collect(self, result: dict[str, Any]) -> list[base.TokenStep]:
        """The tokens one step produced for the running sequences."""
        steps: list[base.TokenStep] = []
        for request_id in result["active_request_ids"]:
            sequence = self._sequences.get(request_id)
            if sequence is not None and not sequence.done:
                record = self.engine.requests[request_id].record
                request = record.requests[-1] if len(record.requests) == 1 else record.merge()
                steps.extend(self._new_steps(sequence, request_id, request, False))
        for record in result["finished_request_records"]:
            merged = record.requests[-1] if len(record.requests) == 1 else record.merge()
            sequence = self._sequences.pop(merged.request_id, None)
            if sequence is None:
                continue
            self._by_key.pop(sequence.request.request_id, None)
            if not sequence.done:
                steps.extend(self._new_steps(sequence, merged.request_id, merged, True))
            if not sequence.done:  # ended without a token: megatron failed it
                log.warning("megatron request for %s ended with status %s", sequence.request.request_id, merged.status)
                steps.append(_no_token(sequence.request.request_id))
                sequence.done = True
        return steps

    def _new_steps(self, sequence: _Sequence, request_id: int, request: Any, finished: bool) -> list[base.TokenStep]:
        generated = request.generated_tokens
        params = sequence.request.params
        steps = []
        for index in range(sequence.emitted, len(generated)):
            token = int(generated[index])
            last = finished and index == len(generated) - 1
            finish: base.FinishReason | None = None
            if token in sequence.stops or (not params.ignore_eos and token == self.info.eos_token_id):
                finish = "stop"
            elif last or index + 1 >= params.max_tokens:
                finish = "length"
            steps.append(
                base.TokenStep(
                    request_id=sequence.request.request_id,
                    token_id=token,
                    logprob=_logprob(request, index) if params.logprobs is not None else None,
                    top_logprobs=_top_logprobs(request, index) if params.logprobs else (),
                    finish_reason=finish,
                )
            )
            if finish is not None:
                sequence.done = True
                if not finished:  # megatron would go on (a stop id it does not know): end it
                    self._stops.add(request_id)
                break
        sequence.emitted = len(generated)
        return steps


def _check_mode(kv_cache_mode: str) -> None:
    if kv_cache_mode not in ("persist", "offload", "recompute"):
        raise ValueError(f"unknown KV-cache mode {kv_cache_mode!r}: persist, offload or recompute")


def _no_token(request_id: str) -> base.TokenStep:
    return base.TokenStep(request_id=request_id, token_id=base.NO_TOKEN, logprob=None, finish_reason="abort")


def _logprob(request: Any, index: int) -> float | None:
    values = request.generated_log_probs
    return float(values[index]) if values is not None and index < len(values) else None


def _top_logprobs(request: Any, index: int) -> tuple[tuple[int, float], ...]:
    entries = request.generated_top_n_logprobs
    if not entries or index >= len(entries):
        return ()
    ranked = sorted(((int(key), float(value)) for key, value in entries[index].items()), key=lambda kv: -kv[1])
    return tuple(ranked)


# -- building ------------------------------------------------------------------------------------


def _megatron(module: str) -> Any:
    """``megatron.core.<module>``, imported on first use (megatron-core is installed on GPU
    machines only, and mypy here has no stubs for it)."""
    return importlib.import_module(f"megatron.core.{module}")


def load(
    source: str,
    *,
    name: str,
    max_sequence_length: int,
    dtype: str,
    device: str,
    load_weights: bool,
    parallel: Parallel | None = None,
    options: EngineOptions | None = None,
) -> MegatronBackend:
    """Build the model and megatron's engine for ``source`` on this process's GPU.

    ``dtype`` must be ``bfloat16`` or ``float16`` (megatron's flash-attention kernels need them);
    ``device`` is ``cuda`` or ``cuda:N`` (with several ranks, ``Parallel.local_rank`` picks the GPU).
    Deferred init (``load_weights=False``) leaves zeros in every parameter.
    """
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"the megatron backend runs in bfloat16 or float16, not {dtype}")
    if not device.startswith("cuda"):
        raise ValueError(f"the megatron backend needs a CUDA device, not {device!r}")
    parallel = parallel or Parallel()
    options = options or EngineOptions()
    parsed = parse_source(source)
    torch_dtype: torch.dtype = getattr(torch, dtype)
    index = torch.device(device).index
    torch.cuda.set_device(parallel.local_rank if parallel.world_size > 1 or index is None else index)
    with warnings.catch_warnings():
        # megatron-core warns at import and construction about optional packages (Apex, Transformer
        # Engine) and its own deprecations; none of it concerns this configuration.
        warnings.simplefilter("ignore")
        layout, group = _init_parallel(parallel, options.seed)
        model = _build_model(parsed.shape, layout, torch_dtype, max_sequence_length, options)
        tokenizer = _tokenizer(parsed)
        eod = parsed.eos_token_ids[0] if parsed.eos_token_ids else 0
        engine = _build_engine(model, _IdTokenizer(eod, parsed.bos_token_id), max_sequence_length, options)
    backend = MegatronBackend(
        engine=engine,
        model=model,
        source=parsed,
        layout=layout,
        name=name,
        max_sequence_length=max_sequence_length,
        tokenizer=tokenizer,
        group=group,
        max_requests=options.max_batch_size,
        kv_cache_mode=options.kv_cache_mode,
    )
    if not load_weights:
        backend.zero_weights()
    elif parsed.kind == "random":
        backend._fill_random(parsed.seed)
    else:
        backend.load_checkpoint(source)
    torch.cuda.synchronize()
    return backend


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _init_parallel(parallel: Parallel, seed: int) -> tuple[Layout, Any]:
    """Join the process group and megatron's model-parallel groups (once per process)."""
    parallel_state = _megatron("parallel_state")
    tensor_parallel = _megatron("tensor_parallel")

    if parallel.world_size != parallel.tensor_parallel * parallel.pipeline_parallel:
        raise ValueError(
            f"world size {parallel.world_size} is not TP {parallel.tensor_parallel} x PP {parallel.pipeline_parallel}"
        )
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() != parallel.world_size:
        raise ValueError(
            f"the process group has {torch.distributed.get_world_size()} ranks but Parallel says "
            f"{parallel.world_size}: pass the engine's Parallel(...) to load()"
        )
    if not torch.distributed.is_initialized():
        port = parallel.master_port or (_free_port() if parallel.world_size == 1 else 29500)
        torch.distributed.init_process_group(
            "nccl",
            init_method=f"tcp://{parallel.master_addr}:{port}",
            world_size=parallel.world_size,
            rank=parallel.rank,
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_parallel,
            pipeline_model_parallel_size=parallel.pipeline_parallel,
        )
    tensor_parallel.random.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
    layout = Layout(
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel.tensor_parallel,
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=parallel.pipeline_parallel,
    )
    group = parallel_state.get_model_parallel_group() if parallel.world_size > 1 else None
    return layout, group


def _build_model(
    shape: LlamaShape, layout: Layout, dtype: torch.dtype, max_sequence_length: int, options: EngineOptions
) -> Any:
    gpt = _megatron("models.gpt")
    specs = _megatron("models.gpt.gpt_layer_specs")
    config = _megatron("transformer").TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads,
        ffn_hidden_size=shape.intermediate,
        kv_channels=shape.head_dim,
        layernorm_epsilon=shape.norm_eps,
        tensor_model_parallel_size=layout.tp_size,
        pipeline_model_parallel_size=layout.pp_size,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        transformer_impl="local",
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        perform_initialization=False,  # every parameter is written by load()
        cuda_graph_impl="local" if options.cuda_graphs else "none",
        inference_rng_tracker=True,
    )
    model = gpt.GPTModel(
        config=config,
        transformer_layer_spec=specs.get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=weight_maps.padded_vocab_size(shape.vocab, layout),
        max_sequence_length=max_sequence_length,
        pre_process=layout.first_stage,
        post_process=layout.last_stage,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
        rope_scaling=shape.rope_scaling_factor > 0,
        rope_scaling_factor=shape.rope_scaling_factor or 8.0,
    )
    model.cuda()
    for parameter in model.parameters():  # RMSNorm weights start in float32
        parameter.data = parameter.data.to(dtype)
    model.eval()
    _one_kv_split_on_hopper(model)
    return model


def _one_kv_split_on_hopper(model: Any) -> None:
    """FlashAttention-4 has no split-KV kernel for SM 9.x (Hopper: H100, H200); megatron asks for
    ``num_splits=0`` (automatic), which picks split-KV for a small decode batch over a long KV cache
    and fails (``AssertionError: SplitKV not supported on SM 9.0``; seen on H200 at CUDA-graph capture
    with 1024-token sequences, 2026-11-30). Megatron passes ``num_splits=1`` when an attention
    module's ``batch_invariant_mode`` is set, and reads nothing else from that attribute on the FA4
    path, so it is set on each attention module (not the config, which would switch other kernels)."""
    attention = _megatron("transformer.attention")
    if torch.cuda.get_device_capability()[0] != 9 or not getattr(attention, "HAVE_FA4", False):
        return
    for module in model.modules():
        if isinstance(module, attention.Attention):
            module.batch_invariant_mode = True


def _build_engine(model: Any, tokenizer: _IdTokenizer, max_sequence_length: int, options: EngineOptions) -> Any:
    config_module = _megatron("inference.config")
    config = config_module.InferenceConfig(
        block_size_tokens=options.block_size_tokens,
        buffer_size_gb=options.kv_buffer_gb,
        max_sequence_length=max_sequence_length,
        max_requests=options.max_batch_size,
        max_tokens=max(options.max_step_tokens, max_sequence_length),
        num_cuda_graphs=-1 if options.cuda_graphs else None,
        use_cuda_graphs_for_non_decode_steps=False,
        materialize_only_last_token_logits=True,
        kv_cache_management_mode=config_module.KVCacheManagementMode(options.kv_cache_mode),
    )
    context = _megatron("inference.contexts.dynamic_context").DynamicInferenceContext(model.config, config)
    wrapper = _megatron("inference.model_inference_wrappers.gpt.gpt_inference_wrapper").GPTInferenceWrapper(
        model, context
    )
    controllers = _megatron("inference.text_generation_controllers.text_generation_controller")
    controller = controllers.TextGenerationController(inference_wrapped_model=wrapper, tokenizer=tokenizer)
    return _megatron("inference.engines.dynamic_engine").DynamicInferenceEngine(controller=controller, context=context)


def _tokenizer(source: ModelSource) -> Any:
    from megafleet_engine.models import tiny

    if source.kind != "checkpoint":
        return tiny.build_tokenizer()
    if not any((Path(source.path) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    import transformers

    return transformers.AutoTokenizer.from_pretrained(source.path, local_files_only=True)
