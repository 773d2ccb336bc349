"""Fabric and software catalogs: every entry loads into the Plan types, has a source, and the
NCCL environment matches the installed software (no obsolete variables)."""

from __future__ import annotations

import pytest

from gpuprov.catalog import load_data
from gpuprov.catalog.fabrics import fabric_entry, fabric_name_for, get_fabric, get_software
from gpuprov.errors import GpuprovError
from gpuprov.plan import FabricInfo, Software


def _all_entries():
    data = load_data("fabrics.yaml")
    for cloud, table in data.items():
        if cloud == "single_node":
            continue
        for instance in (table.get("instances") or {}):
            yield cloud, instance
        if "default" in table:
            yield cloud, "some-unknown-type"


@pytest.mark.parametrize("cloud,instance", list(_all_entries()))
def test_every_entry_loads_with_a_source(cloud, instance):
    fabric = get_fabric(fabric_name_for(cloud, instance), cloud, instance)
    assert isinstance(fabric, FabricInfo)
    assert fabric.source.strip()
    assert fabric.gbps_per_gpu > 0
    assert all(isinstance(v, str) for v in fabric.nccl_env.values())
    if fabric.name in ("infiniband", "roce") and fabric.hcas and "NCCL_IB_HCA" in fabric.nccl_env:
        # the exact-match HCA list and the hcas field must name the same devices
        listed = fabric.nccl_env["NCCL_IB_HCA"].lstrip("=").split(",")
        assert sorted(listed) == sorted(fabric.hcas)


def test_efa_env_is_the_modern_minimal_set():
    fabric = get_fabric("efa", "aws", "p5.48xlarge")
    assert fabric.nccl_env == {"FI_EFA_USE_HUGE_PAGE": "0"}
    for obsolete in ("FI_EFA_USE_DEVICE_RDMA", "FI_PROVIDER", "NCCL_PROTO", "FI_EFA_FORK_SAFE"):
        assert obsolete not in fabric.nccl_env
    assert fabric.gbps_per_gpu == 400.0
    software = get_software("hopper", "efa", nvswitch=True)
    major, minor, _ = (int(p) for p in software.efa_installer_version.split("."))
    assert (major, minor) >= (1, 29)  # bundles libfabric >= 1.18 and aws-ofi-nccl >= 1.7


def test_gcp_profiles():
    gib = get_fabric("roce", "gcp", "a3-ultragpu-8g")
    assert gib.nccl_env_profile == "/usr/local/gib/scripts/set_nccl_env.sh"
    assert gib.nccl_env["NCCL_NET"] == "gIB"
    assert get_fabric("roce", "gcp", "a4-highgpu-8g").nccl_env_profile == gib.nccl_env_profile
    tcpxo = get_fabric("tcpxo", "gcp", "a3-megagpu-8g")
    assert tcpxo.nccl_env_profile == "/var/lib/tcpxo/lib64/nccl-env-profile.sh"
    assert tcpxo.mtu == 8896


def test_azure_and_oci():
    nd = get_fabric("infiniband", "azure", "Standard_ND96isr_H100_v5")
    assert nd.nccl_env["NCCL_TOPO_FILE"] == "/opt/microsoft/ndv5-topo.xml"
    assert nd.nccl_env["NCCL_IB_PCI_RELAXED_ORDERING"] == "1"
    assert nd.subnet_manager == "managed" and len(nd.hcas) == 8
    oci = get_fabric("roce", "oci", "BM.GPU.H100.8")
    assert oci.nccl_env["NCCL_IB_HCA"].startswith("=mlx5_0,")
    assert "mlx5_2" not in oci.hcas and len(oci.hcas) == 16  # front-end NIC excluded
    assert (oci.nccl_env["NCCL_IB_GID_INDEX"], oci.nccl_env["NCCL_IB_TC"], oci.nccl_env["NCCL_IB_TIMEOUT"]) == ("3", "41", "22")


def test_onprem_and_single_node():
    onprem = get_fabric("infiniband", "onprem", "hgx-h100-8")
    assert onprem.subnet_manager == "opensm"
    single = get_fabric("none", "aws", "p5.48xlarge")
    assert single.name == "none" and single.nccl_env == {}


def test_errors_are_one_line():
    with pytest.raises(GpuprovError, match="catalog, not 'infiniband'"):
        get_fabric("infiniband", "aws", "p5.48xlarge")
    with pytest.raises(GpuprovError, match="no fabric catalog for cloud"):
        get_fabric("efa", "mars", "x")
    with pytest.raises(GpuprovError, match="no fabric entry"):
        fabric_entry("oci", "VM.Standard.E4")
    with pytest.raises(GpuprovError, match="no software stack"):
        get_software("kepler", "efa", False)


