"""The registry of targets: the one list of places gpuprov brings nodes up.

Adding one (a cloud, a Kubernetes cluster) is a module here with a `TARGET` (gpuprov/targets/base.py
says what it answers), its catalog data (catalog/data/instances.yaml, bringup.yaml, regions.yaml)
and its templates (templates/terraform/<name>/ for a Terraform provisioner). The CLI's choices and
the spec's and Plan's cloud names derive from or are tested against NAMES.
"""

from __future__ import annotations

from gpuprov.errors import GpuprovError
from gpuprov.targets import aws, azure, gcp, oci, onprem
from gpuprov.targets.base import Limits, Target, TfvarsKeys

TARGETS: dict[str, Target] = {t.name: t for t in (aws.TARGET, gcp.TARGET, azure.TARGET, oci.TARGET, onprem.TARGET)}
NAMES: tuple[str, ...] = tuple(TARGETS)
CLOUDS: tuple[str, ...] = tuple(n for n, t in TARGETS.items() if t.provisioner == "terraform")
CHOICES: tuple[str, ...] = (*NAMES, "any")  # the --cloud choices: a target, or compare them all


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise GpuprovError(f"unknown target {name!r}; one of {', '.join(NAMES)}") from None


__all__ = ["CHOICES", "CLOUDS", "NAMES", "TARGETS", "Limits", "Target", "TfvarsKeys", "get_target"]
