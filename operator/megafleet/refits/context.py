"""What one step of a Refit or of a RefitSession works on.

The operator-wide :class:`megafleet.reconcile.context.Runtime` (clients, settings, the fleets'
locks) is the one the fleet reconcile uses. :class:`RefitContext` lives for one step of one Refit,
built by :func:`megafleet.refits.refit_controller.advance` once the Refit and its fleet parse;
:class:`SessionContext` for one step of one RefitSession, built by
:func:`megafleet.refits.session_controller.advance` once its fleet parses. Each is handed to the
steps, which read what earlier steps found and record what they find.
"""

from __future__ import annotations

import dataclasses
import datetime

from megafleet import desired
from megafleet.api import checks, v1alpha1
from megafleet.fleet_state import pods as pod_view
from megafleet.objects import Object
from megafleet.reconcile import context
from megafleet.refits import modes, session_view


def parse_fleet(body: Object | None) -> desired.ParsedFleet | None:
    """The fleet a Refit or RefitSession names, parsed; None when it is gone or its spec is invalid
    (the reconcile reports why)."""
    if body is None:
        return None
    spec, problems = checks.parse_spec(body.get("spec") or {})
    if spec is None or problems:
        return None
    metadata = body["metadata"]
    return desired.ParsedFleet(
        metadata["name"], metadata["namespace"], metadata.get("uid", ""), int(metadata.get("generation", 1)), spec
    )


@dataclasses.dataclass
class RefitContext(context.OnRuntime):
    """One step of one Refit whose spec and fleet parse; the fields after ``fleet`` are filled in
    by the steps."""

    runtime: context.Runtime
    body: Object
    """The Refit as read; ``status.attempts`` follows the attempt this step starts."""
    spec: v1alpha1.RefitObjectSpec
    fleet_body: Object
    """The fleet as read at the start of the step (its ``status.refit`` holds the lock)."""
    fleet: desired.ParsedFleet
    token: str = ""
    """The fleet's agent token."""
    pods: dict[int, list[pod_view.Pod]] = dataclasses.field(default_factory=dict)
    """The shards whose pods all exist and run, by index, in pod order (the shards a refit can count
    on): below ``spec.replicas``, or every held one for a Refit through a RefitSession."""
    capabilities: list[modes.MemberCapabilities] = dataclasses.field(default_factory=list)
    """What the member pods' agents say their engines can do across a refit, in shard and pod order;
    filled as an attempt starts, from the same ``GET /v1/state`` that finds the members."""

    @property
    def name(self) -> str:
        name: str = self.body["metadata"]["name"]
        return name

    @property
    def namespace(self) -> str:
        namespace: str = self.body["metadata"]["namespace"]
        return namespace

    @property
    def status(self) -> Object:
        status: Object = self.body.get("status") or {}
        return status

    @property
    def phase(self) -> str:
        phase: str = self.status.get("phase", "Pending")
        return phase

    @property
    def fleet_refit(self) -> Object:
        """The fleet's ``status.refit``: the running Refit (``active``), the holding session."""
        refit: Object = (self.fleet_body.get("status") or {}).get("refit") or {}
        return refit

    @property
    def through_session(self) -> bool:
        """The refit goes through a RefitSession (``source.session``, NeMo RL's own collective)."""
        return self.spec.source.session is not None

    @property
    def max_attempts(self) -> int:
        """One through a session (a trainer's broadcast cannot be replayed), else the setting's."""
        return 1 if self.through_session else self.settings.refit.max_attempts

    async def write(self, status: Object) -> None:
        """Merge-patch the Refit's status."""
        await self.api.patch_status("Refit", self.name, self.namespace, status)


@dataclasses.dataclass
class SessionContext(context.OnRuntime):
    """One step of one RefitSession whose fleet parses; the fields after ``monotonic`` are filled in
    by the steps."""

    runtime: context.Runtime
    session: session_view.Session
    """The session as read, replaced by what it is after each status write (:meth:`write`)."""
    fleet_body: Object
    fleet: desired.ParsedFleet
    at: datetime.datetime
    """When the step runs (wall time: the join deadline counts from the session's creation)."""
    monotonic: float
    """When the step runs (monotonic seconds: the trainer-gone wait)."""
    token: str = ""
    """The fleet's agent token."""
    pods: dict[int, list[pod_view.Pod]] = dataclasses.field(default_factory=dict)
    """Before the join: the fleet's shards whose pods all exist and run, by index, in pod order."""

    @property
    def fleet_refit(self) -> Object:
        """The fleet's ``status.refit``: the running Refit (``active``), the holding session."""
        refit: Object = (self.fleet_body.get("status") or {}).get("refit") or {}
        return refit

    async def write(self, status: Object) -> None:
        """Merge-patch the session's status (unless that changes nothing); the context's session is
        the written one from now on."""
        await session_view.write(self.api, self.session, status)
        self.session = session_view.written(self.session, status)
