"""What a MegatronGeneration adds to every engine pod (``spec.pod``): volumes and mounts, /dev/shm,
caches, service account, priority and runtime class, pull secrets, labels and annotations.

Parts of :class:`~megafleet.api.v1alpha1.megatron_generation.MegatronGenerationSpec`. The operator's
own volumes, mounts, labels and annotations (:mod:`megafleet.names`) win over these, and the rules
here refuse a spec that would take or cover them.
"""

from __future__ import annotations

import posixpath
import re
from typing import Annotated, Any, Literal

import pydantic
from pydantic import Field
from pydantic.alias_generators import to_snake

from megafleet import names
from megafleet.api.v1alpha1 import common, fleet_engine

_ABSOLUTE_PATH = r"^(/[^/\x00-\x1f\x7f]+)+$"
"""An absolute path without an empty segment or a trailing slash (``/`` itself is not one)."""


class LocalObjectReference(common.ApiModel):
    """An object of the fleet's namespace, by name alone."""

    name: str = Field(min_length=1, max_length=253, pattern=common.DNS_SUBDOMAIN, description="name of the object.")


class PersistentVolumeClaimSource(common.ApiModel):
    """A PersistentVolumeClaim of the fleet's namespace (e.g. a model or cache volume)."""

    claim_name: str = Field(
        min_length=1, max_length=253, pattern=common.DNS_SUBDOMAIN, description="claimName of the PVC."
    )
    read_only: bool | None = Field(default=None, description="readOnly mounts the claim read-only.")


class HostPathSource(common.ApiModel):
    """A directory or file of the node (refused by the baseline and restricted Pod Security levels)."""

    path: str = Field(max_length=4096, pattern=_ABSOLUTE_PATH, description="path on the node.")
    type: Literal[
        "", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice", "BlockDevice"
    ] = Field(default="", description="type the path must have; empty checks nothing.")


class EmptyDirSource(common.ApiModel):
    """A directory that lives as long as the pod."""

    medium: Literal["", "Memory"] = Field(default="", description="medium: empty (node disk) or Memory (tmpfs).")
    size_limit: str | None = Field(
        default=None, max_length=64, pattern=common.QUANTITY, description="sizeLimit of the directory, a quantity."
    )


class ConfigMapVolumeSource(common.ApiModel):
    """Every key of a ConfigMap as a file."""

    name: str = Field(min_length=1, max_length=253, pattern=common.DNS_SUBDOMAIN, description="name of the ConfigMap.")
    default_mode: int | None = Field(default=None, ge=0, le=0o777, description="defaultMode of the files.")
    optional: bool | None = Field(default=None, description="optional: a missing ConfigMap is no error.")


class SecretVolumeSource(common.ApiModel):
    """Every key of a Secret as a file."""

    secret_name: str = Field(
        min_length=1, max_length=253, pattern=common.DNS_SUBDOMAIN, description="secretName of the Secret."
    )
    default_mode: int | None = Field(default=None, ge=0, le=0o777, description="defaultMode of the files.")
    optional: bool | None = Field(default=None, description="optional: a missing Secret is no error.")


class CsiSource(common.ApiModel):
    """An inline CSI volume (e.g. a blob-store FUSE driver)."""

    driver: str = Field(min_length=1, max_length=63, pattern=common.DNS_SUBDOMAIN, description="driver name.")
    read_only: bool | None = Field(default=None, description="readOnly asks the driver for a read-only volume.")
    fs_type: str | None = Field(default=None, max_length=63, pattern=common.PRINTABLE, description="fsType to mount.")
    volume_attributes: dict[str, Annotated[str, Field(max_length=4096, pattern=common.PRINTABLE)]] = Field(
        default_factory=dict, max_length=64, description="volumeAttributes passed to the driver."
    )
    node_publish_secret_ref: LocalObjectReference | None = Field(
        default=None, description="nodePublishSecretRef: a Secret the driver is given."
    )


