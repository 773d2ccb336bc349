"""The stand-in facts the rehearsal adds to a recorded `terraform output` (tests/data/terraform_output/,
held to the modules by tests/test_journey.py) agree with that output and with the bundle the
rehearsal generates: one hostname per recorded node, named as the cloud names it from the
recorded private address; the image profile and GPU count the bundle's plan decided."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys

import pytest
import yaml

from gpuprov.catalog import images
from gpuprov.catalog.instances import get_instance
from rehearsal import cluster


@pytest.mark.parametrize("name", ["aws", "aws-g5"])
def test_standin_facts_agree_with_the_recorded_output_and_the_bundle(tmp_path, name):
    recorded = cluster.fixture(name)
    cloud = recorded["cloud"]
    assert recorded["source"] and recorded["recorded"]
    outputs = recorded["outputs"]
    hosts = outputs["ansible_inventory"]["value"]["all"]["children"]["gpu_nodes"]["hosts"]
    assert list(recorded["hostnames"]) == list(hosts)
    if cloud == "aws":  # EC2's IP-based hostname, what slurmd registers as
        assert recorded["hostnames"] == {n: "ip-" + h["private_ip"].replace(".", "-") for n, h in hosts.items()}
        network = ipaddress.ip_network(f"{next(iter(hosts.values()))['private_ip']}/{recorded['subnet_prefix']}",
                                       strict=False)
        assert all(ipaddress.ip_address(h["private_ip"]) in network for h in hosts.values())

    out = tmp_path / "bundle"
    subprocess.run([sys.executable, "-m", "gpuprov", "generate", *recorded["generate"], "-o", str(out)], check=True,
                   capture_output=True, timeout=120, cwd=cluster.REPO)
    plan = json.loads((out / "plan.json").read_text())
    group_vars = yaml.safe_load((out / "ansible" / "group_vars" / "all.yml").read_text())
    assert plan["cluster"]["cloud"] == cloud and plan["cluster"]["nodes"] == len(hosts)
    assert group_vars["gpuprov_image_profile"] == recorded["image"]["profile"]
    assert plan["cluster"]["gpus_per_node"] == recorded["gpus_per_node"]
    assert group_vars["slurm_gpus_per_node"] == recorded["gpus_per_node"]
    # the guest is booted with the instance's vCPUs and memory: they are the catalog's for the planned type
    instance = get_instance(plan["instance"]["name"])
    assert plan["instance"]["name"] == recorded["instance_type"]
    assert (recorded["vcpus"], recorded["memory_mib"] * 2**20) == (instance.vcpus, instance.ram_bytes)
    assert recorded["gpus_per_node"] == instance.gpus
    assert images.profile(group_vars["gpuprov_image_profile"])["driver"]["version"] == recorded["image"]["driver_version"]
