"""What verified buckets cost a refit on CPU: the same refit over gloo with and without ``mf64`` digests,
interleaved (ABAB), over one trainer session and one transfer group.

The trainer (this process) holds ``--megabytes`` of random float32 tensors and sends version after
version with :class:`megafleet_protocol.refit.sender.WeightSender`; ``--receivers`` receiver processes
(this script with ``--receiver``) take each version with :func:`megafleet_protocol.refit.receiver.receive`
into zeroed tensors, in place, as an engine rank does (no engine: nothing but the transfer is timed).
Versions alternate ``integrity: none`` and ``checksum`` (a receiver asking for digests makes the trainer
seal every bucket, and checks each trailer as the bucket lands), so both see the same machine load;
the first ``--warmup`` of each are not counted. The manifest changes with the integrity every round, so
every round exchanges it, both ways alike.

Reported per integrity (medians over ``--refits`` each): the sender's ``transfer`` phase (packing,
sealing, every broadcast), its whole ``send()`` and the receivers' ``receive + apply`` (the wall time of
their transfer, trailers checked inside ``apply``); cost = (with - without) / without. Also ``mf64``
alone on one bucket of the payload (torch on CPU; GB/s), and the serial upper bound of the digests:
both ends digest every byte once, so 2 x payload / that speed, against the transfer without digests.

    PYTHONPATH=engine:protocol python3 bench/refit_digest.py --out bench/results/refit-digest-cpu2-<date>.json

The GPU figure (NCCL, two GPUs) comes from ``bench/refit_nccl.py --integrity none,checksum``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchkit
import torch

from megafleet_protocol.refit import communicator, digest, receiver, wire
from megafleet_protocol.refit import sender as sdk

ROOT = Path(__file__).resolve().parents[1]
ADDRESS = "127.0.0.1"
MIB = 2**20
MODES = ("none", "checksum")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", help="result file (default: a temporary file)")
    parser.add_argument("--megabytes", type=int, default=256, help="payload, in MiB of float32 tensors")
    parser.add_argument("--tensors", type=int, default=32, help="tensors the payload is split into")
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--refits", type=int, default=10, help="timed refits per integrity")
    parser.add_argument("--warmup", type=int, default=1, help="untimed refits per integrity, first")
    parser.add_argument("--receivers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--receiver", help=argparse.SUPPRESS)
    return parser.parse_args()


def schedule(warmup: int, refits: int) -> list[str]:
    """Integrity of versions 1, 2, ...: none and checksum alternating (ABAB), warm-ups first."""
    return [mode for _ in range(warmup + refits) for mode in MODES]


def payload(megabytes: int, tensors: int) -> dict[str, torch.Tensor]:
    """Random float32 tensors of about ``megabytes`` MiB; each a few rows short of an even share, so
    that the buckets are not filled to the byte with or without trailers."""
    generator = torch.Generator().manual_seed(7)
    rows = max(1, megabytes * MIB // 4 // tensors // 1024 - 3)
    return {f"layers.{index}.weight": torch.randn(rows, 1024, generator=generator) for index in range(tensors)}


# -- a receiver process ------------------------------------------------------------------------------


def receiver_main(spec: dict[str, Any]) -> None:
    """Take every version of the schedule into zeroed tensors; print each round's timings as JSON."""
    from megafleet_engine.refit_attempts import phases, sinks

    torch.set_num_threads(int(spec["threads"]))
    live = {name: torch.zeros(shape) for name, shape in spec["shapes"].items()}
    sink = sinks.NamedSink(live)
    comm = communicator.Communicator.connect(
        communicator.Rendezvous(ADDRESS, int(spec["port"]), int(spec["world_size"])),
        global_rank=int(spec["rank"]),
        backend="gloo",
        device=torch.device("cpu"),
        deadline=communicator.Deadline(600),
        local_address=ADDRESS,
    )
    accepted: receiver.Accepted | None = None
    rounds = []
    try:
        for version, integrity in enumerate(spec["schedule"], start=1):
            comm.deadline = communicator.Deadline(300)
            record = phases.Progress(version=version, source="rendezvous")
            received = receiver.receive(
                comm,
                sink.fresh(),
                version=version,
                transport="broadcast",
                bucket_limit_bytes=int(spec["bucket_bytes"]),
                apply=lambda write: write(),
                record=record,
                accepted=accepted,
                integrity=integrity,
            )
            accepted = received.accepted
            comm.set(wire.done_key(comm.group_rank), wire.Done(ok=True, bytes_received=received.nbytes).encode())
            snapshot = record.snapshot()
            verified = snapshot.verification
            rounds.append(
                {
                    "version": version,
                    "integrity": integrity,
                    "phases_s": dict(snapshot.phases),
                    "method": verified.method if verified else None,
                    "buckets_verified": verified.buckets if verified else 0,
                }
            )
    finally:
        comm.close()
    sys.stdout.write(json.dumps(rounds) + "\n")


# -- the trainer ---------------------------------------------------------------------------------------


