"""A RefitSession's refit info is the user's gzip'd ConfigMap value: nothing is inflated or parsed
beyond what ``refitInfo.tensors`` entries can take. A decompression bomb ends the session Broken
naming the ConfigMap, and the operator's memory stays flat while it is refused (measured with
tracemalloc, which sees every buffer zlib and json allocate)."""

from __future__ import annotations

import base64
import contextlib
import functools
import gzip
import hashlib
import json
import tracemalloc
import zlib
from collections.abc import Callable

import pytest

from helpers.refit_world import NS, World, condition
from megafleet.refits import refit_info_check, session_status

MIB = 1024 * 1024
ENTRY = ["model.layers.0.mlp.up_proj.weight", [14336, 4096], "bfloat16"]


@functools.cache
def bomb(expanded_mib: int, *, head: bytes = b"[") -> bytes:
    """One gzip member that inflates to ``head`` and then ``expanded_mib`` MiB of JSON whitespace,
    in about a thousandth of that: one 1 MiB deflate block, made once and repeated (a full flush
    makes each block stand alone), then the member's last block and its trailer."""
    chunk = b" " * MIB
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    first = deflate.compress(head) + deflate.flush(zlib.Z_FULL_FLUSH)
    block = deflate.compress(chunk) + deflate.flush(zlib.Z_FULL_FLUSH)
    last = deflate.flush()
    crc = zlib.crc32(head)
    for _ in range(expanded_mib):
        crc = zlib.crc32(chunk, crc)
    size = (len(head) + expanded_mib * MIB) % (1 << 32)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
    return header + first + block * expanded_mib + last + crc.to_bytes(4, "little") + size.to_bytes(4, "little")


