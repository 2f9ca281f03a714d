"""The receiver process of the reshard test (it holds no tests): one tensor-parallel rank holding only
its megatron-layout tensors (zeros to start), receiving from the trainer over gloo.

Run as ``python test_refit_shard_receiver.py ARGS_JSON``; imports only torch and the engine's refit
modules, so it starts quickly. Saves the received tensors to ``out`` (``torch.save``) and prints a
JSON report (bytes received, bytes of the regions it asked for, whether every tensor kept its
storage, what verified the bytes) on stdout.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from megafleet_engine.backends import weight_maps
from megafleet_engine.refit_attempts import phases, sinks
from megafleet_protocol.refit import communicator, receiver, wire


def main(args: dict[str, Any]) -> None:
    shape = weight_maps.LlamaShape(**args["shape"])
    tp_rank, tp_size, global_rank = int(args["tp_rank"]), int(args["tp_size"]), int(args["global_rank"])
    specs = weight_maps.shard_map(shape, weight_maps.Layout(tp_rank, tp_size))
    live = {name: torch.zeros(spec.shape) for name, spec in specs.items()}
    pointers = {name: tensor.data_ptr() for name, tensor in live.items()}
    hf_shapes = weight_maps.hf_shapes(shape)
    sink = sinks.ShardSink(live, specs, hf_shapes)
    needed = sum(
        region.nbytes(wire.TensorInfo(region.name, hf_shapes[region.name], "float32")) for region in sink.regions()
    )
    rendezvous = communicator.Rendezvous(args["address"], int(args["port"]), int(args["world_size"]))
    comm = communicator.Communicator.connect(
        rendezvous,
        global_rank=global_rank,
        backend="gloo",
        device=torch.device("cpu"),
        deadline=communicator.Deadline(60),
        local_address=f"127.0.10.{global_rank}",
    )
    record = phases.Progress(version=1, source="rendezvous")
    try:
        received = receiver.receive(
            comm,
            sink,
            version=1,
            transport=args["transport"],
            bucket_limit_bytes=2**20,
            apply=lambda write: write(),
            record=record,
            integrity=args.get("integrity", "none"),
        )
        comm.set(wire.done_key(comm.group_rank), wire.Done(ok=True, bytes_received=received.nbytes).encode())
    finally:
        comm.close()
    torch.save(live, str(args["out"]))
    in_place = all(tensor.data_ptr() == pointers[name] for name, tensor in live.items())
    verification = record.snapshot().verification
    assert verification is not None
    report: dict[str, object] = {"received": received.nbytes, "needed": needed, "inPlace": in_place}
    report |= {"verified": verification.method, "bucketsVerified": verification.buckets}
    sys.stdout.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
