"""Cloud instance types and on-prem server templates (data in data/instances.yaml).

Cloud entries are complete machines with a price; on-prem templates fix only the GPU side and
leave the host (CPU, RAM, NVMe) to `gpuprov.host.size_onprem_host`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from gpuprov.catalog import load_data
from gpuprov.errors import GpuprovError
from gpuprov.targets import NAMES, get_target
from gpuprov.units import GiB, GB

CLOUDS: tuple[str, ...] = NAMES  # the target registry (gpuprov/targets/) is the one list
FABRICS: tuple[str, ...] = ("efa", "infiniband", "roce", "tcpxo", "ethernet", "none")


@dataclass(frozen=True)
class InstanceType:
    """One instance type (or on-prem server) offered: its GPUs, host, fabric and price."""
    name: str
    cloud: str
    gpu: str  # GPU slug (gpuprov.catalog.gpus)
    gpus: int
    nvswitch: bool
    pcie_gen: int
    fabric: str
    fabric_gbps_per_gpu: float
    source: str
    # None on an on-prem template: the host rules size them
    vcpus: int | None = None
    ram_bytes: int | None = None
    nvme_count: int = 0
    nvme_bytes_each: int = 0
    network_cards: int = 0
    efa_interfaces: int = 0
    region: str | None = None
    price_per_hour_usd: float | None = None
    price_date: str | None = None
    price_source: str | None = None
    nccl_busbw_gbytes_per_s: float | None = None
    busbw_source: str = ""
    description: str = ""
    purchase: str | None = None  # the purchase option price_per_hour_usd is for (the planner sets it)
    # on-prem hosts: facts nobody stated (ram, cores, nvme, fabric, pcie); checks read them "unknown"
    unknown: tuple[str, ...] = ()

    @property
    def onprem(self) -> bool:
        return self.cloud == "onprem"

    @property
    def nvme_bytes_total(self) -> int:
        return self.nvme_count * self.nvme_bytes_each


def _cloud_entry(raw: dict) -> InstanceType:
    try:
        inst = InstanceType(
            name=raw["name"], cloud=raw["cloud"], gpu=raw["gpu"], gpus=int(raw["gpus"]),
            nvswitch=bool(raw["nvswitch"]), pcie_gen=int(raw["pcie_gen"]), fabric=raw["fabric"],
            fabric_gbps_per_gpu=float(raw["fabric_gbps_per_gpu"]), source=raw["source"],
            vcpus=int(raw["vcpus"]), ram_bytes=int(raw["ram_gib"]) * GiB,
            nvme_count=int(raw["nvme"]["count"]), nvme_bytes_each=int(raw["nvme"]["gb_each"]) * GB,
            network_cards=int(raw["network_cards"]), efa_interfaces=int(raw["efa_interfaces"]),
            region=raw["region"],
            price_per_hour_usd=None if raw["price_per_hour_usd"] is None else float(raw["price_per_hour_usd"]),
            price_date=str(raw["price_date"]), price_source=raw["price_source"],
            nccl_busbw_gbytes_per_s=raw["nccl_busbw_gbytes_per_s"], busbw_source=raw["busbw_source"],
        )
    except KeyError as exc:  # a catalog bug, caught by the tests; say which entry
        raise ValueError(f"instances.yaml: entry {raw.get('name')!r} lacks {exc}") from exc
    _validate(inst)
    return inst


def _onprem_entry(raw: dict) -> InstanceType:
    inst = InstanceType(
        name=raw["name"], cloud="onprem", gpu=raw["gpu"], gpus=int(raw["gpus"]),
        nvswitch=bool(raw["nvswitch"]), pcie_gen=int(raw["pcie_gen"]), fabric=raw["fabric"],
        fabric_gbps_per_gpu=float(raw["fabric_gbps_per_gpu"]), source=raw["source"],
        description=raw.get("description", ""), busbw_source="on-prem: no vendor threshold",
    )
    _validate(inst)
    return inst


def _validate(inst: InstanceType) -> None:
    if inst.cloud not in CLOUDS:
        raise ValueError(f"instances.yaml: {inst.name}: unknown cloud {inst.cloud!r}")
    if inst.fabric not in FABRICS:
        raise ValueError(f"instances.yaml: {inst.name}: unknown fabric {inst.fabric!r}")
    if inst.gpus < 1:
        raise ValueError(f"instances.yaml: {inst.name}: gpus must be >= 1")


@lru_cache(maxsize=None)
def list_instances(cloud: str | None = None) -> tuple[InstanceType, ...]:
    """Every cloud instance type and on-prem template, optionally of one cloud."""
    data = load_data("instances.yaml")
    items = [_cloud_entry(raw) for raw in data["instances"]]
    items += [_onprem_entry(raw) for raw in data["onprem_templates"]]
    if cloud in (None, "any"):
        return tuple(items)
    if cloud not in CLOUDS:
        raise GpuprovError(f"unknown cloud {cloud!r}; choose one of {', '.join(CLOUDS)} or any")
    target = get_target(cloud)
    return tuple(i for i in items if target.serves(i))


def get_instance(name: str) -> InstanceType:
    for inst in list_instances():
        if inst.name == name or inst.name.lower() == name.lower():
            return inst
    raise GpuprovError(f"unknown instance type {name!r}; see `gpuprov instances`")


def nvme_device_glob(cloud: str) -> tuple[str | None, str]:
    """(glob, source) where this cloud's local NVMe drives appear; glob None = discover."""
    entry = load_data("instances.yaml")["nvme_device_globs"][cloud]
    return entry["glob"], entry["source"]
