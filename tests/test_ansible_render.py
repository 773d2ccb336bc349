"""render_ansible: glue from the plan, roles copied verbatim; real ansible-playbook --syntax-check
and ansible-lint --profile production on the rendered bundles (sample plans and planner plans)."""

from __future__ import annotations


import pytest
import yaml

from ansible_helpers import REPO, playbook, private_dir, write_files
from gpuprov.errors import GpuprovError
from gpuprov.render.ansible import GLUE, fabric_role, render_ansible
from gpuprov.targets.decide import decided
from plan_fixtures import sample_plan
from production_lint import production_lint

CLOUDS = ("aws", "gcp", "azure", "oci", "onprem")
EXPECTED_FABRIC_ROLE = {"aws": "efa", "gcp": "gcp_rdma", "azure": "infiniband", "oci": "infiniband",
                        "onprem": "infiniband"}


def _roles_in(site: list) -> list[str]:
    return [r["role"] for play in site if "roles" in play for r in play["roles"]]


def _tags(site: list) -> dict[str, list[str]]:
    return {r["role"]: r["tags"] for play in site if "roles" in play for r in play["roles"]}


@pytest.mark.parametrize("cloud", CLOUDS)
def test_glue_carries_the_plan(cloud):
    plan = sample_plan(cloud)
    files = render_ansible(plan)
    for name in GLUE:
        assert name in files
    site = yaml.safe_load(files["site.yml"])
    assert all(play.get("hosts", "gpu_nodes") in ("gpu_nodes", "gpu_nodes[0]") for play in site)  # [0]: job staging
    roles = _roles_in(site)
    # two nodes: the shared filesystem for checkpoints is mounted too (test_shared_storage.py)
    fabric = EXPECTED_FABRIC_ROLE[cloud]
    middle = [fabric, "nvidia_driver", fabric] if fabric == "infiniband" else ["nvidia_driver", fabric]
    # two nodes: Slurm on every node (plan.scheduler; test_scheduler.py)
    assert roles == ["gpu_preflight", "node_baseline", "nvme_raid", "shared_storage", *middle, "nccl", "gds",
                     "training_env", "slurm"]
    tags = _tags(site)
    assert tags["gpu_preflight"] == ["always"] and tags["node_baseline"] == ["baseline"]
    assert tags["nvme_raid"] == ["storage"] and tags["nvidia_driver"] == ["gpu"] and tags["training_env"] == ["train"]
    assert tags[EXPECTED_FABRIC_ROLE[cloud]] == ["fabric"] and tags["nccl"] == ["nccl"] and tags["gds"] == ["gds"]
    assert site[-1] == {"name": "Health check", "ansible.builtin.import_playbook": "health.yml", "tags": ["health"]}
    health = yaml.safe_load(files["health.yml"])
    assert health[0]["roles"] == [{"role": "healthcheck", "tags": ["health", "hardware"]}]
    if plan.scheduler.kind == "slurm":  # the Slurm check (it resumes joining nodes) runs without the hardware's
        assert health[1]["tasks"][0]["tags"] == ["health"]

    gv = yaml.safe_load(files["group_vars/all.yml"])
    assert gv["nvidia_driver_branch"] == plan.software.driver_branch
    assert gv["nvidia_driver_open_kernel_modules"] is plan.software.open_kernel_modules
    assert gv["nvidia_driver_fabric_manager"] is plan.software.fabric_manager
    assert gv["nvidia_driver_gpu_architecture"] == plan.gpu.architecture
    assert gv["gpu_preflight_supported_os"] == plan.software.os
    assert gv["nccl_version"] == plan.software.nccl_version and gv["nccl_cuda_version"] == plan.software.cuda_version
    assert gv["nccl_env"] == plan.fabric.nccl_env
    assert gv["nccl_env_profile"] == (plan.fabric.nccl_env_profile or "")
    assert gv["nvme_raid_name"] == plan.storage.raid_name
    assert gv["nvme_raid_mount_point"] == plan.storage.mount_point == gv["gds_mount_point"] == gv["healthcheck_mount_point"]
    assert gv["nvme_raid_device_glob"] == (plan.storage.device_glob or "")
    assert gv["nvme_raid_expected_devices"] == plan.storage.devices
    assert gv["nvme_raid_force"] is False and gv["nvme_raid_update_initramfs"] is True
    assert gv["healthcheck_expected_gpus"] == plan.cluster.gpus_per_node
    assert gv["healthcheck_nccl_busbw_min_gbytes_per_s"] == plan.health.nccl_allreduce_busbw_gbytes_per_s
    assert gv["healthcheck_expected_bytes"] == plan.storage.expected_bytes
    assert gv["healthcheck_fabric"] == plan.fabric.name
    if cloud == "aws":
        assert gv["efa_installer_version"] == plan.software.efa_installer_version
        assert gv["efa_expected_devices"] == plan.instance.efa_interfaces == 32
    if cloud == "gcp":
        assert gv["gcp_rdma_mode"] == "tcpxo" and gv["gcp_rdma_mtu"] == 8896
    if cloud in ("azure", "oci", "onprem"):
        assert gv["infiniband_subnet_manager"] == plan.fabric.subnet_manager
        assert gv["infiniband_hcas"] == plan.fabric.hcas

    if cloud == "onprem":
        inventory = yaml.safe_load(files["inventory.yml"])
        hosts = inventory["all"]["children"]["gpu_nodes"]["hosts"]
        # the SSH port is always named: the host's own, or ssh's 22 (a connection path ansible-inventory shows)
        # and the address Slurm uses (private_ip, as every cloud's inventory carries it)
        assert hosts == {h.name: {"ansible_host": h.address, "private_ip": h.address, "ansible_port": h.port or 22}
                         for h in plan.hosts}
    else:
        assert "inventory.yml" not in files  # clouds: `gpuprov up` writes it from Terraform


