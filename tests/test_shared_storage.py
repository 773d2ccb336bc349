"""Shared storage for multi-node checkpoints: the plan sizes it from the catalog, site.yml mounts it
with the shared_storage role, and the role refuses a wrong mount description before it changes
anything (ansible-playbook, connection local, check mode)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ansible_helpers import ANSIBLE_PLAYBOOK, playbook, private_dir, recap, write_files, write_local_inventory
from gpuprov.catalog import bringup as cat
from gpuprov.plan import SHARED_MOUNT
from gpuprov.render.ansible import render_ansible
from plan_fixtures import sample_plan

pytestmark = pytest.mark.skipif(not ANSIBLE_PLAYBOOK.exists(), reason="ansible-playbook not installed")


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure", "oci"])
def test_multi_node_plans_get_shared_storage_sized_from_the_catalog(cloud):
    plan = sample_plan(cloud, nodes=4)
    entry = cat.shared_storage(cloud)
    shared = plan.shared_storage
    assert shared is not None and shared.kind == entry["kind"]
    assert shared.mount_point == SHARED_MOUNT and shared.checkpoint_dir == f"{SHARED_MOUNT}/checkpoints"
    need = plan.host.checkpoint_bytes * plan.host.checkpoints_kept
    assert shared.need_bytes >= need
    if entry["step_gib"]:
        assert shared.size_gib * 2**30 >= shared.need_bytes and shared.size_gib >= entry["min_gib"]
    assert sample_plan(cloud, nodes=1).shared_storage is None  # one node: optional, not created


@pytest.mark.parametrize("need_gib, want", [(1, 1200), (1200, 1200), (1201, 2400), (2401, 4800), (9000, 9600)])
def test_fsx_sizes_follow_the_lustre_steps(need_gib, want):
    assert cat.shared_size_gib(cat.shared_storage("aws"), need_gib * 2**30) == want


@pytest.mark.parametrize("need_gib, want", [(1, 1024), (1025, 1280), (2000, 2048)])
def test_filestore_sizes_follow_the_zonal_steps(need_gib, want):
    assert cat.shared_size_gib(cat.shared_storage("gcp"), need_gib * 2**30) == want


def test_site_mounts_shared_storage_on_multi_node_plans_only():
    multi = yaml.safe_load(render_ansible(sample_plan("aws", nodes=2))["site.yml"])
    assert any(r.get("role") == "shared_storage" for play in multi for r in play.get("roles", []))
    single = yaml.safe_load(render_ansible(sample_plan("aws", nodes=1))["site.yml"])
    assert not any(r.get("role") == "shared_storage" for play in single for r in play.get("roles", []))


def _run(root, mount):
    (root / "shared.yml").write_text(yaml.safe_dump([{
        "name": "shared", "hosts": "gpu_nodes", "gather_facts": False,
        "roles": [{"role": "shared_storage"}]}]))
    return playbook(root, "-i", "local-inventory.yml", "shared.yml", "--check",
                    extra_vars={"shared_storage_mount": mount})


@pytest.mark.slow
def test_role_does_nothing_without_a_filesystem_and_refuses_a_bad_one():
    with private_dir("shared") as root:
        write_files(root, render_ansible(sample_plan("aws", nodes=2)))
        write_local_inventory(root)
        nothing = _run(root, None)
        assert nothing.returncode == 0, nothing.stdout[-2000:]
        assert recap(nothing.stdout)["changed"] == 0
        bad = _run(root, {"fstype": "ext4", "source": "x", "mount_point": "/shared", "options": "rw"})
        assert bad.returncode != 0
        assert "shared_storage_mount must be" in bad.stdout
        assert recap(bad.stdout)["changed"] == 0
        if not Path("/sbin/mount.lustre").exists():  # Azure's case: the client must come with the image
            lustre = _run(root, {"fstype": "lustre", "client": "image", "source": "10.0.0.4@tcp:/lustrefs",
                                 "mount_point": "/shared", "options": "noatime,flock"})
            assert lustre.returncode != 0 and "/sbin/mount.lustre is missing" in lustre.stdout
            assert recap(lustre.stdout)["changed"] == 0
