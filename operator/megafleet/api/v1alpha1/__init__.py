"""``megafleet.dev/v1alpha1``: the typed source of truth for the MegatronGeneration, Refit and
RefitSession kinds.

The CRD YAML in ``crds/`` and the API reference in ``docs/api.md`` are generated from these models
(:mod:`megafleet.api.crd`, ``megafleet crds``); a test fails when the checked-in files drift. Field
descriptions start with the JSON name; units are in names; there are no floats. Cross-field rules
that CEL can express are declared here as ``x-kubernetes-validations`` and enforced by the API
server at admission; the operator re-checks them, and the rules CEL cannot express, through
:func:`megafleet.planner.validate` and reports ``InvalidSpec``.

One module per kind: :mod:`.megatron_generation` (the parts of its spec in :mod:`.fleet_placement`,
:mod:`.fleet_engine` and :mod:`.fleet_pod`, its status in :mod:`.fleet_status`), :mod:`.refit` (the
members' reports in its status in :mod:`.refit_report`) and :mod:`.refit_session`; what they share
is in :mod:`.common`. Callers import this package and qualify its names
(``v1alpha1.MegatronGenerationSpec``); :data:`KINDS` lists the kinds in the order the generated
files show them.
"""

from megafleet.api.v1alpha1 import megatron_generation, refit, refit_session
from megafleet.api.v1alpha1.common import (
    API_VERSION,
    GROUP,
    VERSION,
    ApiModel,
    Condition,
    ConditionStatus,
    FleetRef,
    KindInfo,
    Membership,
    PhaseTiming,
    RankOffset,
)
from megafleet.api.v1alpha1.fleet_engine import (
    EngineSpec,
    EnvFromSource,
    EnvVar,
    EnvVarSource,
    FieldSelector,
    FrontendSpec,
    KeySelector,
    ObjectRef,
    PullPolicy,
    SecretKeyRef,
)
from megafleet.api.v1alpha1.fleet_placement import (
    GangPlacer,
    GangScheduler,
    GangSpec,
    NvlinkPolicy,
    ParallelismSpec,
    PlacementSpec,
    ResourcesSpec,
    Toleration,
)
from megafleet.api.v1alpha1.fleet_pod import (
    SHM_OVER_MEMORY,
    CacheSpec,
    ConfigMapVolumeSource,
    CsiSource,
    EmptyDirSource,
    HostPathSource,
    ImageSource,
    LocalObjectReference,
    NfsSource,
    PersistentVolumeClaimSource,
    PodSpec,
    SecretVolumeSource,
    Volume,
    VolumeMount,
    mount_problem,
)
from megafleet.api.v1alpha1.fleet_status import (
    Endpoint,
    FleetRefitStatus,
    MegatronGenerationStatus,
    ShardPhase,
    ShardStatus,
)
from megafleet.api.v1alpha1.megatron_generation import (
    DEFAULT_IN_FLIGHT,
    DEFAULT_STAGING,
    DNS_1035_LABEL,
    NAME_MAX,
    NAME_NOT_DNS_1035,
    NAME_TOO_LONG,
    MegatronGenerationSpec,
    ModelSpec,
    RefitSpec,
    WeightsSpec,
)
from megafleet.api.v1alpha1.refit import (
    CheckpointSource,
    RefitObjectSpec,
    RefitObjectStatus,
    RefitPhase,
    RefitSourceSpec,
    RendezvousSource,
    SessionSource,
)
from megafleet.api.v1alpha1.refit_report import (
    CommitStatus,
    InFlightStatus,
    LastInFlight,
    MismatchStatus,
    PauseStatus,
    ShardPause,
    StagingStatus,
    VerificationStatus,
)
from megafleet.api.v1alpha1.refit_session import (
    ConfigMapKeyRef,
    CopyBackend,
    MegatronNativeSpec,
    NemoCollectiveSpec,
    NemoReshardSpec,
    RefitInfoRef,
    RefitSessionPhase,
    RefitSessionSpec,
    RefitSessionStatus,
    ReshardStage,
)

KINDS: tuple[KindInfo, ...] = (megatron_generation.KIND, refit.KIND, refit_session.KIND)
"""Every kind of the version, in the order the CRDs and the API reference list them."""

__all__ = [
    "API_VERSION",
    "DEFAULT_IN_FLIGHT",
    "DEFAULT_STAGING",
    "DNS_1035_LABEL",
    "GROUP",
    "KINDS",
    "NAME_MAX",
    "NAME_NOT_DNS_1035",
    "NAME_TOO_LONG",
    "SHM_OVER_MEMORY",
    "VERSION",
    "ApiModel",
    "CacheSpec",
    "CheckpointSource",
    "CommitStatus",
    "Condition",
    "ConditionStatus",
    "ConfigMapKeyRef",
    "ConfigMapVolumeSource",
    "CopyBackend",
    "CsiSource",
    "EmptyDirSource",
    "Endpoint",
    "EngineSpec",
    "EnvFromSource",
    "EnvVar",
    "EnvVarSource",
    "FieldSelector",
    "FleetRef",
    "FleetRefitStatus",
    "FrontendSpec",
    "GangPlacer",
    "GangScheduler",
    "GangSpec",
    "HostPathSource",
    "ImageSource",
    "InFlightStatus",
    "KeySelector",
    "KindInfo",
    "LastInFlight",
    "LocalObjectReference",
    "MegatronGenerationSpec",
    "MegatronGenerationStatus",
    "MegatronNativeSpec",
    "Membership",
    "MismatchStatus",
    "ModelSpec",
    "NemoCollectiveSpec",
    "NemoReshardSpec",
    "NfsSource",
    "NvlinkPolicy",
    "ObjectRef",
    "ParallelismSpec",
    "PauseStatus",
    "PersistentVolumeClaimSource",
    "PhaseTiming",
    "PlacementSpec",
    "PodSpec",
    "PullPolicy",
    "RankOffset",
    "RefitInfoRef",
    "RefitObjectSpec",
    "RefitObjectStatus",
    "RefitPhase",
    "RefitSessionPhase",
    "RefitSessionSpec",
    "RefitSessionStatus",
    "RefitSourceSpec",
    "RefitSpec",
    "RendezvousSource",
    "ReshardStage",
    "ResourcesSpec",
    "SecretKeyRef",
    "SecretVolumeSource",
    "SessionSource",
    "ShardPause",
    "ShardPhase",
    "ShardStatus",
    "StagingStatus",
    "Toleration",
    "VerificationStatus",
    "Volume",
    "VolumeMount",
    "WeightsSpec",
    "mount_problem",
]