def test_roles_are_copied_verbatim():
    files = render_ansible(sample_plan("aws"))
    repo_roles = {f"roles/{p.relative_to(REPO / 'ansible' / 'roles').as_posix()}": p.read_text()
                  for p in (REPO / "ansible" / "roles").rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".pyc")}
    copied = {k: v for k, v in files.items() if k.startswith("roles/")}
    assert copied == repo_roles
    for role in ("nvidia_driver", "nccl", "efa", "infiniband", "gcp_rdma", "gds", "healthcheck",
                 "gpu_preflight", "nvme_raid"):
        assert f"roles/{role}/tasks/main.yml" in copied


def test_single_node_and_no_local_nvme():
    plan = sample_plan("aws", nodes=1)
    plan = decided(plan.model_copy(update={
        "fabric": plan.fabric.model_copy(update={"name": "none", "nccl_env": {}}),
        "storage": plan.storage.model_copy(update={"devices": 0, "expected_bytes": 0})}))
    files = render_ansible(plan)
    site = yaml.safe_load(files["site.yml"])
    assert _roles_in(site) == ["gpu_preflight", "node_baseline", "nvidia_driver", "nccl", "training_env"]  # no fabric, RAID, GDS
    gv = yaml.safe_load(files["group_vars/all.yml"])
    assert "nvme_raid_name" not in gv and gv["healthcheck_mount_point"] == "" and gv["healthcheck_gds"] is False


def test_onprem_inventory_names_the_hosts_left_out():
    from gpuprov.spec import HostEntry

    plan = sample_plan("onprem", nodes=2)
    listed = [HostEntry(name=f"gpu{i}", address=f"10.0.0.{10 + i}") for i in range(4)]
    plan = plan.model_copy(update={"spec": plan.spec.model_copy(update={"hosts": listed})})
    text = render_ansible(plan)["inventory.yml"]
    inventory = yaml.safe_load(text)
    assert list(inventory["all"]["children"]["gpu_nodes"]["hosts"]) == ["gpu0", "gpu1"]  # only the plan's nodes
    assert "# Left out of this plan (2 of the 4 hosts listed run it" in text
    assert "#   gpu2: 10.0.0.12\n#   gpu3: 10.0.0.13\n" in text
    assert "Left out" not in render_ansible(sample_plan("onprem", nodes=2))["inventory.yml"]


@pytest.mark.parametrize("gpu,gds", [("rtx-4090-24gb", False), ("h100-80gb", True)])
def test_onprem_gds_follows_the_gpu_product(gpu, gds):
    """GDS supports data center and professional GPUs only: gdscheck fails on a GeForce card."""
    from gpuprov.planner import make_plan
    from gpuprov.spec import HostEntry, TrainingSpec

    # the host states its NVMe drives (a host stating nothing has none the plan knows of: no GDS)
    plan = make_plan(TrainingSpec(model="llama-3.2-1b", task="lora", tokens=10**8, cloud="onprem", gpus=[gpu],
                                  hosts=[HostEntry(name="gpu0", address="10.0.0.1", gpu=gpu, gpus=8, nvme_count=2,
                                                   nvme_gb_each=3840)]))
    assert plan.gpu.slug == gpu and plan.storage.devices > 0 and plan.software.gds is gds
    files = render_ansible(plan)
    gv = yaml.safe_load(files["group_vars/all.yml"])
    assert gv["healthcheck_gds"] is gds
    assert ("gds_cuda_version" in gv) is gds and ("gds_mount_point" in gv) is gds
    assert ("gds" in _roles_in(yaml.safe_load(files["site.yml"]))) is gds


def test_ansible_cfg_gathers_facts_once_per_run_without_a_cache():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read_string(render_ansible(sample_plan("aws"))["ansible.cfg"])
    assert cfg["defaults"]["gathering"] == "smart"
    assert cfg["defaults"].get("fact_caching", "memory") == "memory"  # nothing persists between runs


