"""Boot the cached Debian image under qemu with N emulated NVMe drives and drive it over SSH.

Pure emulation (TCG): /dev/kvm on these machines is a nested paravirtual KVM on which a stock
guest kernel crawls. Networking is user-mode with SSH forwarded on 127.0.0.1 only. Each Guest
gets its own qcow2 overlay on the cached base image, its own NVMe drive files and its own SSH key
(passed to the guest on the kernel command line), so runs never share state. A guest without raw
drives can be saved and reverted (savevm/loadvm over its monitor socket): tests that share one
boot start each scenario from the same saved state.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("VM_CACHE", REPO / ".vm-cache" / "bookworm"))
BUILD_SCRIPT = Path(__file__).with_name("build_image.sh")
QEMU = "qemu-system-x86_64"
# ansible-playbook environment that prints the slowest tasks after each run (callback_plugins/)
TASK_TIMER_ENV = {"ANSIBLE_CALLBACK_PLUGINS": str(Path(__file__).with_name("callback_plugins")),
                  "ANSIBLE_CALLBACKS_ENABLED": "task_timer"}


def why_not_runnable() -> str | None:
    """None when a guest can boot here, else the reason (for a loud skip)."""
    if shutil.which(QEMU) is None:
        return f"{QEMU} is not installed (run .ci/setup.d/20-vm-image.sh)"
    if shutil.which("qemu-img") is None:
        return "qemu-img is not installed (run .ci/setup.d/20-vm-image.sh)"
    if not all((CACHE / name).is_file() for name in ("root.img", "vmlinuz", "initrd.img")):
        return f"no guest image in {CACHE} (build it with tests/vm/build_image.sh; needs root + debootstrap)"
    probe = subprocess.run([QEMU, "-accel", "help"], capture_output=True, text=True)
    if probe.returncode != 0 or "tcg" not in probe.stdout:
        return f"{QEMU} has no TCG accelerator: {probe.stderr.strip()[:200]}"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Guest:
    def __init__(self, workdir: Path, drives: int = 4, drive_bytes: int = 2**30, memory_mb: int = 2048,
                 smp: int = 1):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.drives = drives
        self.drive_bytes = drive_bytes
        self.memory_mb = memory_mb
        self.smp = smp
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.key = self.workdir / "id_ed25519"
        self.console = self.workdir / "console.log"
        self.overlay = self.workdir / "root.qcow2"
        self.monitor = self.workdir / "monitor.sock"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpuprov-vm-test",
                        "-f", str(self.key)], check=True)
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw",
                        "-b", str(CACHE / "root.img"), str(self.overlay)], check=True)
        self.wipe_drives()

    # --- drives -------------------------------------------------------------------------------
    def drive_path(self, index: int) -> Path:
        return self.workdir / f"nvme{index}.img"

    def serial(self, index: int) -> str:
        return f"NVME{index + 1:04d}"

    def by_id(self, index: int) -> str:
        return f"/dev/disk/by-id/nvme-QEMU_NVMe_Ctrl_{self.serial(index)}"

    def wipe_drives(self) -> None:
        """Fresh zeroed (sparse) drive files: what a cloud hands an instance after stop/start."""
        assert self.proc is None or self.proc.poll() is not None, "power the guest off first"
        for index in range(self.drives):
            path = self.drive_path(index)
            path.unlink(missing_ok=True)
            with open(path, "wb") as handle:
                handle.truncate(self.drive_bytes)

    # --- power --------------------------------------------------------------------------------
    def command_line(self) -> list[str]:
        pubkey = base64.b64encode((self.key.with_suffix(".pub")).read_bytes().strip()).decode()
        # show_status: systemd's start jobs (with their running time) reach the console, which is all a boot
        # that never brings up SSH leaves to read
        append = (f"root=/dev/vda rw console=ttyS0 net.ifnames=0 quiet systemd.show_status=1 "
                  f"gpuprov.sshkey={pubkey}")
        cmd = [QEMU, "-accel", "tcg,thread=multi", "-cpu", "max", "-M", "q35", "-m", str(self.memory_mb),
               "-smp", str(self.smp), "-nodefaults", "-display", "none", "-no-user-config",
               "-serial", f"file:{self.console}", "-monitor", f"unix:{self.monitor},server,nowait",
               "-kernel", str(CACHE / "vmlinuz"), "-initrd", str(CACHE / "initrd.img"), "-append", append,
               "-drive", f"file={self.overlay},if=virtio,format=qcow2",
               "-netdev", f"user,id=net0,hostfwd=tcp:127.0.0.1:{self.port}-:22",
               "-device", "virtio-net-pci,netdev=net0"]
        for index in range(self.drives):
            cmd += ["-drive", f"file={self.drive_path(index)},if=none,id=nvm{index},format=raw",
                    "-device", f"nvme,serial={self.serial(index)},drive=nvm{index}"]
        return cmd

    def start(self, timeout: float = 600) -> float:
        """Boot and wait for SSH; returns the seconds it took. The 600 s defaults (here and in reboot)
        allow for three guests on two loaded cores, as in the suite's VM pass: a reboot took over 300 s."""
        began = time.monotonic()
        # keep each boot's console: the previous ones explain a failed reboot
        if self.console.exists():
            self.console.rename(self.console.with_suffix(f".{int(time.time())}.log"))
        self.proc = subprocess.Popen(self.command_line(), stdin=subprocess.DEVNULL,
                                     stdout=open(self.workdir / "qemu.out", "ab"), stderr=subprocess.STDOUT)
        self.wait_ssh(timeout)
        return time.monotonic() - began

    def wait_ssh(self, timeout: float, not_boot_id: str | None = None) -> str:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"qemu exited ({self.proc.returncode}); console:\n{self.console_tail()}")
            result = self.ssh("cat /proc/sys/kernel/random/boot_id", check=False, timeout=20,
                              connect_timeout=5)
            if result.returncode == 0 and result.stdout.strip() and result.stdout.strip() != not_boot_id:
                return result.stdout.strip()
            last = result.stderr.strip()[-300:]
            time.sleep(2)
        raise TimeoutError(f"no SSH on 127.0.0.1:{self.port} after {timeout}s ({last}); console:\n"
                           f"{self.console_tail()}")

    def reboot(self, timeout: float = 600) -> float:
        began = time.monotonic()
        boot_id = self.ssh("cat /proc/sys/kernel/random/boot_id").stdout.strip()
        # --no-block: the session ends before sshd stops; user-mode networking would otherwise
        # keep it open (on a dead guest side) until the timeout
        self.ssh("systemctl --no-block reboot", check=False, timeout=20)
        self.wait_ssh(timeout, not_boot_id=boot_id)
        return time.monotonic() - began

    def poweroff(self, timeout: float = 120) -> float:
        began = time.monotonic()
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        self.ssh("systemctl poweroff", check=False, timeout=20)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return time.monotonic() - began

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    # --- snapshots (the qcow2 overlay holds them; a guest with raw NVMe drives cannot) ------
    def hmp(self, command: str, timeout: float = 600) -> str:
        """One human-monitor command; returns what the monitor printed."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(timeout)
            sock.connect(str(self.monitor))
            data = b""
            while not data.endswith(b"(qemu) "):
                data += sock.recv(4096)
            sock.sendall(command.encode() + b"\n")
            data = b""
            while data.count(b"(qemu) ") < 1 or not data.endswith(b"(qemu) "):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
        text = data.decode(errors="replace").replace("\r", "")
        return "\n".join(line for line in text.splitlines()[1:] if not line.startswith("(qemu)")).strip()

    def savevm(self, name: str) -> float:
        """Save the running guest (RAM and disk) under `name`; returns the seconds it took."""
        began = time.monotonic()
        out = self.hmp(f"savevm {name}")
        if "rror" in out:
            raise RuntimeError(f"savevm {name}: {out}")
        return time.monotonic() - began

    def loadvm(self, name: str) -> float:
        """Revert the guest to snapshot `name` (RAM and disk): every scenario starts from the same state."""
        began = time.monotonic()
        out = self.hmp(f"loadvm {name}")
        if "rror" in out:
            raise RuntimeError(f"loadvm {name}: {out}")
        self.wait_ssh(120)
        return time.monotonic() - began

    def console_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.console.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no console log)"

    # --- commands -----------------------------------------------------------------------------
    def ssh_options(self, connect_timeout: int = 10) -> list[str]:
        return ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "LogLevel=ERROR", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={connect_timeout}",
                "-o", "IdentitiesOnly=yes", "-i", str(self.key)]

    def ssh(self, command: str, check: bool = True, timeout: float = 300,
            connect_timeout: int = 10) -> subprocess.CompletedProcess:
        cmd = ["ssh", *self.ssh_options(connect_timeout), "-p", str(self.port), "root@127.0.0.1", command]
        try:
            # stdin from /dev/null: ssh sets its stdin non-blocking, and an ansible-playbook started
            # beside it (the other lane) on the same inherited stdin then refuses to run
            result = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            result = subprocess.CompletedProcess(cmd, 124, exc.stdout or "", f"timeout after {timeout}s")
            if isinstance(result.stdout, bytes):
                result.stdout = result.stdout.decode(errors="replace")
        if check and result.returncode != 0:
            raise RuntimeError(f"guest command failed ({result.returncode}): {command}\n"
                               f"{result.stdout}\n{result.stderr}")
        return result

    def inventory_host_vars(self) -> dict:
        return {
            "ansible_host": "127.0.0.1",
            "ansible_port": self.port,
            "ansible_user": "root",
            "ansible_ssh_private_key_file": str(self.key),
            # user-mode networking keeps the host side of a connection open when the guest reboots:
            # without keepalives Ansible's SSH master (and the reboot module's boot_id check through
            # it) waits on the dead connection until reboot_timeout
            "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
                                       "-o IdentitiesOnly=yes -o ServerAliveInterval=5 -o ServerAliveCountMax=6",
            "ansible_python_interpreter": "/usr/bin/python3",
        }


RECAP = re.compile(r"^(?P<host>\S+)\s*:\s*ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+"
                   r"unreachable=(?P<unreachable>\d+)\s+failed=(?P<failed>\d+)", re.M)


def recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP counters per host from ansible-playbook's default output."""
    return {m["host"]: {k: int(m[k]) for k in ("ok", "changed", "unreachable", "failed")}
            for m in RECAP.finditer(output)}


def task_times(output: str) -> str:
    """The task_timer callback's table from a run's output ('' when it is not there)."""
    at = output.rfind("TASK TIMES (")
    return output[at:].strip() if at >= 0 else ""
