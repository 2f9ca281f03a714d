"""The refit protocol's two halves, side by side: the trainer sends, the engines receive.

Both ends import these modules, so they always speak the same version; docs/refit-protocol.md tells
the protocol as a whole (session, rounds, group reuse, manifest shortcut, deadlines, buckets, ranks).

* :mod:`~megafleet_protocol.refit.wire`: messages and bucket layout (pure data and torch views).
* :mod:`~megafleet_protocol.refit.digest`: ``mf64``, the digest of a bucket (numpy reference, torch
  and, on CUDA, :mod:`~megafleet_protocol.refit.digest_kernel`'s Triton kernel, all bit-identical);
  :mod:`~megafleet_protocol.refit.trailers` seals buckets with it (trainer) and checks them as they
  land (receiver); :mod:`~megafleet_protocol.refit.verification` is what an attempt verified.
* :mod:`~megafleet_protocol.refit.communicator`: one rank's client of the trainer's session in its
  rendezvous store and of the hand-built gloo/NCCL transfer group, every wait bounded by the
  attempt's deadline. Built from :mod:`~megafleet_protocol.refit.rendezvous_store` (where the world
  meets; the store), :mod:`~megafleet_protocol.refit.deadlines` (the deadline; torch errors as refit
  errors), :mod:`~megafleet_protocol.refit.round_messages` (a round's hello and decision),
  :mod:`~megafleet_protocol.refit.transfer_group` (the group and its ops in flight) and
  :mod:`~megafleet_protocol.refit.cuda_streams` (side streams that overlap a transfer).
* :mod:`~megafleet_protocol.refit.sender`: the trainer's end (:class:`~.sender.WeightSender`), used
  by the RL job through :mod:`megafleet.sdk`.
* :mod:`~megafleet_protocol.refit.receiver`: an engine rank's end, driven by
  :mod:`megafleet_engine.refit_attempts` into its ``Sink``.
* :mod:`~megafleet_protocol.refit.nemo`: the receiving side of NeMo RL's own collective (a NeMo
  trainer's ``init_collective`` world and packed broadcasts), another wire than the one above;
  built from :mod:`~megafleet_protocol.refit.nemo_rendezvous` (the trainer's store and unique id),
  :mod:`~megafleet_protocol.refit.nemo_collectives` (NCCL, or gloo on CPU) and
  :mod:`~megafleet_protocol.refit.nemo_checks` (digests for the members' agreement, non-finite counts).
* :mod:`~megafleet_protocol.refit.errors`: the errors both ends raise.

Importing this package (or :mod:`~megafleet_protocol.refit.errors`, :mod:`~.deadlines`,
:mod:`~.round_messages`, :mod:`~.verification`) does not import torch; the other modules do.
"""
