"""On-prem hosts that say what they hold: one server template built from the hosts file.

A host may declare `gpu:` and `gpus:` (by hand or from `gpuprov hosts probe`). When the hosts do,
the planner plans on exactly that machine instead of choosing among the catalog's server
templates; a run needs one kind of node, so hosts that differ are refused with the groups named
(plan each group with its own hosts file).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from gpuprov.catalog.instances import InstanceType
from gpuprov.errors import GpuprovError
from gpuprov.units import GiB, GB



def host_groups(hosts: list[Any]) -> dict[tuple[str, int] | None, list[Any]]:
    """Hosts by what they declare: (gpu, gpus), or None for hosts that say nothing."""
    groups: dict[tuple[str, int] | None, list[Any]] = {}
    for h in hosts:
        key = (h.gpu, h.gpus) if h.gpu else None
        groups.setdefault(key, []).append(h)
    return groups


def _refuse_mixed(groups: dict) -> None:
    parts = []
    for key, hs in groups.items():
        what = "no gpu/gpus given" if key is None else f"{key[1]} x {key[0]}"
        parts.append(f"{', '.join(h.name for h in hs)}: {what}")
    raise GpuprovError("the hosts are not all the same machine (" + "; ".join(parts) + "); one training run "
                       "needs one kind of node: plan each group with its own hosts file")


def declared_template(hosts: list[Any], templates: list[Any], gpu_lookup: Callable[[str], Any]) -> Any | None:
    """The server the hosts declare, as an on-prem template (None when they declare nothing)."""
    groups = host_groups(hosts)
    if list(groups) == [None]:
        return None
    if len(groups) > 1:
        _refuse_mixed(groups)
    slug, count = next(k for k in groups if k is not None)
    gpu = gpu_lookup(slug)  # unknown slug: one line with suggestions
    same = [t for t in templates if t.gpu == gpu.slug]
    base = min(same, key=lambda t: abs(t.gpus - count)) if same else None
    first = hosts[0]
    fabric = first.fabric or (base.fabric if base else "ethernet")
    gbps = first.nic_gbps / count if first.nic_gbps else (base.fabric_gbps_per_gpu if base else 10.0)
    # facts the hosts file does not state are assumed for the time model (the plan says so) and
    # read "unknown" in every check, never sized into a bill of materials as if they were there
    unknown = tuple(k for k, given in (("ram", first.ram_gib), ("cores", first.cores),
                                       ("nvme", first.nvme_count is not None),
                                       ("fabric", first.fabric or first.nic_gbps), ("pcie", False)) if not given)
    fields = dict(
        name=f"{count}x-{gpu.slug}", cloud="onprem", gpu=gpu.slug, gpus=count,
        # an NVSwitch board is all of its GPUs; fewer of them are PCIe cards
        nvswitch=bool(base and base.nvswitch and base.gpus == count),
        pcie_gen=base.pcie_gen if base else gpu.pcie_gen, fabric=fabric, fabric_gbps_per_gpu=gbps,
        source="the hosts file (gpu/gpus per host)" + (f"; links as {base.name}: {base.source}" if base else
                                                       "; no template for this GPU: PCIe, 10 Gb/s Ethernet"),
        description=f"your hosts: {count} x {gpu.name}", unknown=unknown,
        ram_bytes=first.ram_gib * GiB if first.ram_gib else None,
        vcpus=first.cores * 2 if first.cores else None,
        nvme_count=first.nvme_count or 0, nvme_bytes_each=(first.nvme_gb_each or 0) * GB,
        network_cards=0 if "fabric" in unknown else (base.network_cards if base else 0),
    )
    return replace(base, **fields) if base else InstanceType(**fields)


def with_declared_hosts(spec: Any, pool: list[Any], gpu_lookup: Callable[[str], Any]) -> list[Any]:
    """The instance pool with the catalog's server templates replaced by the hosts' own machine."""
    if not spec.hosts:
        return pool
    templates = [i for i in pool if i.onprem]
    mine = declared_template(list(spec.hosts), templates, gpu_lookup)
    if mine is None:
        # the hosts exist but state nothing: a template stands for their GPUs only; RAM, cores,
        # NVMe, fabric and PCIe are theirs, unknown, never the template's purchase sizing
        return [i for i in pool if not i.onprem] + [unstated(t) for t in templates]
    return [i for i in pool if not i.onprem] + [mine]


UNSTATED = ("ram", "cores", "nvme", "fabric", "pcie")


def unstated(template: Any) -> Any:
    """An on-prem template as the listed hosts that state nothing: every host fact unknown."""
    return replace(template, unknown=UNSTATED, ram_bytes=None, vcpus=None, nvme_count=0, nvme_bytes_each=0,
                   network_cards=0)
