"""NeMo RL's M-to-N reshard on CPU: the fleet's receiving side (:mod:`megafleet_protocol.refit.nemo_reshard`)
against a NeMo-style trainer written from NeMo's contract (:mod:`helpers.nemo_reshard_trainer`): several
pipeline stages of several TP ranks, each sending only its own slices over its stage's communicator
(gloo standing in for NCCL), NeMo's misc tensors over its packed broadcast alongside. Also the plan
(:mod:`megafleet_protocol.refit.nemo_reshard_plan`) held to NeMo's exact-transfer algorithm by hand.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch

from helpers import nemo_reshard_trainer as trainer
from helpers import nemo_trainer
from helpers import refit_harness as harness
from megafleet_protocol.refit import communicator, nemo, nemo_reshard, nemo_reshard_info, wire
from megafleet_protocol.refit import nemo_reshard_plan as plan_

ADDRESS = trainer.ADDRESS
BUCKET = 400

# -- the plan, by hand ---------------------------------------------------------------------------


def mesh(ranks: Any) -> plan_.Mesh:
    return plan_.Mesh.parse({"mesh": ranks})


def test_shards_follow_torch_chunk_and_sequential_mesh_dims() -> None:
    four = mesh([0, 1, 2, 3])
    assert [box[0] for box in plan_.regions(four, (0,), (10,)).values()] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [box[0] for box in plan_.regions(four, (0,), (2,)).values()] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    two_by_two = mesh([[0, 1], [2, 3]])  # both mesh dims shard dim 0: the outer cuts first, the inner cuts its chunk
    assert [box[0] for box in plan_.regions(two_by_two, (0, 0), (8,)).values()] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert set(plan_.regions(two_by_two, (None, 1), (3, 4)).values()) == {((0, 3), (0, 2)), ((0, 3), (2, 4))}


def test_replicas_that_split_dim_0_evenly_receive_stripes_then_all_gather() -> None:
    # two trainer ranks TP-shard rows (Shard(0)); two inference ranks replicate the whole tensor
    plan = plan_.plan((10, 6), (mesh([0, 1]), (0,)), (mesh([2, 3]), (None,)))
    assert plan.kind == "striped"
    assert [(t.source, t.receiver, t.overlap) for t in plan.transfers] == [
        (0, 2, ((0, 5), (0, 6))),
        (1, 3, ((5, 10), (0, 6))),
    ]
    assert plan.stripes == {2: ((0, 5), (0, 6)), 3: ((5, 10), (0, 6))}
    steps = plan.steps(3)
    assert steps.fan_out == "all_gather" and steps.group is not None and steps.group.members == (2, 3)


def test_replicas_that_cannot_split_evenly_take_the_exact_plan_through_their_representative() -> None:
    plan = plan_.plan((10, 6), (mesh([0, 1]), (0,)), (mesh([2, 3, 4]), (None,)))  # 10 rows, 3 replicas
    assert plan.kind == "exact"
    assert [(t.source, t.receiver, t.overlap) for t in plan.transfers] == [
        (0, 2, ((0, 5), (0, 6))),
        (1, 2, ((5, 10), (0, 6))),
    ]
    assert plan.steps(4).receives == () and plan.steps(4).fan_out == "broadcast"
    group = plan.steps(2).group
    assert group is not None and group.members == (2, 3, 4)


def test_the_representative_is_at_coordinate_0_of_every_replicated_mesh_dim_and_sources_rotate() -> None:
    # inference mesh [[dp0: 2, 3], [dp1: 4, 5]], TP innermost: 2 and 4 hold the same half, 2 represents
    plan = plan_.plan((4, 5), (mesh([0]), (None,)), (mesh([[2, 3], [4, 5]]), (None, 1)))
    assert plan.kind == "striped"  # 4 rows over 2 replicas
    assert [g.members for g in plan.groups] == [(2, 4), (3, 5)]
    assert {t.receiver for t in plan.transfers} == {2, 3, 4, 5} and {t.source for t in plan.transfers} == {0}
    # a replicated source of several holders is used in turn
    rotated = plan_.plan((4, 5), (mesh([0, 1]), (None,)), (mesh([2, 3]), (None,)))
    assert [(t.source, t.receiver) for t in rotated.transfers] == [(0, 2), (1, 3)]


def test_a_piece_needing_packing_and_staging_falls_back_to_the_exact_plan() -> None:
    # the source cuts dim 1, the destination dim 2 (then stripes dim 0): each piece is strided at both ends
    plan = plan_.plan((4, 4, 4), (mesh([0, 1]), (1,)), (mesh([[2, 3], [4, 5]]), (None, 2)))
    assert plan.kind == "exact"


def test_the_receive_map_keeps_only_this_ranks_box_and_refuses_what_the_sink_lacks() -> None:
    layout = trainer.Layout(pp=2, tp=2, gen_ranks=2, gen_tp=2, layers=2)
    info = nemo_reshard_info.ReshardInfo.parse(trainer.refit_info(weights(layout, 0), layout))
    assert [stage for stage, _ in info.stages()] == [0, 1] and len(info.misc) == 5  # embed, 2 norms, norm, head
    entries = {entry.param.name: entry.region for entry in info.receive_map(3)}
    assert entries["model.layers.0.mlp.gate_proj.weight"] == wire.Region(
        "model.layers.0.mlp.gate_proj.weight", 0, 5, 10
    )
    assert entries["model.layers.1.mlp.down_proj.weight"] == wire.Region(
        "model.layers.1.mlp.down_proj.weight", 1, 5, 10
    )
    with pytest.raises(ValueError, match="holds shape"):
        info.receive_map(2, {name: (1,) for name in entries})
    with pytest.raises(ValueError, match="not in its destination mesh"):
        info.receive_map(0)


# -- the fleet against the trainer, over gloo ------------------------------------------------------


def weights(layout: trainer.Layout, step: int, inter: int = 10) -> dict[str, torch.Tensor]:
    """A dense model's HF tensors in the trainer's order; ``step`` changes every value."""
    generator = torch.Generator().manual_seed(100 + step)
    hidden = 6
    found = {"model.embed_tokens.weight": torch.randn(11, hidden, generator=generator)}
    for layer in range(layout.layers):
        prefix = f"model.layers.{layer}"
        found[f"{prefix}.input_layernorm.weight"] = torch.randn(hidden, generator=generator)
        found[f"{prefix}.mlp.gate_proj.weight"] = torch.randn(inter, hidden, generator=generator).to(torch.bfloat16)
        found[f"{prefix}.mlp.up_proj.weight"] = torch.randn(inter, hidden, generator=generator).to(torch.bfloat16)
        found[f"{prefix}.mlp.down_proj.weight"] = torch.randn(hidden, inter, generator=generator).to(torch.bfloat16)
    found["model.norm.weight"] = torch.randn(hidden, generator=generator)
    found["lm_head.weight"] = torch.randn(11, hidden, generator=generator)
    return found


def kept(full: torch.Tensor, name: str, gen_index: int, layout: trainer.Layout) -> torch.Tensor:
    """What inference rank ``gen_index`` keeps of a bulk tensor: its TP chunk (TP innermost)."""
    return trainer.tp_slice(full, name, gen_index % layout.gen_tp, layout.gen_tp)


def fleet_rank(
    gen_index: int,
    *,
    layout: trainer.Layout,
    ports: trainer.Ports,
    refits: list[dict[str, torch.Tensor]],
    got: dict[int, list[dict[str, torch.Tensor]]],
    received: dict[int, list[int]],
) -> None:
    """One inference rank as the fleet's engine runs it: NeMo's world, every stage's communicator, then
    per refit the bulk receive map and the misc broadcast (NeMo's order)."""
    deadline = communicator.Deadline(60)
    cpu = torch.device("cpu")
    train_world = layout.train_ranks
    misc = nemo.NemoReceiver.connect(
        nemo.NemoWorld(ADDRESS, ports.misc, train_world + layout.gen_ranks, train_world + gen_index, train_world),
        backend="gloo",
        device=cpu,
        deadline=deadline,
        local_address=ADDRESS,
        gloo_prefix=nemo_trainer.GLOO_PREFIX,
    )
    stage_rank = layout.tp + gen_index
    worlds = [
        nemo_reshard.StageWorld(stage, ADDRESS, port, layout.tp + layout.gen_ranks, stage_rank, layout.tp)
        for stage, port in enumerate(ports.stages)
    ]
    bulk = nemo_reshard.ReshardReceiver.connect(worlds, backend="gloo", deadline=deadline, local_address=ADDRESS)
    got[gen_index], received[gen_index] = [], []
    for step_weights in refits:
        info = nemo_reshard_info.ReshardInfo.parse(trainer.refit_info(step_weights, layout))
        required = {name: tuple(t.shape) for name, t in step_weights.items()}
        now: dict[str, torch.Tensor] = {}

        def write(
            region: wire.Region,
            tensor: torch.Tensor,
            now: dict[str, torch.Tensor] = now,
            step_weights: dict[str, torch.Tensor] = step_weights,
        ) -> int:
            expected = kept(step_weights[region.name], region.name, gen_index, layout)
            assert tuple(tensor.shape) == tuple(expected.shape), f"{region.name}: rank kept more than its slice"
            now[region.name] = tensor.clone()
            return 1

        def write_misc(tensors: list[tuple[str, torch.Tensor]], now: dict[str, torch.Tensor] = now) -> int:
            now.update((name, tensor.clone()) for name, tensor in tensors)
            return len(tensors)

        stats = bulk.receive(info.receive_map(stage_rank, required), write=write, deadline=deadline)
        specs = [nemo.TensorSpec(name, shape, dtype) for name, shape, dtype in info.misc]
        misc.receive(specs, bucket_bytes=BUCKET, device=cpu, write=write_misc, deadline=deadline)
        got[gen_index].append(now)
        received[gen_index].append(stats.bytes_received)
    bulk.close()
    misc.close()


LAYOUTS = {
    "2 stages x TP2 -> 2 replicas (striped)": (trainer.Layout(pp=2, tp=2, gen_ranks=2, gen_tp=1, layers=4), 10),
    "2 stages x TP2 -> TP2 (no replicas)": (trainer.Layout(pp=2, tp=2, gen_ranks=2, gen_tp=2, layers=4), 10),
    "2 stages x TP1 -> 3 replicas (exact for gate/up, striped for down)": (
        trainer.Layout(pp=2, tp=1, gen_ranks=3, gen_tp=1, layers=2),
        10,
    ),
    "3 stages x TP2 -> 2 DP x TP2 (both plans)": (trainer.Layout(pp=3, tp=2, gen_ranks=4, gen_tp=2, layers=3), 10),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.slow  # starts engines, a process group or a subprocess
def test_every_stage_sends_its_own_slices_and_each_fleet_rank_keeps_exactly_its_box(name: str) -> None:
    layout, inter = LAYOUTS[name]
    refits = [weights(layout, step, inter) for step in range(2)]  # two refits over the same communicators
    ports = trainer.Ports(harness.free_port(), tuple(harness.free_port() for _ in range(layout.pp)))
    sent: list[tuple[int, str, int]] = []
    got: dict[int, list[dict[str, torch.Tensor]]] = {}
    received: dict[int, list[int]] = {}
    ranks = [
        functools.partial(
            trainer.train_rank, rank, layout=layout, ports=ports, refits=refits, bucket_bytes=BUCKET, sent=sent
        )
        for rank in range(layout.train_ranks)
    ] + [
        functools.partial(fleet_rank, index, layout=layout, ports=ports, refits=refits, got=got, received=received)
        for index in range(layout.gen_ranks)
    ]
    with nemo_trainer.running(*ranks, timeout=90) as failures:
        pass
    assert not failures, failures
    for index in range(layout.gen_ranks):
        for step, step_weights in enumerate(refits):
            for tensor_name, full in step_weights.items():
                expected = (
                    kept(full, tensor_name, index, layout) if tensor_name.endswith(trainer.BULK_SUFFIXES) else full
                )
                assert torch.equal(got[index][step][tensor_name], expected), (index, step, tensor_name)
    # no rank takes in more of a bulk tensor than the box it keeps (striped: only its stripe)
    for index in range(layout.gen_ranks):
        bulk_names = [n for n in refits[0] if n.endswith(trainer.BULK_SUFFIXES)]
        kept_bytes = sum(math.prod(kept(refits[0][n], n, index, layout).shape) * 2 for n in bulk_names)
        assert all(count <= kept_bytes for count in received[index]), (index, received[index], kept_bytes)
    sent_bytes = sum(count for _, _, count in sent)
    assert sent_bytes == sum(sum(counts) for counts in received.values())
