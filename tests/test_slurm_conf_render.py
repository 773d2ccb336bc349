"""slurm.conf as the role renders it from a bundle's own group_vars and each cloud's inventory, in
the shape its Terraform output evaluates to (tests/test_terraform_render.py
test_ansible_inventory_output_shape): ansible_host is how Ansible reaches a node (an instance id over
SSM, a VM name over IAP, a public address with ssh_cidr), private_ip the address inside the network.
The real ansible-playbook renders the role's template with `--limit` on a node that is not the
controller, so no other host's facts exist (a replaced node joining a running cluster)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from ansible_helpers import REPO, playbook, private_dir, write_files
from gpuprov.render.ansible import render_ansible
from plan_fixtures import sample_plan

pytestmark = pytest.mark.slow

# host -> hostvars as `terraform output -json ansible_inventory` gives them (see the docstring)
SHAPES = {
    "aws": {"n-00": {"ansible_host": "i-0a", "private_ip": "10.0.0.5"},
            "n-01": {"ansible_host": "i-0b", "private_ip": "10.0.0.6"}},
    "gcp": {"n-00": {"ansible_host": "n-00", "private_ip": "10.0.0.5"},
            "n-01": {"ansible_host": "n-01", "private_ip": "10.0.0.6"}},
    "azure-ssh": {"n-00": {"ansible_host": "198.51.100.5", "private_ip": "10.0.0.5"},
                  "n-01": {"ansible_host": "198.51.100.6", "private_ip": "10.0.0.6"}},
    "oci-ssh": {"x-node-00": {"ansible_host": "198.51.100.5", "private_ip": "10.0.0.5"},
                "x-node-01": {"ansible_host": "198.51.100.6", "private_ip": "10.0.0.6"}},
}


def _render(cloud: str, hosts: dict, limit: str, os_id: str = "ubuntu-22.04", etc_hosts: str = "") -> tuple[str, dict]:
    plan = sample_plan(cloud, nodes=len(hosts))
    files = render_ansible(plan)
    # this machine stands in for a node of the image's OS (the role picks the plan's build by it)
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, "slurm_os_id": os_id}
    # the role's defaults, below the bundle's group_vars/all.yml as in a real run (inventory-file vars)
    defaults = yaml.safe_load((REPO / "ansible/roles/slurm/defaults/main.yml").read_text())
    inventory = {"all": {"vars": defaults,
                         "children": {"gpu_nodes": {"hosts": {n: {**v, **local} for n, v in hosts.items()}}}}}
    with private_dir("slurm-conf") as root:
        write_files(root, files)
        (root / "inventory.yml").write_text(json.dumps(inventory))
        if etc_hosts:
            (root / "hosts").write_text(etc_hosts)
        (root / "ansible.cfg").write_text("[defaults]\nroles_path = roles\n")
        (root / "play.yml").write_text(yaml.safe_dump([{
            "name": "render", "hosts": "gpu_nodes", "gather_facts": True,
            "tasks": [
                {"name": "controller", "ansible.builtin.set_fact": {
                    "slurm_controller_host": "{{ groups['gpu_nodes'][0] }}"}},
                {"name": "build", "ansible.builtin.include_role": {"name": "slurm", "tasks_from": "build.yml"}},
                {"name": "hosts", "ansible.builtin.include_role": {"name": "slurm", "tasks_from": "hosts.yml"},
                 "vars": {"slurm_hosts_file": str(root / "hosts"), "slurm_cloud_init_dir": str(root / "cloud")}},
                {"name": "slurm.conf", "ansible.builtin.template": {
                    "src": "roles/slurm/templates/slurm.conf.j2", "dest": str(root / "out-{{ inventory_hostname }}.conf")}},
                {"name": "cgroup.conf", "ansible.builtin.template": {
                    "src": "roles/slurm/templates/cgroup.conf.j2", "dest": str(root / "cgroup.conf")}},
            ]}], sort_keys=False))
        proc = playbook(root, "-i", "inventory.yml", "--limit", limit, "play.yml")
        assert proc.returncode == 0, proc.stdout[-3000:]
        conf = (root / f"out-{limit}.conf").read_text()
        conf += "\n#CGROUP\n" + (root / "cgroup.conf").read_text()
        conf += "\n#HOSTS\n" + (root / "hosts").read_text()
    return conf, yaml.safe_load(files["group_vars/all.yml"])


def _fields(line: str) -> dict[str, str]:
    return dict(f.split("=", 1) for f in line.split())


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_slurm_conf_addresses_are_private_and_render_under_limit(shape):
    hosts = SHAPES[shape]
    names = list(hosts)
    conf, group_vars = _render(shape.split("-")[0], hosts, limit=names[1])
    ctl = next(ln for ln in conf.splitlines() if ln.startswith("SlurmctldHost="))
    assert ctl == f"SlurmctldHost={names[0]}({hosts[names[0]]['private_ip']})"
    nodes = [_fields(ln) for ln in conf.splitlines() if ln.startswith("NodeName=")]
    assert [(n["NodeName"], n["NodeAddr"]) for n in nodes] == [(n, hosts[n]["private_ip"]) for n in names]
    # job records and controller state on the shared filesystem (a replaced first node keeps them),
    # the periodic node health check (item: Slurm forgets jobs and sick nodes)
    lines = dict(ln.split("=", 1) for ln in conf.split("#CGROUP")[0].splitlines() if ln[:1].isupper() and "=" in ln)
    assert lines["JobCompType"] == "jobcomp/filetxt" and lines["JobCompLoc"] == group_vars["slurm_jobcomp_loc"]
    assert lines["StateSaveLocation"].startswith("/shared/") and lines["JobCompLoc"].startswith(lines["StateSaveLocation"])
    assert lines["HealthCheckProgram"].endswith("/node-health.sh") and int(lines["HealthCheckInterval"]) > 0
    # neither an instance id nor a public address reaches slurm.conf or the nodes' host entries
    assert "i-0" not in conf and "198.51.100." not in conf
    entries = [ln.split() for ln in conf.split("#HOSTS")[1].splitlines() if ln and not ln.startswith("#")]
    assert entries == [[hosts[n]["private_ip"], n] for n in names]
    # every node's size is the plan's, the same on every node whatever facts this host has
    assert {(n["CPUs"], n["RealMemory"]) for n in nodes} == {
        (str(group_vars["slurm_node_cpus"]), str(group_vars["slurm_node_real_memory_mb"]))}


# /etc/hosts as Ubuntu's installer writes it (subiquity HOSTS_CONTENT), on the site's host n-01
INSTALLED_HOSTS = "127.0.0.1 localhost\n127.0.1.1 n-01\n127.0.1.1 n-010 printer\n\n::1     ip6-localhost ip6-loopback\n"


def test_a_site_hosts_own_name_resolves_to_its_address_not_the_installers_loopback():
    """On-prem hosts keep their names and /etc/hosts: the installer's `127.0.1.1 NAME` came first, so
    `hostname --ip-address` (the rendezvous) and gloo bound and advertised 127.0.1.1 to the other node.
    The role drops that line (and only that one) and lists every node's private address on-prem too."""
    hosts = {"n-00": {"ansible_host": "10.20.0.10", "private_ip": "10.20.0.10"},
             "n-01": {"ansible_host": "10.20.0.11", "private_ip": "10.20.0.11"}}
    conf, group_vars = _render("onprem", hosts, limit="n-01", etc_hosts=INSTALLED_HOSTS)
    lines = [ln.split() for ln in conf.split("#HOSTS\n")[1].splitlines() if ln.strip() and not ln.startswith("#")]
    resolves = next(ln[0] for ln in lines if "n-01" in ln[1:])  # the first match, as glibc's files lookup
    assert resolves == "10.20.0.11", lines
    assert ["127.0.1.1", "n-010", "printer"] in lines and ["127.0.0.1", "localhost"] in lines
    # the nodes' entries are written on-prem too (the role's default; the bundle does not turn them off)
    defaults = yaml.safe_load((REPO / "ansible/roles/slurm/defaults/main.yml").read_text())
    assert defaults["slurm_hosts_entries"] is True and "slurm_hosts_entries" not in group_vars
    assert group_vars["slurm_set_hostname"] is False


