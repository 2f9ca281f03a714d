"""The Refit and RefitSession controllers, run by the operator's Kopf handlers (:mod:`megafleet.handlers`).

Each is a short sequence of named steps over one context object (:mod:`.context`), as the fleet
reconcile (:mod:`megafleet.reconcile`) is, and each step is level-based: the object's
``status.phase`` says where it stands and one call advances it by one step. Both run under the
fleet's lock, beside the fleet's reconcile.

* The Refit controller (:mod:`.refit_controller`): admission, then one attempt of a rendezvous or
  checkpoint refit started, collected, retried or given up (:mod:`.attempts`), or the single attempt
  of a Refit through a RefitSession (:mod:`.session_refits`); the fleet's lock taken and released,
  the Refit finished and old ones pruned (:mod:`.fleet_lock`). Its status is built by
  :mod:`.refit_status` (pure).
* The RefitSession controller (:mod:`.session_controller`): a trainer's own weight-transfer world
  that the fleet's shards join once and hold for the run's refits: the members asked to join and
  watched (:mod:`.members`), the trainer's refit info checked (:mod:`.refit_info_check`), the session
  ended and the fleet's hold released (:mod:`.session_end`). A RefitSession is read once into
  :class:`.session_view.Session`; its status is built by :mod:`.session_status` (pure).

The RefitSession controller's modules never import the Refit controller's; the Refit controller
reads sessions, and ends one when a refit through it fails. What all three controllers share of a
fleet (its pod view, token, hold and readiness conditions) is in :mod:`megafleet.fleet_state`.
"""
