"""What the operator's three controllers share about one fleet, below all three.

The fleet reconcile (:mod:`megafleet.reconcile`) and the Refit and RefitSession controllers
(:mod:`megafleet.refits`) read and write the same fleet: its pods, parsed once into a typed view
(:mod:`.pods`); the objects it owns, the only ones any of them touches (:mod:`.ownership`); its agent
token (:mod:`.token`); the Ready, Degraded and WeightsCurrent conditions of its status
(:mod:`.readiness`), and the hold a RefitSession puts on it (:mod:`.hold`). :mod:`.patches` keeps a
status write that would change nothing from being made. Nothing here imports a controller.
"""