def peak_bytes(call: Callable[[], object]) -> int:
    """The most memory Python held above what it held before, while ``call`` ran."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        with contextlib.suppress(refit_info_check.RefitInfoError):
            call()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def test_the_bomb_helper_makes_valid_gzip() -> None:
    assert gzip.decompress(bomb(2, head=b"[1]")) == b"[1]" + b" " * 2 * MIB


@pytest.mark.parametrize(
    ("tensors", "expanded_mib", "most_mib"),
    [(2, 1024, 0.25), (1 << 20, 1024, 66)],
    ids=["two-tensors", "a-million-tensors"],
)
def test_a_decompression_bomb_is_refused_with_memory_flat(tensors: int, expanded_mib: int, most_mib: float) -> None:
    """A 1 MiB ConfigMap value that would inflate to 1 GiB: refused at the bound its count allows
    (4 KiB for two tensors, 64 MiB at most), holding no more than that bound."""
    packed = bomb(expanded_mib)
    assert len(packed) < 1.1 * MIB  # fits a ConfigMap
    digest = hashlib.sha256(packed).hexdigest()
    found: list[str] = []

    def refuse() -> None:
        try:
            refit_info_check.parse(packed, sha256=digest, tensors=tensors, source="ConfigMap grpo-info key k")
        except refit_info_check.RefitInfoError as error:
            found.append(str(error))
            raise

    peak = peak_bytes(refuse)

    bound = refit_info_check.expanded_bound(tensors)
    assert found == [
        f"ConfigMap grpo-info key k expands past {bound} bytes ({len(packed)} gzip'd), more than refitInfo.tensors "
        f"{tensors} entries can take: refused unread (a decompression bomb?)"
    ]
    assert peak < most_mib * MIB, f"peak {peak / MIB:.1f} MiB while refusing a {expanded_mib} MiB bomb"
    assert peak < expanded_mib * MIB / 15


def test_more_entries_than_the_count_are_refused_before_they_are_all_built() -> None:
    """Within the bound a count of 1,000 allows (2 MiB), 150,000 short entries: 1,001 are built, then
    refused (a whole parse would build every one, about 40 MiB of lists and strings)."""
    text = json.dumps([ENTRY] * 3).encode()
    packed = gzip.compress(text)
    with pytest.raises(refit_info_check.RefitInfoError, match="holds more than 2 tensors"):
        refit_info_check.parse(packed, sha256=hashlib.sha256(packed).hexdigest(), tensors=2, source="c")
    short = json.dumps(["a", [], "f"], separators=(",", ":")).encode()
    many = gzip.compress(b"[" + b",".join([short] * 150_000) + b"]")
    assert len(short) * 150_000 < refit_info_check.expanded_bound(1000)
    found: list[str] = []

    def refuse() -> None:
        try:
            refit_info_check.parse(many, sha256=hashlib.sha256(many).hexdigest(), tensors=1000, source="c")
        except refit_info_check.RefitInfoError as error:
            found.append(str(error))
            raise

    peak = peak_bytes(refuse)
    assert found == ["c holds more than 1000 tensors, refitInfo.tensors says 1000"]
    assert peak < 8 * MIB, f"peak {peak / MIB:.1f} MiB"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"[" * 4000, "is not gzip'd JSON: maximum recursion depth"),
        (b'[["a", [1], "float32"]] trailing', "is not gzip'd JSON: extra data"),
        (b'[["a", [1], "float32"] ["b", [1], "float32"]]', "is not gzip'd JSON: expected ',' or ']'"),
        (b'  [ ["a", [1], "float32"] ,\n ["b", [2], "float32"] ]\n', None),
    ],
    ids=["deep", "trailing", "no-comma", "spaced"],
)
def test_malformed_json_is_refused_without_a_crash(text: bytes, expected: str | None) -> None:
    packed = gzip.compress(text)
    digest = hashlib.sha256(packed).hexdigest()
    if expected is None:
        found = refit_info_check.parse(packed, sha256=digest, tensors=2, source="c")
        assert [tensor.name for tensor in found] == ["a", "b"]
        return
    with pytest.raises(refit_info_check.RefitInfoError, match=expected):
        refit_info_check.parse(packed, sha256=digest, tensors=2, source="c")


@pytest.mark.parametrize(
    ("packed", "expected"),
    [
        (gzip.compress(b'[["a", [1], "f"],') + gzip.compress(b' ["b", [1], "f"]]'), None),
        (gzip.compress(b'[["a", [1], "f"], ["b", [1], "f"]]')[:-12], "is not gzip'd JSON"),
        (gzip.compress(b'[["a", [1], "f"], ["b", [1], "f"]]') + b"junk", "is not gzip'd JSON"),
    ],
    ids=["two-members", "truncated", "trailing-junk"],
)
def test_gzip_is_read_as_gzip_decompress_reads_it(packed: bytes, expected: str | None) -> None:
    digest = hashlib.sha256(packed).hexdigest()
    if expected is None:
        assert len(refit_info_check.parse(packed, sha256=digest, tensors=2, source="c")) == 2
        return
    with pytest.raises(refit_info_check.RefitInfoError, match=expected):
        refit_info_check.parse(packed, sha256=digest, tensors=2, source="c")


def test_a_session_whose_refit_info_is_a_bomb_breaks_naming_the_configmap(world: World) -> None:
    world.session()
    world.refit_info()
    packed = bomb(256)
    world.api.objects[("ConfigMap", NS, "grpo-info")]["binaryData"]["refitInfo.json.gz"] = base64.b64encode(
        packed
    ).decode()
    world.api.objects[("RefitSession", NS, "grpo")]["spec"]["refitInfo"]["sha256"] = hashlib.sha256(packed).hexdigest()
    world.joined()

    status = world.advance()["status"]

    broken = condition(world.api.objects[("RefitSession", NS, "grpo")], session_status.BROKEN)
    assert status["phase"] == "Broken" and broken["reason"] == session_status.REFIT_INFO_REJECTED
    assert "ConfigMap grpo-info key refitInfo.json.gz expands past 4096 bytes" in broken["message"]
