"""A real Slurm cluster on this machine for tests: munged, slurmctld and two slurmd (Debian's
slurm-wlm), each node its own slurmd on its own port (NodeName=n1/n2, `slurmd -N`).

Everything lives in one scratch folder the munge user can enter (daemon_scratch: munged runs as
munge); the daemons find it through SLURM_CONF. A node is "killed" as a
machine dies: its slurmd, its step daemons and every process of its job tasks at once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue")


def missing() -> str:
    """Why a real cluster cannot start here ('' when it can)."""
    absent = [b for b in BINARIES if not shutil.which(b) and not Path("/usr/sbin", b).exists()]
    if absent:
        return f"Slurm/munge not installed ({', '.join(absent)}): .ci/setup.d/30-slurm.sh installs them"
    if os.geteuid() != 0:
        return "a test Slurm cluster runs slurmd as root"
    try:
        import pwd

        pwd.getpwnam("munge")
    except KeyError:
        return "no munge user (the munge package makes it)"
    return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, root: Path, nodes: int = 2, cpus: int = 2, gpus: int = 1, partition: str = "gpu"):
        self.root, self.nodes = root, [f"n{i + 1}" for i in range(nodes)]
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        host = socket.gethostname().split(".")[0]
        munge = root / "munge"
        munge.mkdir()
        shutil.chown(munge, "munge", "munge")
        self.socket = munge / "munge.socket"
        ports = [_free_port() for _ in range(nodes + 1)]
        lines = [
            "ClusterName=gpuprovtest", f"SlurmctldHost={host}(127.0.0.1)", f"SlurmctldPort={ports[0]}",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CryptoType=crypto/munge",
            # cred_expire: how long a requeued job waits before it starts again (slurm.conf(5)); 30 s
            # instead of 120 keeps the requeue tests short without bypassing Slurm's hold
            f"AuthInfo=socket={self.socket},cred_expire=30", f"StateSaveLocation={root}/ctld", f"SlurmdSpoolDir={root}/spool/%n",
            f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd-%n.pid",
            f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd-%n.log",
            # no cgroup hierarchy to confine jobs in a test container: track processes by parentage
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "GresTypes=gpu", "ReturnToService=2", "JobRequeue=1",
            "SlurmdTimeout=10", "MpiDefault=none", "MailProg=/bin/true",
        ]
        for name, port in zip(self.nodes, ports[1:]):
            lines.append(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus}"
                         + (f" Gres=gpu:{gpus}" if gpus else "") + " State=UNKNOWN")
        lines.append(f"PartitionName={partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=EXCLUSIVE")
        self.conf.write_text("\n".join(lines) + "\n")
        # no GPUs here: each node's "GPU" is a device file that exists, so --gpus-per-node is honoured
        (root / "gres.conf").write_text(f"NodeName=n[1-{nodes}] Name=gpu File=/dev/null\n" if gpus else "")
        for d in ("ctld", "spool"):
            (root / d).mkdir()
        self.slurmd: dict[str, subprocess.Popen] = {}

    # ------------------------------------------------------------------ daemons
    def start(self) -> "SlurmCluster":
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
        m = self.root / "munge"
        subprocess.run(["runuser", "-u", "munge", "--", _sbin("munged"), f"--key-file={key}", f"--socket={self.socket}",
                        f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/munge.seed"],
                       check=True, timeout=30)
        self.ctld = subprocess.Popen([_sbin("slurmctld"), "-D", "-c"], env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        for name in self.nodes:
            self.start_node(name)
        self.wait_nodes("idle")
        return self

    def start_node(self, name: str) -> None:
        self.slurmd[name] = subprocess.Popen([_sbin("slurmd"), "-D", "-N", name], env=self.env,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def kill_node(self, name: str) -> list[int]:
        """SIGKILL the node's slurmd, its step daemons and its tasks' processes, all at once."""
        doomed = set(_task_pids(name))
        for pid in list(doomed):
            doomed |= set(_stepd_ancestors(pid))
        doomed.add(self.slurmd[name].pid)
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.slurmd[name].wait(timeout=30)
        return sorted(doomed)

    def stop(self) -> None:
        for p in [*self.slurmd.values(), getattr(self, "ctld", None)]:
            if p is not None and p.poll() is None:
                p.terminate()
        for p in [*self.slurmd.values(), getattr(self, "ctld", None)]:
            if p is not None:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
        for name in self.nodes:  # tasks a killed test left behind
            for pid in _task_pids(name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        pid_file = self.root / "munge" / "munged.pid"
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)

    # ------------------------------------------------------------------ queries
    def run(self, *argv: str, timeout: float = 30) -> str:
        proc = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"{argv}: {proc.stdout}{proc.stderr}"
        return proc.stdout

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "--noheader", "--Node", "--format=%N %t")
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_nodes(self, state: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
                states = self.node_states()
                if len(states) == len(self.nodes) and all(s == state for s in states.values()):
                    return
            time.sleep(0.5)
        raise AssertionError(f"nodes not {state} after {timeout:.0f} s: {self.node_states()}\n"
                             + (self.root / "slurmctld.log").read_text()[-3000:])

    def job(self, job_id: str) -> dict[str, str]:
        """scontrol show job as key=value pairs (JobState, Restarts, ExitCode...)."""
        out = self.run("scontrol", "show", "job", "--oneliner", job_id)
        return dict(f.split("=", 1) for f in out.split() if "=" in f)


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(e.split("=", 1) for e in raw.decode(errors="replace").split("\0") if "=" in e)


def _task_pids(node: str) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir()
            if p.name.isdigit() and _environ(int(p.name)).get("SLURMD_NODENAME") == node]


def _stepd_ancestors(pid: int) -> list[int]:
    out = []
    while pid > 1:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            break
        if cmd.startswith(b"slurmstepd"):
            out.append(pid)
        pid = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("PPid:")))
    return out


SYSTEM_SCRATCH = (Path("/var/tmp"), Path("/tmp"), Path("/dev/shm"))
# Used when every system scratch folder is root's alone, as /var/tmp, /tmp and /dev/shm all were on a
# CI machine: a folder of the suite's own, sticky and open to all as /tmp normally is.
OWN_SCRATCH = Path(os.environ.get("GPUPROV_SCRATCH", "/var/lib/gpuprov-scratch"))


def _others_may_enter(path: Path) -> bool:
    return path.is_dir() and all(p.stat().st_mode & 0o001 for p in (path, *path.parents))


def scratch_base(system=SYSTEM_SCRATCH, own: Path = OWN_SCRATCH) -> Path:
    """The first of the system scratch folders whose every folder from / lets others pass, else our
    own (made 1777 when absent)."""
    for base in system:
        if _others_may_enter(base):
            return base
    own.mkdir(parents=True, exist_ok=True)
    own.chmod(0o1777)
    if not _others_may_enter(own):
        raise RuntimeError(f"no scratch folder other users may enter: {own} has a private parent")
    return own


def daemon_scratch(prefix: str) -> Path:
    """A new folder (0755) that the daemons' own users (munge, slurm) can enter, under scratch_base()."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=scratch_base()))
    root.chmod(0o755)
    return root


@contextlib.contextmanager
def slurm_cluster(**kw):
    root = daemon_scratch("gpuprov-slurm-")
    cluster = SlurmCluster(root, **kw)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        if not os.environ.get("GPUPROV_KEEP_SLURM"):  # set it to read the daemons' logs after a failure
            shutil.rmtree(root, ignore_errors=True)
