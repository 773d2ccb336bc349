"""Fabric and host-software catalogs: data in data/fabrics.yaml and data/software.yaml.

`get_fabric` returns the node-to-node fabric and the one NCCL environment for it (the Ansible
nccl role and launch/env.sh both render plan.fabric); `get_software` returns the driver/CUDA/NCCL
stack for a GPU architecture, with GDS and fabric manager decided per GPU product. Unknown names
raise GpuprovError with the known ones listed.
"""

from __future__ import annotations

from typing import Any

from gpuprov.catalog import load_data
from gpuprov.catalog.images import image_profile
from gpuprov.errors import GpuprovError
from gpuprov.plan import FabricInfo, Software

_NOT_CLOUDS = ("single_node", "multinode_allreduce")
_ENTRY_KEYS = ("nccl_env_profile", "nccl_lib_path", "hcas", "subnet_manager", "mtu", "gpu_nics", "nccl_net",
               "nccl_conf_managed_by_image", "rdma_ipv4_by")


def _cloud_table(cloud: str) -> dict[str, Any]:
    data = load_data("fabrics.yaml")
    clouds = [key for key in data if key not in _NOT_CLOUDS]
    if cloud not in clouds:
        raise GpuprovError(f"no fabric catalog for cloud {cloud!r}; known: {', '.join(sorted(clouds))}")
    return data[cloud]


def fabric_entry(cloud: str, instance_type: str, name: str | None = None) -> dict[str, Any]:
    """The raw catalog entry: the exact instance type first, then the cloud's entry for fabric
    `name` (on-prem: the host template names its fabric), then the cloud default."""
    table = _cloud_table(cloud)
    instances = table.get("instances") or {}
    if instance_type in instances:
        return instances[instance_type]
    by_fabric = table.get("fabrics") or {}
    if name in by_fabric:
        return by_fabric[name]
    if "default" in table:
        return table["default"]
    raise GpuprovError(
        f"no fabric entry for {cloud} instance {instance_type!r}; known: {', '.join(sorted(instances))}"
    )


def fabric_name_for(cloud: str, instance_type: str) -> str:
    """Which fabric the catalog has for this instance type (efa, roce, infiniband, tcpxo, ethernet)."""
    return str(fabric_entry(cloud, instance_type)["fabric"])


def _to_fabric_info(entry: dict[str, Any]) -> FabricInfo:
    fields = {key: entry[key] for key in _ENTRY_KEYS if key in entry}
    fields["hcas"] = list(fields.get("hcas") or [])
    fields["gpu_nics"] = list(fields.get("gpu_nics") or [])
    return FabricInfo(
        name=entry["fabric"],
        gbps_per_gpu=float(entry["gbps_per_gpu"]),
        nccl_env={str(k): str(v) for k, v in (entry.get("nccl_env") or {}).items()},
        source=" ".join(str(entry["source"]).split()),
        **fields,
    )


def get_fabric(name: str, cloud: str, instance_type: str) -> FabricInfo:
    """Fabric `name` on `cloud`/`instance_type`; `name="none"` is the single-node case.

    The name must agree with the catalog (e.g. OCI cluster networks are `roce`, AWS p5 is `efa`):
    a mismatch is a planner bug or a user override the hardware cannot honour.
    """
    if name == "none":
        _cloud_table(cloud)  # still reject an unknown cloud
        return _to_fabric_info(load_data("fabrics.yaml")["single_node"])
    entry = fabric_entry(cloud, instance_type, name)
    if entry["fabric"] != name:
        raise GpuprovError(
            f"{cloud} {instance_type} has fabric {entry['fabric']!r} in the catalog, not {name!r}"
        )
    return _to_fabric_info(entry)


def _product_features(data: dict[str, Any], gpu: str) -> tuple[bool, bool]:
    """(GDS supported, fabric-manager GPU) for one catalog GPU slug, from software.yaml."""
    gds = data["gds"]
    supported, unsupported = set(gds["supported"]), set(gds["unsupported"])
    if gpu not in supported | unsupported:
        raise GpuprovError(
            f"GPU {gpu!r} is not classified for GPUDirect Storage in software.yaml (gds.supported / "
            "gds.unsupported); add it there with the support matrix as source"
        )
    return gpu in supported, gpu in set(data["fabric_manager"]["gpus"])


