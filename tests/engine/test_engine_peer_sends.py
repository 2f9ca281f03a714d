"""What an engine refuses to send as a peer copy (``POST /v1/peer/send``), before anything listens: a
version it does not serve, a copy while another runs or a refit ran, and weights in a sharded layout
(the megatron backend's: its shards catch up from the checkpoint). The copy itself runs between two
engine processes in tests/refit/test_refit_peer.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from helpers import refit_harness as harness
from megafleet_engine import engine, peer_sends
from megafleet_engine.backends import base, transformers_backend
from megafleet_engine.refit_attempts import controller as refit_controller


class ShardedTiny(transformers_backend.TransformersBackend):
    """The tiny model, reporting a sharded layout as the megatron backend does."""

    def shard_map(self) -> base.ShardMap:  # type: ignore[override]  # megatron's answer, on the tiny model
        return base.ShardMap(live={}, specs={}, hf_shapes={})


@pytest.fixture
def core() -> Iterator[engine.Engine]:
    the_engine = engine.Engine(harness.tiny_backend(), weight_version=3)
    try:
        yield the_engine
    finally:
        the_engine.close()


def test_a_copy_of_a_version_the_engine_does_not_serve_is_refused(core: engine.Engine) -> None:
    sends = peer_sends.PeerSends(core, refit_controller.RefitController(core), rank=0)
    with pytest.raises(peer_sends.NotCurrent, match="not serving 4") as refused:
        sends.start(peer_sends.PeerSendRequest(version=4, port=harness.free_port()))
    assert refused.value.code == "peer_not_current" and refused.value.status == 409
    assert sends.snapshot() == peer_sends.SendSnapshot()  # nothing started


def test_a_sharded_backend_sends_no_copy() -> None:
    backend = harness.tiny_backend()
    backend.__class__ = ShardedTiny
    sharded = engine.Engine(backend, weight_version=3)
    try:
        sends = peer_sends.PeerSends(sharded, refit_controller.RefitController(sharded), rank=0)
        with pytest.raises(peer_sends.Unsupported, match="sharded weights") as refused:
            sends.start(peer_sends.PeerSendRequest(version=3, port=harness.free_port()))
        assert refused.value.code == "peer_layout_unsupported"
    finally:
        sharded.close()