def test_sample_plans_carry_the_catalog_fabric():
    """The fixtures' fabric is the catalog's (OCI cluster networks are RoCE, not InfiniBand)."""
    from gpuprov.catalog.fabrics import fabric_name_for

    for cloud in CLOUDS:
        plan = sample_plan(cloud)
        assert plan.fabric.name == fabric_name_for(cloud, plan.instance.name), cloud
    oci = sample_plan("oci")
    assert oci.fabric.name == "roce" and oci.fabric.nccl_env["NCCL_IB_TC"] == "41" and len(oci.fabric.hcas) == 16
    assert fabric_role(oci) == "infiniband"  # the RDMA role serves RoCE HCAs too


def test_onprem_without_hosts_is_a_clear_error():
    plan = sample_plan("onprem").model_copy(update={"hosts": None})
    with pytest.raises(GpuprovError, match="on-prem plan needs hosts"):
        render_ansible(plan)


def test_tcpxo_outside_gcp_is_rejected():
    plan = sample_plan("aws")
    plan = plan.model_copy(update={"fabric": plan.fabric.model_copy(update={"name": "tcpxo"})})
    with pytest.raises(GpuprovError, match="tcpxo exists only on GCP"):
        decided(plan)


@pytest.mark.parametrize("missing", ["provisioning", "infra"])
def test_renderers_refuse_a_plan_without_the_targets_decisions(missing):
    """A plan.json written before the target recorded its decisions: every renderer that reads them
    refuses it with one line, none recomputes them."""
    from gpuprov.render.launch import render_launch
    from gpuprov.render.terraform import render_terraform

    plan = sample_plan("aws").model_copy(update={missing: None})
    renderers = {"provisioning": (render_ansible, render_launch, render_terraform), "infra": (render_terraform,)}
    for render in renderers[missing]:
        with pytest.raises(GpuprovError, match="run `gpuprov plan` again"):
            render(plan)


def test_values_with_yaml_specials_stay_strings():
    plan = sample_plan("oci")
    odd = {"NCCL_IB_HCA": "=mlx5_0,mlx5_1", "NCCL_X": "yes", "NCCL_Y": "0x10: {a}", "NCCL_Z": "it's # not a comment"}
    plan = plan.model_copy(update={"fabric": plan.fabric.model_copy(update={"nccl_env": odd, "source": "line1\nline2"})})
    gv = yaml.safe_load(render_ansible(plan)["group_vars/all.yml"])
    assert gv["nccl_env"] == odd


def _syntax_check(bundle, playbook_name="site.yml"):
    (bundle / "inventory.yml").exists() or (bundle / "inventory.yml").write_text(
        "all:\n  children:\n    gpu_nodes:\n      hosts:\n        node0:\n          ansible_host: 127.0.0.1\n")
    return playbook(bundle, "--syntax-check", "-i", "inventory.yml", playbook_name)


@pytest.fixture
def workdir():
    with private_dir("render") as path:
        yield path


@pytest.mark.parametrize("cloud", CLOUDS)
def test_syntax_check_sample_plans(workdir, cloud):
    bundle = write_files(workdir / cloud, render_ansible(sample_plan(cloud)))
    result = _syntax_check(bundle)  # site.yml imports health.yml, so both are checked
    assert result.returncode == 0, result.stdout[-2000:]
    assert "playbook: site.yml" in result.stdout


@pytest.fixture(scope="module")
def planner_plans():
    from gpuprov import planner
    from gpuprov.spec import TrainingSpec

    plans = {}
    for cloud in ("aws", "gcp", "azure", "oci"):
        plans[cloud] = planner.make_plan(TrainingSpec(model="70b", cloud=cloud, tokens=2 * 10**10,
                                                      objective="time", max_nodes=4))
    return plans


@pytest.mark.slow
def test_planner_plans_render_and_pass_syntax_check(workdir, planner_plans):
    for cloud, plan in planner_plans.items():
        files = render_ansible(plan)
        site = yaml.safe_load(files["site.yml"])
        gv = yaml.safe_load(files["group_vars/all.yml"])
        assert gv["nccl_env"] == plan.fabric.nccl_env
        if plan.cluster.nodes > 1:
            assert fabric_role(plan) in _roles_in(site)
        if plan.fabric.name == "efa":
            assert gv["nccl_env"] == {"FI_EFA_USE_HUGE_PAGE": "0"}
        bundle = write_files(workdir / cloud, files)
        result = _syntax_check(bundle)
        assert result.returncode == 0, f"{cloud}: {result.stdout[-2000:]}"


@pytest.mark.slow
def test_rendered_bundles_pass_ansible_lint_production():
    """The glue of a bundle per target and of every example, linted in the suite's one run with
    the roles every bundle copies (tests/production_lint.py)."""
    lint = production_lint()
    assert {g.parent.name for g in lint.glue if g.name == "site.yml"} == set(CLOUDS)
    assert any("examples" in g.parts for g in lint.glue)
    assert set(lint.glue) <= lint.examined, lint.output[-4000:]
    assert lint.issues_in(list(lint.glue)) == []
    assert lint.returncode == 0 and not lint.issues, lint.output[-4000:]
    assert "Profile 'production' was required, and it passed" in lint.output