@pytest.mark.parametrize("arch", ["ampere", "ada", "hopper", "blackwell"])
def test_software_stack_is_consistent(arch):
    sw = get_software(arch, "infiniband", nvswitch=True)
    assert isinstance(sw, Software)
    assert sw.fabric_manager is True and sw.efa_installer_version is None
    assert sw.open_kernel_modules
    assert sw.os == ["ubuntu-22.04", "ubuntu-24.04"]
    # NCCL must be the build for the chosen CUDA, and CUDA 12.8 needs driver >= 570
    assert sw.nccl_version.endswith(f"+cuda{sw.cuda_version}")
    cuda = tuple(int(p) for p in sw.cuda_version.split("."))
    if cuda >= (12, 8):
        assert int(sw.driver_branch) >= 570
    assert sw.source
    assert get_software(arch, "ethernet", nvswitch=False).fabric_manager is False


def test_every_catalog_instance_has_its_fabric():
    """Each instance type the planner can pick resolves to a fabric entry of the same name."""
    from gpuprov.catalog import instances
    for inst in instances.list_instances():
        fabric = get_fabric(inst.fabric, inst.cloud, inst.name)
        assert fabric.name == inst.fabric, inst.name
        assert get_fabric("none", inst.cloud, inst.name).name == "none"


def test_onprem_fabric_follows_the_host_template():
    assert get_fabric("roce", "onprem", "l40s-4x").subnet_manager == "none"
    assert get_fabric("ethernet", "onprem", "rtx4090-8x").nccl_env == {}
    assert get_fabric("infiniband", "onprem", "anything").subnet_manager == "opensm"


# --------------------------------------------------------------------------- the YAML loader
def _typed(value):
    """A value with every scalar's type spelled out: 1 == 1.0 == True must not pass as equal."""
    if isinstance(value, dict):
        return ("map", [(_typed(k), _typed(v)) for k, v in value.items()])
    if isinstance(value, list):
        return ("seq", [_typed(v) for v in value])
    if isinstance(value, float) and value != value:
        return ("float", "nan")
    return (type(value).__name__, value)


def test_fast_loader_reads_every_catalog_exactly_as_ruamel_does():
    from gpuprov.catalog import _fast_loader, parse_yaml
    from gpuprov.resources import catalog_data_dir

    assert _fast_loader() is not None, "PyYAML with libyaml is a dependency: the catalogs parse through it"
    files = sorted(catalog_data_dir().glob("*.yaml"))
    assert len(files) >= 8
    for path in files:
        text = path.read_text(encoding="utf-8")
        assert _typed(parse_yaml(text)) == _typed(parse_yaml(text, fast=False)), path.name
        assert _typed(load_data(path.name)) == _typed(parse_yaml(text, fast=False)), path.name


def test_fast_loader_speaks_yaml_1_2_like_ruamel():
    from gpuprov.catalog import parse_yaml

    doc = "\n".join([
        "a: 017", "b: 0o17", "c: 0x1F", "d: 1_000", "e: 1.0e9", "f: 1e9", "g: .5", "h: -.inf", "i: yes",
        "j: on", "k: True", "l: ~", "m:", "n: null", "o: 2026-11-01", "p: 2026-11-01 10:00:00Z", "q: 1:20",
        "r: '1.0'", "s: +12", "t: 0b101", "u: 1.", "base: &b {x: 1, y: 2}", "merged: {<<: *b, y: 3, z: 4}",
        "list: [1, '2', 3.5, false, NULL]", "",
    ])
    fast, pure = parse_yaml(doc), parse_yaml(doc, fast=False)
    assert _typed(fast) == _typed(pure)
    assert fast["e"] == 1e9 and isinstance(fast["e"], float)  # YAML 1.1 (PyYAML's default) reads a string
    assert fast["i"] == "yes" and fast["j"] == "on"  # YAML 1.1 reads booleans


def test_fast_loader_refuses_duplicate_keys_like_ruamel():
    from gpuprov.catalog import parse_yaml

    for fast in (True, False):
        with pytest.raises(Exception, match="duplicate key"):
            parse_yaml("gpus:\n  h100: 1\n  h100: 2\n", fast=fast)


# --------------------------------------------------------------------------- per-product features
def test_every_gpu_is_classified_for_gds_and_fabric_manager():
    from gpuprov.catalog.gpus import list_gpus

    data = load_data("software.yaml")
    supported, unsupported = set(data["gds"]["supported"]), set(data["gds"]["unsupported"])
    slugs = {g.slug for g in list_gpus()}
    assert supported | unsupported == slugs and not supported & unsupported
    assert "support-matrix" in data["gds"]["source"]
    for g in list_gpus():
        if "GeForce" in g.name:
            assert g.slug in unsupported, g.slug  # GDS: data center and professional GPUs only
    fm = set(data["fabric_manager"]["gpus"])
    assert fm <= slugs
    for slug in fm:  # NVSwitch boards carry SXM GPUs with all-to-all NVLink
        assert next(g for g in list_gpus() if g.slug == slug).nvlink_gbytes_per_s, slug


