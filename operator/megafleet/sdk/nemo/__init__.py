"""NeMo RL's ``GenerationInterface`` over a megafleet fleet: the generation side of a GRPO-style loop
whose engines run as a MegatronGeneration on Kubernetes. docs/nemo-rl.md is the user's guide.

Called by the RL training loop on its driver (NeMo RL's GRPO through :func:`nemo_factory`, or any
script), and, pickled, inside NeMo RL's async trajectory collector (a Ray actor).

Modules:

* :mod:`~megafleet.sdk.nemo.adapter`: :class:`MegafleetGeneration`, the call surface (every public
  method and property of NeMo RL's ``GenerationInterface`` and ``MegatronGeneration``, main and the
  development line); methods NeMo RL hands to ``ray.get`` return Ray refs (:mod:`~megafleet.sdk.nemo.refs`).
* :mod:`~megafleet.sdk.nemo.class_hooks`: NeMo RL's class-level hooks (``validate_settings`` and the rest).
* :mod:`~megafleet.sdk.nemo.membership`: NeMo RL's refit membership (``set_refit_membership``, the
  rebuild over the live shards) and its fleet-health monitor fed from the fleet
  (:mod:`~megafleet.sdk.nemo.fleet_health`).
* :mod:`~megafleet.sdk.nemo.reshard`: NeMo RL's M-to-N reshard (``init_nccl_reshard_comm_group``, its
  rebuild, ``prepare_nccl_reshard_refit_info``, ``nccl_reshard_refit``) through the session.
* :mod:`~megafleet.sdk.nemo.unsupported`: what a fleet refuses, loudly, with what to use instead.
* :mod:`~megafleet.sdk.nemo.async_flags`: NeMo RL's async flags (in-flight weight updates, KV
  recompute) and the in-flight modes of every Refit the adapter makes;
  :mod:`~megafleet.sdk.nemo.kv_invalidation`: ``invalidate_kv_cache()``'s answer from the last Refit.
* :mod:`~megafleet.sdk.nemo.batching`: input checks (right padding) and NeMo RL's output shapes.
* :mod:`~megafleet.sdk.nemo.config`: the ``cfg`` NeMo RL reads; refusal of ``bad_words`` and colocation.
* :mod:`~megafleet.sdk.nemo.versions`: the version a refit targets, whatever NeMo RL's call order.
* :mod:`~megafleet.sdk.nemo.refit_wires`: the refit seam, with :mod:`~megafleet.sdk.nemo.refit_wire_nemo`
  (``refit_wire="nemo"``, the default: NeMo's policy workers send, the fleet joins their world through
  a RefitSession; :mod:`~megafleet.sdk.nemo.sessions` builds its objects, :mod:`~megafleet.sdk.nemo.refit_info`
  stores the tensor list, :mod:`~megafleet.sdk.nemo.buckets` resolves the bucket target) and
  :mod:`~megafleet.sdk.nemo.refit_wire_megafleet` (this process sends with ``WeightSender``);
  :mod:`~megafleet.sdk.nemo.refit_wire_choice` picks the one the adapter's handle names.
* :mod:`~megafleet.sdk.nemo.clients`: the connection made on first use, and :class:`Handle`, what
  pickling keeps; :mod:`~megafleet.sdk.nemo.generation_counters`: NeMo RL's logger and step counters.
* :mod:`~megafleet.sdk.nemo.factory`: :func:`nemo_factory`, the stand-in for NeMo RL's generation
  classes (a class bound to the fleet: GRPO's class-level calls stand on it).
"""

from __future__ import annotations

from megafleet.sdk.nemo.adapter import MegafleetGeneration
from megafleet.sdk.nemo.batching import check_right_padding, pack_outputs
from megafleet.sdk.nemo.clients import Handle
from megafleet.sdk.nemo.factory import nemo_factory
from megafleet.sdk.nemo.refit_wires import CollectiveSenderSpec

__all__ = [
    "CollectiveSenderSpec",
    "Handle",
    "MegafleetGeneration",
    "check_right_padding",
    "nemo_factory",
    "pack_outputs",
]