def start_receivers(args: argparse.Namespace, port: int, shapes: dict[str, list[int]]) -> list[subprocess.Popen[str]]:
    path = os.pathsep.join([str(ROOT / "engine"), str(ROOT / "protocol"), str(ROOT / "bench")])
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
    children = []
    for rank in range(1, args.receivers + 1):
        spec = {
            "port": port,
            "world_size": args.receivers + 1,
            "rank": rank,
            "shapes": shapes,
            "schedule": schedule(args.warmup, args.refits),
            "bucket_bytes": args.bucket_mib * MIB,
            "threads": args.threads,
        }
        children.append(
            subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--receiver", json.dumps(spec)],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    return children


def digest_speed(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> dict[str, Any]:
    """``mf64`` (torch on CPU) over one bucket's worth of the payload, best of three."""
    flat = torch.cat([tensor.reshape(-1).view(torch.uint8) for tensor in tensors.values()])[:bucket_bytes]
    runs = []
    for _ in range(3):
        started = time.perf_counter()
        digest.torch_digest(flat, 0)
        runs.append(time.perf_counter() - started)
    best = min(runs)
    return {"bytes": flat.numel(), "seconds_best": round(best, 4), "gb_per_s": round(flat.numel() / best / 1e9, 3)}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float:
        return round(float(statistics.median(run[key] for run in runs)), 4)

    return {
        "refits": len(runs),
        "transfer_sender_s": med("transfer_sender_s"),
        "send_s": med("send_s"),
        "transfer_receiver_s": med("transfer_receiver_s"),
        "bytes_sent": runs[0]["bytes_sent"],
        "buckets": runs[0]["buckets"],
    }


def main() -> int:
    args = parse_args()
    if args.receiver:
        receiver_main(json.loads(args.receiver))
        return 0
    torch.set_num_threads(args.threads)
    tensors = payload(args.megabytes, args.tensors)
    nbytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    date = datetime.datetime.now(datetime.UTC).date().isoformat()
    out = Path(args.out) if args.out else Path(tempfile.gettempdir()) / f"refit-digest-cpu-{date}.json"
    result: dict[str, Any] = {
        "benchmark": "refit-digest",
        "machine": benchkit.machine(),
        "load_average_before": os.getloadavg(),
        "config": {
            "payload_bytes": nbytes,
            "tensors": len(tensors),
            "bucket_mib": args.bucket_mib,
            "receivers": args.receivers,
            "refits_per_integrity": args.refits,
            "warmup_per_integrity": args.warmup,
            "torch_threads": args.threads,
            "backend": "gloo",
            "transport": "broadcast",
            "order": "ABAB: versions alternate integrity none and checksum",
        },
    }
    save = benchkit.saver(out, result)
    port = free_port()
    shapes = {name: list(tensor.shape) for name, tensor in tensors.items()}
    children = start_receivers(args, port, shapes)
    sender = sdk.WeightSender(port, args.receivers + 1, address=ADDRESS, timeout_seconds=600)
    sender.init()
    runs: list[dict[str, Any]] = []
    try:
        for version, integrity in enumerate(schedule(args.warmup, args.refits), start=1):
            started = time.perf_counter()
            report = sender.send(tensors.items(), bucket_size_mib=args.bucket_mib, version=version)
            seconds = time.perf_counter() - started
            assert report.verified == (integrity == "checksum"), (version, integrity, report)
            runs.append(
                {
                    "version": version,
                    "integrity": integrity,
                    "send_s": round(seconds, 4),
                    "transfer_sender_s": round(report.phases["transfer"], 4),
                    "bytes_sent": report.bytes_sent,
                    "buckets": report.buckets,
                    "verified": report.verified,
                }
            )
            transfer = report.phases["transfer"]
            print(f"version {version} ({integrity}): send {seconds * 1e3:.0f} ms, transfer {transfer * 1e3:.0f} ms")
    finally:
        sender.close()
    received = [json.loads(child.communicate(timeout=600)[0].strip().splitlines()[-1]) for child in children]
    for run in runs:
        rounds = [rounds_of[run["version"] - 1] for rounds_of in received]
        walls = [r["phases_s"].get("receive", 0) + r["phases_s"].get("apply", 0) for r in rounds]
        run["transfer_receiver_s"] = round(max(walls), 4)
        run["receivers_verified"] = [r["buckets_verified"] for r in rounds]
    result["runs"] = runs
    timed = runs[2 * args.warmup :]
    by_mode = {mode: summary([run for run in timed if run["integrity"] == mode]) for mode in MODES}
    result["medians"] = by_mode
    none, checksum = by_mode["none"], by_mode["checksum"]
    speed = digest_speed(tensors, args.bucket_mib * MIB)
    result["mf64_cpu"] = speed
    result["cost"] = {
        "transfer_sender": round(checksum["transfer_sender_s"] / none["transfer_sender_s"] - 1, 4),
        "send": round(checksum["send_s"] / none["send_s"] - 1, 4),
        "transfer_receiver": round(checksum["transfer_receiver_s"] / none["transfer_receiver_s"] - 1, 4),
        "serial_upper_bound": round(2 * nbytes / (speed["gb_per_s"] * 1e9) / none["transfer_sender_s"], 4),
    }
    result["load_average_after"] = os.getloadavg()
    save()
    print(json.dumps({"medians": by_mode, "cost": result["cost"], "mf64_cpu": speed}, indent=2))
    print(f"wrote {out}")
    return 0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((ADDRESS, 0))
        return int(probe.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())
