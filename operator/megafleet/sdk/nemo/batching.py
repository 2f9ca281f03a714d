"""NeMo RL's batches in and out: input checks as ``verify_right_padding`` makes them, prompts from
right-padded ``input_ids``, and NeMo RL's ``GenerationOutputSpec`` from one answer per sample.

Called by :class:`~megafleet.sdk.nemo.adapter.MegafleetGeneration` (``generate``,
``generate_async``). Pure: tensors in, tensors out.

Output shapes (NeMo RL's ``interfaces.py``): ``output_ids`` ``[B, L+G]`` (each prompt, its generated
tokens, then pad), ``logprobs`` ``[B, L+G]`` float32 with zeros on the prompt and the padding,
``generation_lengths`` and ``unpadded_sequence_lengths`` ``[B]``, plus (NeMo RL admits extra keys)
``truncated`` (the answer hit its length limit), ``weight_versions`` and ``last_weight_versions``
``[B]`` (the versions of its first and last generated tokens; -1 unknown) and
``token_weight_versions`` ``[B, L+G]`` int64, aligned exactly like ``logprobs``: each generated
token's version at its output position, -1 on the prompt and the padding.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from megafleet.sdk import generation

__all__ = ["Outputs", "check_right_padding", "like", "pack_outputs", "prompts"]

Outputs = dict[str, torch.Tensor]


def check_right_padding(input_ids: torch.Tensor, input_lengths: torch.Tensor, pad_token_id: int) -> None:
    """Refuse input NeMo RL's ``verify_right_padding`` refuses, with its wording naming the sample,
    plus lengths below 1 (nothing to continue from).

    Raises:
        ValueError: the first problem found.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"Expected 2D tensor for padding check, got shape {tuple(input_ids.shape)}")
    batch, width = input_ids.shape
    if input_lengths.dim() != 1 or input_lengths.shape[0] != batch:
        raise ValueError(
            f"Mismatch between tensor batch size ({batch}) and lengths tensor size "
            f"({input_lengths.shape[0] if input_lengths.dim() else tuple(input_lengths.shape)})"
        )
    for index in range(batch):
        length = int(input_lengths[index])
        if length < 1:
            raise ValueError(f"Length {length} at index {index}: a prompt needs at least one token")
        if length > width:
            raise ValueError(f"Length {length} at index {index} exceeds tensor sequence dimension {width}")
        after = (input_ids[index, length:] != pad_token_id).nonzero().flatten()
        if after.numel():
            positions = [length + int(offset) for offset in after]
            raise ValueError(f"Non-padding values found after specified length at index {index}: positions {positions}")


def prompts(input_ids: torch.Tensor, input_lengths: torch.Tensor) -> list[list[int]]:
    """Each sample's prompt tokens (right padding dropped)."""
    return [[int(t) for t in input_ids[i, : int(input_lengths[i])].tolist()] for i in range(input_ids.shape[0])]


def like(data: Mapping[str, Any], outputs: Outputs) -> Any:
    """``outputs`` as the caller's mapping type (NeMo RL's ``BatchedDataDict`` is a ``UserDict``)."""
    kind = type(data)
    if kind not in (dict, collections.UserDict) and issubclass(kind, dict | collections.UserDict):
        return kind(outputs)
    return outputs


def pack_outputs(
    input_ids: torch.Tensor, input_lengths: torch.Tensor, answers: Sequence[generation.Answer], pad_token_id: int
) -> Outputs:
    """NeMo RL's generation outputs from one answer per sample (see the module docstring for shapes)."""
    batch, padded_input = input_ids.shape
    generated = [answer.token_ids for answer in answers]
    total = padded_input + max((len(tokens) for tokens in generated), default=0)
    output_ids = torch.full((batch, total), pad_token_id, dtype=input_ids.dtype)
    logprobs = torch.zeros((batch, total), dtype=torch.float32)
    token_versions = torch.full((batch, total), -1, dtype=torch.long)
    for i, (answer, tokens) in enumerate(zip(answers, generated, strict=True)):
        length = int(input_lengths[i])
        output_ids[i, :length] = input_ids[i, :length]
        output_ids[i, length : length + len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
        versions = [_known(version) for version in answer.token_weight_versions]
        token_versions[i, length : length + len(versions)] = torch.tensor(versions, dtype=torch.long)
        if answer.logprobs is not None:
            logprobs[i, length : length + len(answer.logprobs)] = torch.tensor(answer.logprobs, dtype=torch.float32)
    generation_lengths = torch.tensor([len(tokens) for tokens in generated], dtype=torch.long)
    return {
        "output_ids": output_ids,
        "logprobs": logprobs,
        "generation_lengths": generation_lengths,
        "unpadded_sequence_lengths": input_lengths.to(torch.long).cpu() + generation_lengths,
        "truncated": torch.tensor([answer.finish_reason == "length" for answer in answers], dtype=torch.bool),
        "weight_versions": torch.tensor([_known(answer.weight_version) for answer in answers], dtype=torch.long),
        "last_weight_versions": torch.tensor(
            [_known(answer.last_weight_version) for answer in answers], dtype=torch.long
        ),
        "token_weight_versions": token_versions,
    }


def _known(version: int | None) -> int:
    """A version as NeMo RL's tensors carry it: -1 unknown."""
    return -1 if version is None else version
