"""One boot of cloud-init's update_etc_hosts, by cloud-init's own code, on a stand-in host folder.

Run by tests/test_slurm_hosts_cloud_init.py in its own process, with Debian 12's cloud-init package
(and its Python dependencies) unpacked by .ci/setup.d/35-cloud-init.sh:
    python tests/cloud_init_boot.py TREE HOME HOSTNAME
TREE is the unpacked root (usr/lib/python3/dist-packages, etc/cloud/templates); HOME holds etc/cloud
(for /etc/cloud), instance/ (for /var/lib/cloud/instance) and hosts (for /etc/hosts). The configuration
is merged as cloud-init merges it (its ConfigMerger: the instance's user-data and vendor-data over
cloud.cfg and cloud.cfg.d), then the module renders or edits HOME/hosts as at boot on Ubuntu/Debian.
The name and FQDN stand for the ones the cloud's metadata gives. Prints the merged manage_etc_hosts.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path


def main(tree: Path, home: Path, hostname: str) -> None:
    warnings.simplefilter("ignore")
    sys.path.insert(0, str(tree / "usr/lib/python3/dist-packages"))
    from cloudinit import distros, helpers, util
    from cloudinit.cloud import Cloud
    from cloudinit.config import cc_update_etc_hosts

    # instance_link is <cloud_dir>/instance: HOME/instance stands for /var/lib/cloud/instance
    paths = helpers.Paths({"cloud_dir": str(home), "templates_dir": str(tree / "etc/cloud/templates")})
    base = util.read_conf_with_confd(str(home / "etc/cloud/cloud.cfg"))
    cfg = helpers.ConfigMerger(paths=paths, base_cfg=base).cfg
    distro = distros.fetch("ubuntu")("ubuntu", cfg, paths)
    distro.hosts_fn = str(home / "hosts")
    cloud = Cloud(None, paths, cfg, distro, helpers.Runners(paths))
    boot_cfg = dict(cfg, hostname=hostname, fqdn=f"{hostname}.internal")
    cc_update_etc_hosts.handle("update_etc_hosts", boot_cfg, cloud, logging.getLogger("cloud-init"), [])
    print(json.dumps({"manage_etc_hosts": cfg.get("manage_etc_hosts")}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