@pytest.mark.parametrize("cloud", ["aws", "gcp", "oci", "azure"])
def test_cgroup_settings_are_the_ones_the_images_slurm_supports(cloud):
    """Ubuntu 22.04's slurm-wlm 21.08 has no cgroup/v2 plugin and 22.04 boots cgroup v2: no cgroup
    plugin in slurm.conf or cgroup.conf there; Microsoft's slurm-smd (>= 22.05) on Azure: cgroup/v2."""
    from gpuprov.catalog import load_data

    hosts = SHAPES["aws"]
    conf, group_vars = _render(cloud, hosts, limit="n-00")
    (build,) = group_vars["slurm_builds"].values()
    version = tuple(int(x) for x in build["version"].split(".")[:2])
    catalog = load_data("scheduler.yaml")["slurm"]["builds"][build["name"]]
    assert catalog["version"] == build["version"]
    text, cgroup = conf.split("#HOSTS")[0].split("#CGROUP")
    lines = dict(ln.split("=", 1) for ln in text.splitlines() if "=" in ln and not ln.startswith("#"))
    cg = dict(ln.split("=", 1) for ln in cgroup.splitlines() if "=" in ln and not ln.startswith("#"))
    if version < (22, 5):
        assert lines["ProctrackType"] == "proctrack/linuxproc" and "cgroup" not in lines["TaskPlugin"]
        assert "CgroupPlugin" not in cg
    else:
        assert lines["ProctrackType"] == "proctrack/cgroup" and cg["CgroupPlugin"] == "cgroup/v2"
    assert (cloud == "azure") == build["name"].startswith("microsoft-smd")
