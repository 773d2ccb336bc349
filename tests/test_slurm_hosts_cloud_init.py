"""The slurm role's node list in the hosts file survives a reboot under cloud-init.

cloud-init's update_etc_hosts runs at every boot (canonical/cloud-init
cloudinit/config/cc_update_etc_hosts.py@04eacd0): manage_etc_hosts true/template renders the whole
file from templates/hosts.debian.tmpl (`127.0.1.1 {{fqdn}} {{hostname}}` first, no node list),
`localhost` puts the 127.0.1.1 line back. The role drops a cloud.cfg.d file turning it off, exactly
where cloud-init's own configuration turns it on: cloud.cfg, then cloud.cfg.d/*.cfg in name order, a
later file winning (util.read_conf_with_confd); the instance's user-data/vendor-data cloud-config
outranks them (helpers.ConfigMerger._read_cfg), so there the play fails with the reason. Each host of
one real ansible-playbook run is one image's cloud-init configuration in its own folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ansible_helpers import playbook, private_dir, recap
from gpuprov.catalog import images

DROPIN = "99-gpuprov-hosts.cfg"
# Debian 12's cloud-init, unpacked by .ci/setup.d/35-cloud-init.sh
CLOUD_INIT_TREE = Path(os.environ.get("GPUPROV_CLOUD_INIT_TREE", "/var/tmp/gpuprov-cloud-init"))
BOOT = Path(__file__).with_name("cloud_init_boot.py")

# host -> ({file under the host's folder: text}, the manage_etc_hosts cloud-init ends up with, outcome);
# etc/cloud stands for /etc/cloud, instance/ for /var/lib/cloud/instance. Outcome "write": the play
# writes the drop-in; "none": nothing; "fail": the play stops, as no drop-in can keep the file.
CASES = {
    "no-cloud-init": ({}, "absent", "none"),
    # Ubuntu's cloud.cfg runs update_etc_hosts but does not set manage_etc_hosts (default false)
    "unset": ({"etc/cloud/cloud.cfg": "cloud_init_modules:\n  - update_etc_hosts\n",
               "etc/cloud/cloud.cfg.d/90_dpkg.cfg": "datasource_list: [Ec2, None]\n"}, None, "none"),
    "true-in-dropin": ({"etc/cloud/cloud.cfg": "users: [default]\n",
                       "etc/cloud/cloud.cfg.d/50-image.cfg": "manage_etc_hosts: true\n"}, True, "write"),
    "localhost-mode": ({"etc/cloud/cloud.cfg": "manage_etc_hosts: localhost\n",
                        "etc/cloud/cloud.cfg.d/.keep": ""}, "localhost", "write"),
    "template": ({"etc/cloud/cloud.cfg": "manage_etc_hosts: template\n",
                  "etc/cloud/cloud.cfg.d/10.cfg": "# nothing\n"}, "template", "write"),
    # YAML 1.1 `yes` is true to cloud-init's loader too
    "yes": ({"etc/cloud/cloud.cfg.d/20-site.cfg": "manage_etc_hosts: yes\n"}, True, "write"),
    "turned-off-later": ({"etc/cloud/cloud.cfg": "manage_etc_hosts: true\n",
                          "etc/cloud/cloud.cfg.d/95-site.cfg": "manage_etc_hosts: false\n"}, False, "none"),
    # not *.cfg: cloud-init does not read it
    "not-a-cfg": ({"etc/cloud/cloud.cfg.d/50-image.cfg.disabled": "manage_etc_hosts: true\n"}, None, "none"),
    "after-the-dropin": ({"etc/cloud/cloud.cfg.d/99-zz-site.cfg": "manage_etc_hosts: true\n"}, True, "fail"),
    "user-data": ({"etc/cloud/cloud.cfg.d/.keep": "",
                   "instance/cloud-config.txt": "#cloud-config\nmanage_etc_hosts: localhost\n"}, "localhost", "fail"),
    "user-data-off": ({"etc/cloud/cloud.cfg.d/50-image.cfg": "manage_etc_hosts: true\n",
                       "instance/cloud-config.txt": "#cloud-config\nmanage_etc_hosts: false\n",
                       "instance/vendor-cloud-config.txt": "#cloud-config\nmanage_etc_hosts: true\n"}, False, "none"),
}


@pytest.mark.parametrize("profile", sorted(images.profiles()))
def test_every_setting_an_image_may_boot_with_is_played_below(profile):
    """The catalog's fact per image profile, or every value where it is uncertain, is a case of the
    play below, written by the image itself (not user-data) and expected as cloud-init takes it."""
    image_cases = {name: (value, want) for name, (files, value, want) in CASES.items()
                   if not any(f.startswith("instance/") for f in files) and want != "fail"}
    for value in images.manage_etc_hosts(profile):
        want = "write" if str(value).lower() in ("true", "localhost", "template") else "none"
        assert any(v == value and type(v) is type(value) and w == want for v, w in image_cases.values()), value


def _first_address(hosts: str, name: str) -> str:
    """The address glibc's files lookup gives NAME: the first line naming it."""
    return next(ln.split()[0] for ln in hosts.splitlines() if name in ln.split("#")[0].split()[1:])