class ImageSource(common.ApiModel):
    """An OCI image or artifact mounted read-only (the ImageVolume feature; e.g. a model packaged as an image)."""

    reference: str = Field(
        min_length=1, max_length=1024, pattern=r"^[^\s\x00-\x1f\x7f]+$", description="reference of the image."
    )
    pull_policy: fleet_engine.PullPolicy | None = Field(default=None, description="pullPolicy of the image.")


class NfsSource(common.ApiModel):
    """An NFS export."""

    server: str = Field(min_length=1, max_length=253, pattern=common.HOST, description="server: host name or IP.")
    path: str = Field(max_length=4096, pattern=_ABSOLUTE_PATH, description="path of the export.")
    read_only: bool | None = Field(default=None, description="readOnly mounts the export read-only.")


_VOLUME_SOURCES = ("persistentVolumeClaim", "hostPath", "emptyDir", "configMap", "secret", "csi", "image", "nfs")
_ONE_SOURCE = f"set exactly one volume source of {', '.join(_VOLUME_SOURCES)}"


class Volume(common.ApiModel):
    """A volume of every engine pod: its name and exactly one source."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                common.cel(
                    "[" + ", ".join(f"has(self.{source})" for source in _VOLUME_SOURCES) + "].filter(x, x).size() == 1",
                    _ONE_SOURCE,
                ),
            ]
        }
    )

    name: str = Field(min_length=1, max_length=63, pattern=common.DNS_LABEL, description="name the mounts refer to.")
    persistent_volume_claim: PersistentVolumeClaimSource | None = Field(
        default=None, description="persistentVolumeClaim: a claim of the fleet's namespace."
    )
    host_path: HostPathSource | None = Field(default=None, description="hostPath: a path on the node.")
    empty_dir: EmptyDirSource | None = Field(default=None, description="emptyDir: scratch space of the pod.")
    config_map: ConfigMapVolumeSource | None = Field(default=None, description="configMap: a ConfigMap's keys.")
    secret: SecretVolumeSource | None = Field(default=None, description="secret: a Secret's keys.")
    csi: CsiSource | None = Field(default=None, description="csi: an inline CSI volume.")
    image: ImageSource | None = Field(default=None, description="image: an OCI image mounted read-only.")
    nfs: NfsSource | None = Field(default=None, description="nfs: an NFS export.")

    @pydantic.model_validator(mode="after")
    def _one_source(self) -> Volume:
        if sum(getattr(self, to_snake(source)) is not None for source in _VOLUME_SOURCES) != 1:
            raise ValueError(_ONE_SOURCE)
        return self

    def source(self) -> dict[str, Any]:
        """The volume as the core API writes it."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class VolumeMount(common.ApiModel):
    """Where a volume of ``pod.volumes`` appears in the engine container."""

    name: str = Field(min_length=1, max_length=63, pattern=common.DNS_LABEL, description="name of a pod.volumes entry.")
    mount_path: str = Field(
        max_length=4096, pattern=_ABSOLUTE_PATH, description="mountPath: an absolute path in the container."
    )
    read_only: bool | None = Field(default=None, description="readOnly mounts it read-only.")
    sub_path: str | None = Field(
        default=None,
        max_length=4096,
        pattern=r"^[^/\x00-\x1f\x7f][^\x00-\x1f\x7f]*$",
        description="subPath mounts this relative path of the volume instead of its root.",
    )