def get_software(gpu_architecture: str, fabric_name: str, nvswitch: bool, gpu: str | None = None,
                 cloud: str | None = None, instance: str | None = None) -> Software:
    """Driver branch, CUDA, NCCL, EFA installer, GDS and fabric manager for this node type.

    The stack (driver, CUDA, NCCL) follows the GPU architecture; GDS and fabric manager follow the
    product `gpu` (a catalog slug): GDS only on data center/professional GPUs, fabric manager only
    for NVSwitch boards (`nvswitch`) of SXM GPUs. Without `gpu` the architecture's defaults apply.
    `cloud` picks what GDS can do there (gds_modes) and Google's gIB plugin on GCP RoCE."""
    data = load_data("software.yaml")
    stacks = data["stacks"]
    if gpu_architecture not in stacks:
        raise GpuprovError(
            f"no software stack for GPU architecture {gpu_architecture!r}; known: {', '.join(sorted(stacks))}"
        )
    stack = stacks[gpu_architecture]
    fabric_sw = (data.get("fabrics") or {}).get(fabric_name) or {}
    gds, fabric_manager = bool(stack["gds"]), bool(nvswitch)
    sources = [stack["source"], data["os"]["source"]]
    if gpu is not None:
        gds_product, fm_gpu = _product_features(data, gpu)
        gds = gds and gds_product
        fabric_manager = fabric_manager and fm_gpu
        sources.append(f"GDS {'supported' if gds_product else 'not supported'} on {gpu}: {data['gds']['source']}")
    if fabric_sw:
        sources.append(fabric_sw["source"])
    if fabric_manager:
        sources.append(data["fabric_manager"]["source"])
    gds_mode = str(data["gds_modes"].get(cloud or "onprem", "compat"))
    if gds:
        sources.append(f"GDS {gds_mode} mode: {data['gds_modes']['source']}")
    gib = data["gcp_gib"] if cloud == "gcp" and fabric_name == "roce" else None
    env = data["python_env"]
    sources.append(env["source"])
    if gib:
        sources.append(gib["source"])
    return Software(
        os=list(data["os"]["supported"]),
        driver_branch=str(stack["driver_branch"]),
        open_kernel_modules=bool(stack["open_kernel_modules"]),
        cuda_version=str(stack["cuda_version"]),
        nccl_version=str(stack["nccl_version"]),
        fabric_manager=fabric_manager,
        efa_installer_version=str(fabric_sw["efa_installer_version"]) if "efa_installer_version" in fabric_sw else None,
        gds=gds,
        source="; ".join(" ".join(str(s).split()) for s in sources),
        gds_mode=gds_mode,
        nccl_gib_version=str(gib["nccl_gib_version"]) if gib else None,
        python_env_path=str(env["path"]),
        python_index_url=str(env["index_url"]),
        python_requirements=[str(r) for r in env["requirements"]],
        image_profile=image_profile(cloud, instance or "") if cloud else None,
    )


def fabric_allreduce_threshold(fabric: FabricInfo, gpus_per_node: int, nodes: int) -> tuple[float | None, str]:
    """Minimum multi-node all-reduce bus bandwidth (GB/s) for this fabric, and its source.

    A ring all-reduce across nodes is bounded by each node's fabric bandwidth (NVLink inside the
    node is faster), so bus bandwidth tops out at gbps_per_gpu x GPUs / 8 GB/s; the threshold is
    the catalog's fraction of that. None for one node or a fabric without RDMA (sockets vary)."""
    rule = load_data("fabrics.yaml")["multinode_allreduce"]
    if fabric.probe and nodes > 1:  # nobody stated the fabric: its line rate is an assumption, no floor
        return None, "no multi-node threshold: the fabric is unknown (" + fabric.probe + ")"
    if nodes < 2 or fabric.name not in rule["fabrics"]:
        return None, "no multi-node threshold: " + ("one node" if nodes < 2 else f"fabric {fabric.name}")
    line_rate = fabric.gbps_per_gpu * gpus_per_node / 8.0
    minimum = round(line_rate * float(rule["fraction_of_line_rate"]), 1)
    source = (f"{rule['fraction_of_line_rate']} x {line_rate:g} GB/s node fabric line rate "
              f"({fabric.gbps_per_gpu:g} Gb/s x {gpus_per_node} GPUs): " + " ".join(str(rule["source"]).split()))
    return minimum, source