def _boot(home: Path, name: str) -> str:
    """One boot of cloud-init's update_etc_hosts by its own code; the manage_etc_hosts it merged."""
    proc = subprocess.run([sys.executable, str(BOOT), str(CLOUD_INIT_TREE), str(home), name],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])["manage_etc_hosts"]


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.skipif(not (CLOUD_INIT_TREE / "usr/lib/python3/dist-packages/cloudinit").is_dir(),
                    reason=f"no cloud-init unpacked at {CLOUD_INIT_TREE} (.ci/setup.d/35-cloud-init.sh)")
def test_cloud_init_is_told_to_keep_the_node_list_exactly_where_it_would_rewrite_it():
    with private_dir("cloud-init-hosts") as root:
        hostvars = {}
        for i, (name, (files, _, _)) in enumerate(CASES.items()):
            home = root / name
            home.mkdir()
            for rel, text in files.items():
                (home / rel).parent.mkdir(parents=True, exist_ok=True)
                (home / rel).write_text(text)
            (home / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {name}\n")
            hostvars[name] = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                              "private_ip": f"10.0.0.{10 + i}", "slurm_hosts_file": str(home / "hosts"),
                              "slurm_cloud_init_dir": str(home / "etc/cloud"),
                              "slurm_cloud_init_instance_dir": str(home / "instance")}
        (root / "inventory.yml").write_text(json.dumps({"all": {"children": {"gpu_nodes": {"hosts": hostvars}}}}))
        (root / "ansible.cfg").write_text(f"[defaults]\nroles_path = {Path(__file__).resolve().parents[1] / 'ansible/roles'}\n")
        (root / "play.yml").write_text(yaml.safe_dump([{
            "name": "hosts", "hosts": "gpu_nodes", "gather_facts": False,
            "vars": {"slurm_controller_host": "{{ groups['gpu_nodes'][0] }}"},
            "tasks": [{"name": "hosts", "ansible.builtin.include_role": {"name": "slurm", "tasks_from": "hosts.yml"}}],
        }], sort_keys=False))
        before = {name: _tree(root / name) for name in CASES}

        # check mode: reports what it would do, writes nothing
        proc = playbook(root, "-i", "inventory.yml", "--check", "play.yml")
        for name, (_, _, want) in CASES.items():
            assert _tree(root / name) == before[name], name
            assert recap(proc.stdout, name)["failed"] == (want == "fail"), (name, proc.stdout[-3000:])

        proc = playbook(root, "-i", "inventory.yml", "play.yml")
        for name, (files, _, want) in CASES.items():
            counts = recap(proc.stdout, name)
            assert counts["failed"] == (want == "fail"), (name, proc.stdout[-3000:])
            dropin = root / name / "etc/cloud/cloud.cfg.d" / DROPIN
            assert dropin.exists() == (want == "write"), name
            if want == "write":
                assert yaml.safe_load(dropin.read_text()) == {"manage_etc_hosts": False}
                assert dropin.stat().st_mode & 0o777 == 0o644
            if want == "fail":
                assert "manage_etc_hosts" in proc.stdout
            else:  # the node list was written, the installer's loopback line for this node is gone
                lines = [ln.split() for ln in (root / name / "hosts").read_text().splitlines()]
                assert ["127.0.1.1", name] not in lines and [hostvars[name]["private_ip"], name] in lines
            if not files:
                assert not (root / name / "etc").exists(), name

        # a reboot: cloud-init's own update_etc_hosts runs on every host that has it; each node's name
        # still resolves to its private address first, and the node list is still there
        for name, (files, value, want) in CASES.items():
            if want == "fail" or not files:
                continue
            merged = _boot(root / name, name)
            assert merged is False or (merged == value and want == "none"), (name, merged)
            hosts = (root / name / "hosts").read_text()
            assert _first_address(hosts, name) == hostvars[name]["private_ip"], (name, hosts)
            assert all(_first_address(hosts, other) == hostvars[other]["private_ip"] for other in CASES), hosts

        # a second run (after the reboot) changes nothing
        proc = playbook(root, "-i", "inventory.yml", "play.yml")
        for name, (_, _, want) in CASES.items():
            counts = recap(proc.stdout, name)
            assert (counts["failed"], counts["changed"]) == (int(want == "fail"), 0), (name, proc.stdout[-3000:])