class CacheSpec(common.ApiModel):
    """Where the engine's library caches go (HF_HOME, TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR, ...)."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                common.cel(
                    "!has(self.volume) || !has(self.sizeLimit)", "sizeLimit is for the emptyDir: unset it with volume"
                )
            ]
        }
    )

    volume: str | None = Field(
        default=None,
        max_length=63,
        pattern=common.DNS_LABEL,
        description="volume names a pod.volumes entry (e.g. a PVC, so compiled kernels survive restarts) mounted "
        "at the cache directory; unset: an emptyDir per pod.",
    )
    size_limit: str | None = Field(
        default=None, max_length=64, pattern=common.QUANTITY, description="sizeLimit of the cache emptyDir, a quantity."
    )

    @pydantic.model_validator(mode="after")
    def _one(self) -> CacheSpec:
        if self.volume is not None and self.size_limit is not None:
            raise ValueError("sizeLimit is for the emptyDir: unset it with volume")
        return self


SHM_OVER_MEMORY = "pod.shmSize may not exceed resources.memory: /dev/shm is memory the pod's limit counts"
_RESERVED_VOLUME = (
    f"volume names {', '.join(names.OPERATOR_VOLUMES[:2])} and megafleet-* are the operator's; choose another name"
)
_RESERVED_MOUNT = (
    f"mountPath may not be, nor contain, the operator's mounts {', '.join(names.OPERATOR_MOUNTS)}, nor lie "
    f"inside {names.AGENT_TOKEN_MOUNT}"
)
_MOUNT_NOT_NORMAL = "mountPath may not contain . or .. segments"
_UNKNOWN_VOLUME = "volumeMounts and cache.volume must name a pod.volumes entry"
_ANNOTATION_KEY = "annotation keys must be qualified names ([prefix/]name)"
_LABEL_ENTRY = "labels must be label keys ([prefix/]name) with label values"


def mount_problem(path: str) -> str | None:
    """Why a user mount at ``path`` would clash with the operator's mounts, or None."""
    if posixpath.normpath(path) != path:
        return _MOUNT_NOT_NORMAL
    covers = any(path == owned or owned.startswith(path + "/") for owned in names.OPERATOR_MOUNTS)
    if covers or path.startswith(names.AGENT_TOKEN_MOUNT + "/"):
        return _RESERVED_MOUNT
    return None


def _reserved_volume(name: str) -> bool:
    return name in names.OPERATOR_VOLUMES or name.startswith("megafleet-")


_MOUNT_CEL = (
    "!has(self.volumeMounts) || self.volumeMounts.all(m, "
    + f"{list(names.OPERATOR_MOUNTS)}.all(o, m.mountPath != o && !o.startsWith(m.mountPath + '/')) && "
    + f"!m.mountPath.startsWith('{names.AGENT_TOKEN_MOUNT}/'))"
)


