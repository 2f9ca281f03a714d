"""A rank's parameter digests (:mod:`megafleet_protocol.refit.parameter_digests`), what a megatron-native
swap or a checkpoint load reports for the members' agreement: the groups (name order, 8-byte
alignment, the size limit), each group's digest equal to numpy's ``mf64`` of its bytes laid out as the
definition says (computed tensor by tensor with :func:`digest.seed_at`, never copied together), and
the same digests for the same bytes whatever the order, dtype or layout of the tensors handed in; a
changed byte changes its group's digest only. The transformers backend's parameters (the tiny Llama on
CPU) take the same path the megatron backend's take on a GPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megafleet_engine.backends import transformers_backend
from megafleet_engine.models import tiny
from megafleet_protocol.refit import digest, parameter_digests

Placed = parameter_digests.Placed


def mixed() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return {
        "z.weight": torch.randn(40, 10, generator=generator),
        "a.embed": torch.randn(7, 9, generator=generator).to(torch.bfloat16),  # 126 bytes: the next is padded
        "m.odd": torch.randint(0, 255, (3,), dtype=torch.uint8, generator=generator),
        "b.norm": torch.randn(33, generator=generator),
        "c.mask": torch.tensor([True, False, True]),
        "d.empty": torch.zeros(0),
    }


@pytest.mark.parametrize(
    ("sizes", "group_bytes", "groups"),
    [
        pytest.param([("b", 8), ("a", 8)], 64, [[Placed("a", 0, 8), Placed("b", 8, 8)]], id="name-order"),
        pytest.param([("a", 3), ("b", 5), ("c", 1)], 64, [[Placed("a", 0, 3), Placed("b", 8, 5), Placed("c", 16, 1)]],
                     id="each-at-a-multiple-of-8"),
        pytest.param([("a", 20), ("b", 20), ("c", 20)], 48, [[Placed("a", 0, 20), Placed("b", 24, 20)],
                                                             [Placed("c", 0, 20)]], id="closes-before-it-would-pass"),
        pytest.param([("a", 8), ("b", 100), ("c", 8)], 32, [[Placed("a", 0, 8)], [Placed("b", 0, 100)],
                                                            [Placed("c", 0, 8)]], id="a-larger-tensor-alone"),
        pytest.param([("a", 0), ("b", 8)], 8, [[Placed("a", 0, 0), Placed("b", 0, 8)]], id="empty-takes-no-room"),
        pytest.param([], 8, [], id="nothing"),
    ],
)  # fmt: skip
def test_groups_follow_name_order_alignment_and_the_size_limit(
    sizes: list[tuple[str, int]], group_bytes: int, groups: list[list[Placed]]
) -> None:
    assert parameter_digests.plan_groups(sizes, group_bytes) == groups


def test_a_group_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        parameter_digests.plan_groups([("a", 8)], 0)


@pytest.mark.parametrize("group_bytes", [64, 512, 1 << 30])
def test_each_groups_digest_is_mf64_of_its_bytes_as_laid_out(group_bytes: int) -> None:
    tensors = mixed()
    outcome = parameter_digests.digest_tensors(tensors, group_bytes=group_bytes)
    want = parameter_digests.reference(tensors, group_bytes)
    assert (outcome.integrity, outcome.method, outcome.buckets) == ("checksum", "agreement", len(want))
    assert list(outcome.bucket_digests) == want
    assert outcome.mismatch is None and outcome.non_finite is None


def test_the_same_bytes_give_the_same_digests_whatever_the_order_and_layout() -> None:
    tensors = mixed()
    reordered = dict(reversed(list(tensors.items())))
    strided = dict(tensors)
    strided["z.weight"] = tensors["z.weight"].t().contiguous().t()  # the same values in another layout
    assert not strided["z.weight"].is_contiguous()
    digests = [
        parameter_digests.digest_tensors(one, group_bytes=512).bucket_digests for one in (tensors, reordered, strided)
    ]
    assert digests[0] == digests[1] == digests[2]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(mixed())), st.integers(min_value=0), st.integers(min_value=1, max_value=255))
def test_a_changed_byte_changes_its_groups_digest_only(name: str, where: int, flip: int) -> None:
    tensors = mixed()
    if tensors[name].numel() == 0:
        return
    before = parameter_digests.digest_tensors(tensors, group_bytes=512).bucket_digests
    changed = {key: tensor.clone() for key, tensor in tensors.items()}
    raw = changed[name].reshape(-1).view(torch.uint8)
    raw[where % raw.numel()] ^= flip
    after = parameter_digests.digest_tensors(changed, group_bytes=512).bucket_digests
    groups = parameter_digests.plan_groups([(key, t.numel() * t.element_size()) for key, t in tensors.items()], 512)
    holding = next(index for index, group in enumerate(groups) if name in {placed.name for placed in group})
    assert [index for index, (one, two) in enumerate(zip(before, after, strict=True)) if one != two] == [holding]


def test_no_tensors_no_digests() -> None:
    outcome = parameter_digests.digest_tensors({})
    assert (outcome.method, outcome.buckets, outcome.bucket_digests) == ("agreement", 0, ())


def test_a_ranges_seed_makes_its_digest_that_part_of_the_whole() -> None:
    data = torch.randint(0, 256, (8 * 37 + 5,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    whole = digest.reference(data.numpy().tobytes(), 9)
    parts = [(0, 8 * 10), (8 * 10, 8 * 30), (8 * 30, data.numel())]
    total = sum(
        int(digest.digest(data[start:end].clone(), digest.seed_at(9, start // 8)).item()) for start, end in parts
    )
    assert digest.unsigned(total) == whole


def test_two_backends_with_the_same_weights_agree_and_another_version_does_not() -> None:
    """The tiny Llama's parameters as the transformers backend holds them (the megatron backend hands
    its own to the same function): two engines of one checkpoint agree, another version does not."""
    one, two = (
        transformers_backend.TransformersBackend(*tiny.build_tiny("tiny://llama"), name="tiny", max_sequence_length=64)
        for _ in "ab"
    )
    digests = [parameter_digests.digest_tensors(b.parameters(), group_bytes=1 << 14).bucket_digests for b in (one, two)]
    assert len(digests[0]) > 3 and digests[0] == digests[1]
    assert list(digests[0]) == parameter_digests.reference(one.parameters(), 1 << 14)
    two.load_checkpoint("tiny://llama?seed=1")
    other = parameter_digests.digest_tensors(two.parameters(), group_bytes=1 << 14).bucket_digests
    changed = [index for index, (a, b) in enumerate(zip(digests[0], other, strict=True)) if a != b]
    assert len(changed) > len(other) // 2, "groups of learned weights differ (the norms' ones may not)"