def test_every_nvswitch_machine_has_a_fabric_manager_gpu():
    from gpuprov.catalog.instances import list_instances

    fm = set(load_data("software.yaml")["fabric_manager"]["gpus"])
    for inst in list_instances():
        if inst.nvswitch:
            assert inst.gpu in fm, inst.name


@pytest.mark.parametrize("gpu,arch,gds", [
    ("rtx-4090-24gb", "ada", False), ("rtx-3090-24gb", "ampere", False), ("l40s-48gb", "ada", True),
    ("rtx-6000-ada-48gb", "ada", True), ("h100-80gb", "hopper", True), ("a10g-24gb", "ampere", True),
])
def test_gds_follows_the_product_not_the_architecture(gpu, arch, gds):
    sw = get_software(arch, "ethernet", nvswitch=False, gpu=gpu)
    assert sw.gds is gds and sw.fabric_manager is False
    assert f"GDS {'supported' if gds else 'not supported'} on {gpu}" in sw.source


def test_fabric_manager_only_for_nvswitch_boards_of_sxm_gpus():
    assert get_software("hopper", "infiniband", nvswitch=True, gpu="h100-80gb").fabric_manager is True
    assert get_software("hopper", "infiniband", nvswitch=False, gpu="h100-80gb").fabric_manager is False
    # a PCIe card never needs it, whatever the machine entry says
    assert get_software("hopper", "infiniband", nvswitch=True, gpu="h100-pcie-80gb").fabric_manager is False
    with pytest.raises(GpuprovError, match="not classified for GPUDirect Storage"):
        get_software("hopper", "infiniband", nvswitch=True, gpu="h999-1gb")


def test_catalog_trees_built_from_parser_events_are_the_loaders_trees():
    """catalog/yaml_events.py builds each catalog exactly as the loader does (types, key order, shared aliases), and
    hands every document it does not build to the loader, which then reads (or refuses) it as before."""
    import yaml

    from gpuprov.catalog import _fast_loader, parse_yaml, yaml_events
    from gpuprov.resources import catalog_data_dir

    loader = _fast_loader()
    for path in sorted(catalog_data_dir().glob("*.yaml")):
        text = path.read_text(encoding="utf-8")
        assert _typed(yaml_events.load(text, loader)) == _typed(yaml.load(text, Loader=loader)), path.name
    built = ["", "7", "a: 017\nb: 0x1F\nc: 1_000\nd: 1.0e9\ne: -.inf\nf: .nan\ng: yes\nh: True\ni: ~\nj:\nk: '1.0'\n"
             "l: +12\nm: 0b101\nn: 1.\no: 1:20\np: null\nq: '<<'\n",
             "base: &b {x: 1, y: 2}\nmerged: {<<: *b, y: 3, z: 4}\nagain: *b\n",
             "s: &s text\nt: [*s, &l [1, 2], *l]\nu: {k: *l}\n", "- {a: 1}\n- [b, 'c', \"d\"]\n- !\n"]
    for doc in built[:-1]:
        tree = yaml_events.load(doc, loader)
        assert _typed(tree) == _typed(yaml.load(doc, Loader=loader)), doc
    tree = yaml_events.load(built[3], loader)
    assert tree["merged"] == {"x": 1, "y": 3, "z": 4} and list(tree["merged"]) == ["x", "y", "z"]
    assert tree["again"] is tree["base"]
    unbuilt = [built[-1], "o: 2026-11-01\n", "a: !!str 1\n", "a: 1\na: 2\n", "? [1]\n: 2\n", "1: a\n01: b\n",
               "a: &a {x: 1}\nb: &b {y: 2}\nc: {<<: [*a, *b]}\n", "a: &a {x: 1}\nb: &b {<<: *a, y: 2}\nc: {<<: *b}\n",
               "a: 1\n---\nb: 2\n", "a: &x 1\nb: &x 2\n", "a: <<\n", "a: [1\n", "a: *nowhere\n"]
    for doc in unbuilt:
        with pytest.raises(yaml_events.Unbuilt):
            yaml_events.load(doc, loader)
        try:
            expected: object = _typed(yaml.load(doc, Loader=loader))
        except yaml.YAMLError as exc:
            expected = type(exc)
        try:
            got: object = _typed(parse_yaml(doc))
        except yaml.YAMLError as exc:
            got = type(exc)
        assert got == expected, doc
