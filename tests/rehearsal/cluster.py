"""Stand-in nodes for the rehearsal: qemu guests that play the instances a recorded `terraform
output` names, and the swaps `gpuprov up` runs with (tests/rehearsal/bin: terraform, and aws or gcloud for the transport).

Each node is a boot of the rehearsal image (tests/vm/build_image.sh with Debian's slurm-wlm, munge
and python3-apt added) with two NICs: user-mode networking that forwards only its sshd to the host
(the transport shim's end: what SSM, IAP or a bastion reach), and a private L2 segment shared with
the other nodes (qemu socket multicast on the loopback) on which each node has the private address
the recorded output gives it. What a cloud does at boot is done here over the harness's own root
SSH before Ansible starts: the hostname the cloud assigns, the private address, the image's login
user with passwordless sudo, name resolution of the other nodes (the VPC's DNS) and the shared
filesystem the bundle's storage names, which here is a host folder over virtio-9p.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import subprocess
import threading
import time
from pathlib import Path

from vm import harness

HERE = Path(__file__).resolve().parent
SHIMS = HERE / "bin"
FIXTURES = HERE / "fixtures"
IMAGE = Path(os.environ.get("REHEARSAL_VM_CACHE", harness.REPO / ".vm-cache" / "bookworm-slurm"))
EXTRA_PACKAGES = "slurm-wlm,munge,nfs-common,sudo,python3-apt,procps"


SELECT = "GPUPROV_REHEARSAL"  # which bundles run: "ci" (the default), "all" (or "1"), "0" (none)


def selection() -> str:
    """Which bundles this run rehearses. ci: the default cloud's from-scratch bundle only (its `up`,
    job, `status` and `down`: about 20 minutes, what CI's budget holds); all: the four bundles (about
    80 minutes); 0: none."""
    value = os.environ.get(SELECT, "ci").strip().lower()
    return {"1": "all", "": "ci"}.get(value, value)


def why_not_runnable() -> str | None:
    if selection() == "0":
        return f"{SELECT}=0"
    if selection() not in ("ci", "all"):
        return f"{SELECT}={os.environ[SELECT]!r} is none of ci, all, 0"
    reason = harness.why_not_runnable()
    if reason and "no guest image" not in reason:
        return reason
    if not all((IMAGE / name).is_file() for name in ("root.img", "vmlinuz", "initrd.img")):
        return (f"no rehearsal image in {IMAGE} (VM_CACHE={IMAGE} VM_EXTRA_PACKAGES={EXTRA_PACKAGES} "
                "bash tests/vm/build_image.sh; .ci/setup.d/25-rehearsal-image.sh does it)")
    return None


REPO = harness.REPO
OUTPUTS = HERE.parent / "data" / "terraform_output"


def fixture(cloud: str) -> dict:
    """The stand-in facts of one cloud with its recorded `terraform output -json` under "outputs" (and
    under "replaced"/"outputs" the one after a node was replaced, where the cloud has it)."""
    recorded = json.loads((FIXTURES / f"{cloud}.json").read_text())
    recorded["outputs"] = json.loads((OUTPUTS / recorded["outputs_file"]).read_text())
    if "replaced" in recorded:  # the same output after `up` had Terraform replace a lost node
        recorded["replaced"]["outputs"] = json.loads((OUTPUTS / recorded["replaced"]["outputs_file"]).read_text())
    return recorded


class Node(harness.Guest):
    """One stand-in instance: a guest on the rehearsal image with a NIC on the private segment."""

    def __init__(self, workdir: Path, *, segment: str, mac: str, shares: dict[str, Path], key: Path,
                 vcpus: int, memory_mib: int):
        self.segment, self.mac, self.shares = segment, mac, shares
        saved = harness.CACHE
        harness.CACHE = IMAGE  # Guest reads the base image path from the module
        try:
            # the instance's own vCPUs and memory: TCG allocates guest RAM as the guest touches it,
            # so two 16 GiB guests cost the host what they use (a few hundred MiB each while idle)
            super().__init__(workdir, drives=0, memory_mb=memory_mib, smp=vcpus)
        finally:
            harness.CACHE = saved
        # one login key for every node: the key pair the bundle's key_name stands for
        shutil.copy(key, self.key)
        shutil.copy(key.with_suffix(".pub"), self.key.with_suffix(".pub"))

    def command_line(self) -> list[str]:
        saved = harness.CACHE
        harness.CACHE = IMAGE
        try:
            cmd = super().command_line()
        finally:
            harness.CACHE = saved
        cmd += ["-netdev", f"socket,id=net1,mcast={self.segment},localaddr=127.0.0.1",
                "-device", f"virtio-net-pci,netdev=net1,mac={self.mac}"]
        for tag, path in self.shares.items():
            cmd += ["-virtfs", f"local,path={path},mount_tag={tag},security_model=none,id={tag}"]
        return cmd


def boot_script(hostname: str, address: str, prefix: int, hosts: dict[str, str], login_user: str,
                mounts: dict[str, str], gpus: int, venv: str) -> str:
    """What the cloud and its image do before anyone logs in (cloud-init's part), as one shell script."""
    lines = ["set -e",
             f"hostnamectl set-hostname {hostname} || echo {hostname} > /etc/hostname",
             f"hostname {hostname}",
             "ip link set eth1 up",
             f"ip addr replace {address}/{prefix} dev eth1",
             "printf '127.0.0.1 localhost\\n' > /etc/hosts"]
    lines += [f"echo '{ip} {name}' >> /etc/hosts" for name, ip in hosts.items()]
    lines += [f"id -u {login_user} >/dev/null 2>&1 || useradd -m -s /bin/bash {login_user}",
              f"echo '{login_user} ALL=(ALL) NOPASSWD:ALL' > /etc/sudoers.d/90-cloud-init-users",
              f"install -d -m 700 -o {login_user} -g {login_user} /home/{login_user}/.ssh",
              f"install -m 600 -o {login_user} -g {login_user} /root/.ssh/authorized_keys /home/{login_user}/.ssh/",
              "chmod 711 /root"]
    for tag, where in mounts.items():
        # the shared filesystem uncached (what one node writes, the other reads at once); the training
        # venv read-only and cached by the guest: importing torch over uncached 9p under TCG took 5 min
        cache = "cache=none" if tag == "shared" else "cache=loose,ro"
        lines += [f"mkdir -p {where}",
                  f"mountpoint -q {where} || mount -t 9p -o trans=virtio,version=9p2000.L,{cache},msize=262144 {tag} {where}"]
    # the local scratch the skipped storage role mounts (the instance's NVMe, RAID0 at /scratch, mode
    # 1777: nvme_raid_mount_mode); the trainer keeps per-node files there (the flight recorder's)
    lines += ["install -d -m 1777 /scratch"]
    # the instance's GPUs as the driver's device files (char 195:N): what Slurm's gres.conf and
    # the job's device cgroup see; nothing can open them (there is no driver behind them)
    lines += [f"[ -e /dev/nvidia{i} ] || mknod -m 666 /dev/nvidia{i} c 195 {i}" for i in range(gpus)]
    # the training environment the train-tagged role builds from PyPI (unreachable here): the
    # host's own virtualenv, shared read-only at its own path
    lines += ["mkdir -p /opt/gpuprov", f"ln -sfn {venv} /opt/gpuprov/venv"]
    return "\n".join(lines) + "\n"


class Cloud:
    """The recorded instances of one cloud, each played by a Node, and the shims' state folder."""

    def __init__(self, workdir: Path, recorded: dict, shared: Path, venv_shares: dict[str, Path]):
        self.workdir = Path(workdir)
        self.state = self.workdir / "state"
        self.state.mkdir(parents=True, exist_ok=True)
        self.recorded = recorded
        self.shared = shared
        self.venv_shares = venv_shares
        self.key = self.workdir / "login_key"
        if not self.key.exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "rehearsal", "-f", str(self.key)],
                           check=True)
        self.segment = f"230.0.{random.randint(1, 250)}.{random.randint(1, 250)}:{random.randint(20000, 60000)}"
        self.nodes: dict[str, Node] = {}  # instance id -> node
        self.generation = 0
        self._recorded_outputs()
        if "replaced" in recorded:  # what the stand-in terraform's apply gives once it replaced a node
            (self.state / "outputs-replaced.json").write_text(json.dumps(recorded["replaced"]["outputs"]))
        self._write_targets()
        self._watch = threading.Thread(target=self._watcher, daemon=True)
        self._stop = threading.Event()
        self._watch.start()

    # --- the recorded instances -------------------------------------------------------------
    def _recorded_outputs(self) -> None:
        """The instances as the fleet launched them (again after a destroy): the first recording."""
        self.outputs = self.recorded["outputs"]
        self.hostnames = dict(self.recorded["hostnames"])
        (self.state / "outputs.json").write_text(json.dumps(self.outputs))

    def hosts(self) -> dict[str, dict]:
        """The nodes as Terraform records them now (after a replacement: the replaced recording)."""
        return self.outputs["ansible_inventory"]["value"]["all"]["children"]["gpu_nodes"]["hosts"]

    def transport_id(self, name: str) -> str:
        """What the inventory's transport addresses the node by (instance id, name, address)."""
        return str(self.hosts()[name]["ansible_host"])

    def private_ip(self, name: str) -> str:
        return self.recorded["private_ips"][name] if "private_ips" in self.recorded else self.hosts()[name]["private_ip"]

    def login_user(self) -> str:
        return self.outputs["ansible_inventory"]["value"]["all"]["vars"]["ansible_user"]

    def env(self) -> dict[str, str]:
        """The environment `gpuprov up` runs in: the shims first on PATH, a HOME of its own whose
        default SSH key is the login key (the key pair key_name names), nothing else changed."""
        home = self.workdir / "home"
        (home / ".ssh").mkdir(parents=True, exist_ok=True)
        shutil.copy(self.key, home / ".ssh" / "id_ed25519")
        shutil.copy(self.key.with_suffix(".pub"), home / ".ssh" / "id_ed25519.pub")
        os.chmod(home / ".ssh" / "id_ed25519", 0o600)
        # ssh reads ~/.ssh from the passwd entry, not $HOME: the operator's key and known_hosts are
        # given to Ansible's ssh the way an operator's ansible settings would
        return dict(os.environ, PATH=f"{SHIMS}{os.pathsep}{os.environ['PATH']}", HOME=str(home),
                    REHEARSAL_DIR=str(self.state), ANSIBLE_FORCE_COLOR="0",
                    ANSIBLE_PRIVATE_KEY_FILE=str(home / ".ssh" / "id_ed25519"),
                    ANSIBLE_SSH_EXTRA_ARGS=f"-o UserKnownHostsFile={home / '.ssh' / 'known_hosts'}")

    # --- power ------------------------------------------------------------------------------
    def launch(self, name: str) -> Node:
        """Boot the stand-in of recorded node `name` as Terraform records it now (its id, address and
        the hostname EC2 gives that address)."""
        self.generation += 1
        index = list(self.hosts()).index(name)
        node = Node(self.workdir / f"{name}.{self.generation}", segment=self.segment,
                    mac=f"52:54:00:12:{index:02x}:{self.generation % 256:02x}",
                    shares={"shared": self.shared, **self.venv_shares}, key=self.key,
                    vcpus=self.recorded["vcpus"], memory_mib=self.recorded["memory_mib"])
        try:
            # seconds until sshd answers: about 2 min on an idle 2-core host, far more on a loaded one
            node.start(timeout=float(os.environ.get("REHEARSAL_BOOT_TIMEOUT", "420")))
            hostnames = self.hostnames
            mounts = {"shared": self.outputs["shared_storage"]["value"]["mount_point"]}
            mounts.update({tag: str(path) for tag, path in self.venv_shares.items()})
            script = boot_script(hostnames[name], self.private_ip(name), self.recorded["subnet_prefix"],
                                 {hostnames[n]: self.private_ip(n) for n in self.hosts()}, self.login_user(), mounts,
                                 self.recorded["gpus_per_node"], str(self.venv_shares["venv"]))
            node.ssh(f"cat > /tmp/boot.sh <<'BOOT'\n{script}BOOT\nbash /tmp/boot.sh")
            image, gpu = self.recorded["image"], self.recorded["gpu"]
            node.ssh(f"cat > /tmp/standin_image.sh <<'IMAGE'\n{(HERE / 'standin_image.sh').read_text()}IMAGE\n"
                     f"sh /tmp/standin_image.sh {image['os_id']} {image['os_version']} {image['codename']} "
                     f"{self.recorded['gpus_per_node']} {image['gpu_pci_device']} {shlex.quote(gpu['name'])} "
                     f"{gpu['memory_mib']} {image['driver_version']}")
        except BaseException:
            node.kill()  # not registered yet: close() would leave the guest running
            raise
        self.nodes[self.transport_id(name)] = node
        self._write_targets()
        return node

    def launch_all(self) -> None:
        threads = [threading.Thread(target=self.launch, args=(name,)) for name in self.hosts()]
        errors = []
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        missing = [n for n in self.hosts() if self.transport_id(n) not in self.nodes]
        if missing:
            raise RuntimeError(f"stand-in nodes did not boot: {missing} {errors}")

    def kill(self, name: str) -> None:
        """The instance is gone (spot reclaim, hardware failure): no shutdown, nothing saved."""
        node = self.nodes.pop(self.transport_id(name))
        node.kill()
        self._write_targets()

    def node(self, name: str) -> Node:
        return self.nodes[self.transport_id(name)]

    def running(self) -> list[str]:
        return [iid for iid, node in self.nodes.items() if node.proc is not None and node.proc.poll() is None]

    def _write_targets(self) -> None:
        tmp = self.state / "targets.json.new"
        tmp.write_text(json.dumps({iid: node.port for iid, node in self.nodes.items()}))
        tmp.replace(self.state / "targets.json")

    def _watcher(self) -> None:
        """The cloud's side of the stand-in terraform: destroy, and replace (bin/terraform)."""
        while not self._stop.is_set():
            if (self.state / "destroy-requested").is_file():
                for iid in list(self.nodes):
                    self.nodes.pop(iid).poweroff(timeout=60)
                self._write_targets()
                self._recorded_outputs()  # a later apply launches a new fleet: the first recording's
                (self.state / "destroy-requested").unlink()
                (self.state / "destroyed").write_text("1\n")
            if (self.state / "replace-requested").is_file():
                wanted = json.loads((self.state / "replace-requested").read_text())
                (self.state / "replace-requested").unlink()
                try:
                    answer = self.replace(wanted)
                except Exception as exc:  # noqa: BLE001 - the stand-in apply reports it as its error
                    answer = {"error": f"{type(exc).__name__}: {exc}"}
                tmp = self.state / "replaced.new"
                tmp.write_text(json.dumps(answer))
                tmp.replace(self.state / "replaced")
            time.sleep(0.5)

    def replace(self, wanted: dict[str, str]) -> dict[str, str]:
        """aws_instance.replacement for each name in `wanted` (name -> the replaced recording's id):
        Terraform's state becomes the replaced recording, a stand-in boots under its id, address and
        the hostname EC2 derives from that address, and the VPC's DNS answers that hostname on the
        other nodes too (their /etc/hosts, the DNS's stand-in, gains it). Nothing gpuprov writes is
        touched: its own list of the nodes (the slurm role's block in /etc/hosts, the old address of
        the replaced node) is the play's to update. {name: id booted}."""
        after = self.recorded["replaced"]
        ids = dict(zip(after["outputs"]["node_names"]["value"], after["outputs"]["instance_ids"]["value"]))
        if any(ids.get(name) != iid for name, iid in wanted.items()):
            raise RuntimeError(f"asked for {wanted}; the recording after a replacement has {ids}")
        self.outputs = after["outputs"]
        self.hostnames.update(after["hostnames"])
        for name in wanted:
            self.launch(name)
        for name in wanted:
            line = f"{self.private_ip(name)} {self.hostnames[name]}"
            for iid, node in self.nodes.items():
                if iid != wanted[name]:
                    node.ssh(f"grep -qxF '{line}' /etc/hosts || echo '{line}' >> /etc/hosts")
        return {name: self.transport_id(name) for name in wanted}

    def close(self) -> None:
        self._stop.set()
        for node in self.nodes.values():
            node.kill()
        self.nodes.clear()