class PodSpec(common.ApiModel):
    """What every engine pod carries beside what the operator builds: volumes, pod identity, scheduling
    class, metadata. The operator's own labels, annotations, volumes and mounts win over these."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                common.cel(
                    "!has(self.volumes) || "
                    "self.volumes.all(v, !(v.name in ['agent-token', 'tmp']) && !v.name.startsWith('megafleet-'))",
                    _RESERVED_VOLUME,
                    field_path=".volumes",
                ),
                common.cel(_MOUNT_CEL, _RESERVED_MOUNT, field_path=".volumeMounts"),
                common.cel(
                    "!has(self.volumeMounts) || self.volumeMounts.all(m, !m.mountPath.contains('/./') && "
                    "!m.mountPath.contains('/../') && "
                    "!m.mountPath.endsWith('/.') && !m.mountPath.endsWith('/..'))",
                    _MOUNT_NOT_NORMAL,
                    field_path=".volumeMounts",
                ),
                common.cel(
                    "(!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && "
                    "self.volumes.exists(v, v.name == m.name))) && (!has(self.cache) || !has(self.cache.volume) || "
                    "(has(self.volumes) && self.volumes.exists(v, v.name == self.cache.volume)))",
                    _UNKNOWN_VOLUME,
                    field_path=".volumeMounts",
                ),
                common.cel(
                    f"!has(self.labels) || self.labels.all(k, k.matches(r'{common.LABEL_KEY}') && "
                    f"self.labels[k].matches(r'{common.LABEL_VALUE}'))",
                    _LABEL_ENTRY,
                    field_path=".labels",
                ),
                common.cel(
                    f"!has(self.annotations) || self.annotations.all(k, k.matches(r'{common.LABEL_KEY}'))",
                    _ANNOTATION_KEY,
                    field_path=".annotations",
                ),
            ]
        }
    )

    labels: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict,
        max_length=64,
        description="labels added to every engine pod; the operator's own (megafleet.dev/*, "
        "app.kubernetes.io/managed-by) win on conflict.",
    )
    annotations: dict[str, Annotated[str, Field(max_length=65536)]] = Field(
        default_factory=dict,
        max_length=64,
        description="annotations added to every engine pod; the operator's own (megafleet.dev/template-hash) "
        "win on conflict.",
    )
    service_account_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=common.DNS_SUBDOMAIN,
        description="serviceAccountName of the engine pods (it must exist); unset: the namespace's default.",
    )
    automount_service_account_token: bool = Field(
        default=False,
        description="automountServiceAccountToken mounts the service account's token (e.g. for workload "
        "identity to a model store); engines do not call the Kubernetes API.",
    )
    priority_class_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=common.DNS_SUBDOMAIN,
        description="priorityClassName of the engine pods (it must exist).",
    )
    runtime_class_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=common.DNS_SUBDOMAIN,
        description="runtimeClassName of the engine pods (e.g. nvidia where the GPU runtime is not the default).",
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="imagePullSecrets: Secrets for pulling the engine image (and image volumes).",
    )
    volumes: list[Volume] = Field(
        default_factory=list,
        max_length=32,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="volumes of every engine pod (PVC, hostPath, emptyDir, ConfigMap, Secret, CSI, image, NFS), "
        "mounted by volumeMounts; agent-token, tmp and megafleet-* are the operator's names.",
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list,
        max_length=32,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["mountPath"]},
        description=f"volumeMounts of the engine container; the operator's mounts ({', '.join(names.OPERATOR_MOUNTS)}) "
        "cannot be taken or covered.",
    )
    shm_size: str | None = Field(
        default=None,
        max_length=64,
        pattern=common.QUANTITY,
        description=f"shmSize sizes the memory-backed {names.SHM_MOUNT} every engine pod gets (NCCL and torch "
        "need more than the runtime's 64 MiB); it counts against resources.memory, which it may not exceed. "
        "Unset: bounded by resources.memory only.",
    )
    cache: CacheSpec = Field(
        default_factory=CacheSpec,
        json_schema_extra=common.defaulted(CacheSpec),
        description=f"cache is where the engine's library caches go, mounted at {names.CACHE_MOUNT}.",
    )

    @pydantic.model_validator(mode="after")
    def _operator_owned(self) -> PodSpec:
        reserved = sorted(volume.name for volume in self.volumes if _reserved_volume(volume.name))
        if reserved:
            raise ValueError(f"{_RESERVED_VOLUME}: {reserved}")
        for mount in self.volume_mounts:
            problem = mount_problem(mount.mount_path)
            if problem:
                raise ValueError(f"{problem}: {mount.mount_path!r}")
        known = {volume.name for volume in self.volumes}
        referenced = {m.name for m in self.volume_mounts} | ({self.cache.volume} if self.cache.volume else set())
        unknown = sorted(referenced - known)
        if unknown:
            raise ValueError(f"{_UNKNOWN_VOLUME}: {unknown}")
        _unique("volumes", [volume.name for volume in self.volumes])
        _unique("volumeMounts", [mount.mount_path for mount in self.volume_mounts])
        _unique("imagePullSecrets", [secret.name for secret in self.image_pull_secrets])
        if any(
            not re.fullmatch(common.LABEL_KEY, k) or not re.fullmatch(common.LABEL_VALUE, v)
            for k, v in self.labels.items()
        ):
            raise ValueError(_LABEL_ENTRY)
        if any(not re.fullmatch(common.LABEL_KEY, key) for key in self.annotations):
            raise ValueError(_ANNOTATION_KEY)
        return self


def _unique(field: str, keys: list[str]) -> None:
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ValueError(f"{field}: duplicate {repeated}")
