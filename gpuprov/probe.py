"""What an on-prem host holds, read from the output of standard tools (`gpuprov hosts probe`).

One SSH call runs PROBE_SCRIPT on the host; its sections are parsed here by pure functions
(tests feed them recorded output): nvidia-smi (GPU model and memory), free and lscpu/nproc (RAM,
cores), lsblk (NVMe data drives, the OS disk left out), ip/sysfs and ibstat (NICs and fabric).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from gpuprov.units import GiB

_NUMBER = re.compile(r"[0-9]+(\.[0-9]+)?")
MAX_LSBLK_DEPTH = 8  # disk > partition > crypt/LVM > ...: real trees are three or four deep

# each section starts with a marker line, so one round trip reads everything
PROBE_SCRIPT = "; ".join([
    "echo '### nvidia-smi'", "nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits",
    # power.limit is what the board enforces now (nvidia-smi -pl), power.max_limit the most it may be set to
    "echo '### power'", "nvidia-smi --query-gpu=power.limit,power.max_limit --format=csv,noheader,nounits",
    "echo '### free'", "free -b",
    "echo '### lscpu'", "lscpu",
    "echo '### nproc'", "nproc --all",
    "echo '### lsblk'", "lsblk -J -b -o NAME,SIZE,TYPE,MOUNTPOINT",
    "echo '### ip'", "ip -o link show",
    "echo '### speed'", "for f in /sys/class/net/*/speed; do echo \"$f $(cat $f 2>/dev/null)\"; done",
    "echo '### ibstat'", "ibstat 2>/dev/null || true",
])


def sections(text: str) -> dict[str, str]:
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^### (\S+)$", line.strip())
        if m:
            current = m.group(1)
            out[current] = []
        elif current:
            out[current].append(line)
    return {k: "\n".join(v) for k, v in out.items()}


def _family(slug: str) -> str:
    return re.sub(r"-\d+gb$", "", slug)


def gpu_slug(smi_name: str, memory_mib: int, gpus: list[Any]) -> str | None:
    """The catalog slug for an nvidia-smi name: the longest family in the name, then the nearest memory."""
    norm = re.sub(r"[^a-z0-9]+", "-", smi_name.lower()).strip("-")
    fams = {_family(g.slug) for g in gpus if re.search(rf"(^|-){re.escape(_family(g.slug))}(-|$)", norm)}
    if not fams:
        return None
    fam = max(fams, key=len)
    same = [g for g in gpus if _family(g.slug) == fam]
    return min(same, key=lambda g: abs(g.memory_bytes / 2**20 - memory_mib)).slug


def parse_gpus(text: str, gpus: list[Any]) -> tuple[str | None, int, str]:
    """(slug, count, nvidia-smi name) of the host's GPUs; the slug is None when the catalog lacks them."""
    rows = [ln.rsplit(",", 1) for ln in text.splitlines() if ln.strip() and "," in ln]
    if not rows:
        return None, 0, ""
    names = {r[0].strip() for r in rows}
    if len(names) > 1:
        raise ValueError(f"mixed GPUs in one host: {', '.join(sorted(names))}")
    name, text = rows[0][0].strip(), rows[0][1].strip()
    mib = float(text) if _NUMBER.fullmatch(text) else math.nan
    if not math.isfinite(mib) or not 0 < mib < 2**40:  # `1e999`, `[N/A]`: not a memory size
        raise ValueError(f"nvidia-smi reported memory {text[:30]!r} for {name[:60]!r}; expected MiB")
    return gpu_slug(name, int(mib), gpus), len(rows), name


MAX_RAM_BYTES = 1 << 60  # an exbibyte: no host reports more (a larger figure is not a memory size)
MAX_COUNT = 10**6  # cores, sockets, threads, link speeds in Mb/s and port rates in Gb/s stay below


def _bounded(text: str, what: str, limit: int = MAX_COUNT) -> int:
    """A decimal count from tool output, or ValueError (one line) when it is absurd."""
    if len(text) > 20 or int(text) > limit:
        raise ValueError(f"{what} {text[:24]!r} is out of range")
    return int(text)


def parse_power_limit(text: str) -> int | None:
    """The lowest enforced power limit (W) of the host's GPUs when it is below their maximum (a capped board);
    None when uncapped or unreported ([N/A], older drivers)."""
    capped = []
    for line in text.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != 2 or not all(_NUMBER.fullmatch(x) for x in parts):
            continue
        limit, most = float(parts[0]), float(parts[1])
        if 0 < limit < most - 0.5:
            capped.append(limit)
    return int(round(min(capped))) if capped else None


def parse_ram_gib(text: str) -> int | None:
    m = re.search(r"^Mem:\s+(\d+)", text, re.M)
    if not m:
        return None
    return round(_bounded(m.group(1), "free -b reported a memory total of", MAX_RAM_BYTES) / GiB)


def parse_cores(lscpu: str, nproc: str) -> int | None:
    """Physical cores: sockets x cores per socket (lscpu), else nproc over threads per core."""
    def field(name: str) -> int | None:
        m = re.search(rf"^{re.escape(name)}:\s+(\d+)", lscpu, re.M)
        return _bounded(m.group(1), f"lscpu {name}") if m else None

    per, sockets, threads = field("Core(s) per socket"), field("Socket(s)"), field("Thread(s) per core")
    if per and sockets:
        return per * sockets
    n = _bounded(nproc.strip(), "nproc") if nproc.strip().isdigit() and nproc.strip().isascii() else None
    return n // (threads or 1) if n else None


def _mounted(dev: dict, depth: int = 0) -> bool:
    if depth > MAX_LSBLK_DEPTH:
        raise ValueError(f"lsblk output nested more than {MAX_LSBLK_DEPTH} levels deep")
    children = dev.get("children") or []
    if not isinstance(children, list):
        raise ValueError("lsblk output: children is not a list")
    return bool(dev.get("mountpoint")) or any(isinstance(c, dict) and _mounted(c, depth + 1) for c in children)


def parse_nvme(text: str) -> tuple[int, int]:
    """(count, GB each: the smallest) of NVMe data drives; a drive holding a mounted filesystem is the OS's."""
    try:
        devices = json.loads(text).get("blockdevices", [])
    except (json.JSONDecodeError, AttributeError):
        return 0, 0
    except RecursionError:
        raise ValueError("lsblk output nested too deeply") from None
    if not isinstance(devices, list):
        raise ValueError("lsblk output: blockdevices is not a list")
    data = [d for d in devices if isinstance(d, dict) and d.get("type") == "disk"
            and str(d.get("name", "")).startswith("nvme") and not _mounted(d)]
    if not data:
        return 0, 0
    # util-linux before 2.33 prints sizes as strings ("3840755982336"), later ones as numbers
    sizes = [d.get("size") for d in data]
    bad = [s for s in sizes if isinstance(s, bool) or not re.fullmatch(r"[0-9]{1,19}", str(s))]
    if bad:
        raise ValueError(f"lsblk reported a drive size that is not a byte count: {str(bad[0])[:40]!r}")
    return len(data), round(min(int(str(s)) for s in sizes) / 1e9)


_VIRTUAL = re.compile(r"^(lo|docker|veth|virbr|br-|cni|flannel|cali|tun|tap|bond\d+\.)")


def parse_network(ip: str, speed: str, ibstat: str) -> tuple[str, int | None]:
    """(fabric, Gb/s in total) from active InfiniBand/RoCE ports, else the fastest physical Ethernet link."""
    ports = re.findall(r"State:\s+(\w+).*?Rate:\s+(\d+).*?Link layer:\s+(\w+)", ibstat, re.S)
    active = [(_bounded(rate, "ibstat rate"), layer) for state, rate, layer in ports if state == "Active"]
    if active:
        fabric = "infiniband" if any(layer == "InfiniBand" for _, layer in active) else "roce"
        return fabric, sum(rate for rate, layer in active if (layer == "InfiniBand") == (fabric == "infiniband"))
    up = {m.group(1) for m in re.finditer(r"^\d+:\s+([^:@]+)[:@].*state UP", ip, re.M)}
    speeds = []
    for line in speed.splitlines():
        m = re.match(r"^/sys/class/net/([^/]+)/speed\s+(\d+)$", line.strip())
        if m and m.group(1) in up and not _VIRTUAL.match(m.group(1)):
            speeds.append(_bounded(m.group(2), f"{m.group(1)} link speed"))
    return "ethernet", (max(speeds) // 1000 or None) if speeds else None


def parse_probe(text: str, gpus: list[Any]) -> dict[str, Any]:
    """The hosts-file fields one probe's output fills (gpu, gpus, power_limit_w when capped, ram_gib, cores, nvme_*,
    fabric, nic_gbps)."""
    if "\0" in text:
        raise ValueError("the probe's output holds a NUL byte; expected the text of standard tools")
    s = sections(text)
    slug, count, smi_name = parse_gpus(s.get("nvidia-smi", ""), gpus)
    if count and slug is None:
        raise ValueError(f"GPU {smi_name!r} is not in the catalog (see `gpuprov gpus`)")
    out: dict[str, Any] = {}
    if count:
        out.update(gpu=slug, gpus=count)
        limit = parse_power_limit(s.get("power", ""))
        if limit:
            out["power_limit_w"] = limit
    ram, cores = parse_ram_gib(s.get("free", "")), parse_cores(s.get("lscpu", ""), s.get("nproc", ""))
    if ram:
        out["ram_gib"] = ram
    if cores:
        out["cores"] = cores
    n, each = parse_nvme(s.get("lsblk", ""))
    out.update(nvme_count=n, nvme_gb_each=each)
    fabric, gbps = parse_network(s.get("ip", ""), s.get("speed", ""), s.get("ibstat", ""))
    out["fabric"] = fabric
    if gbps:
        out["nic_gbps"] = gbps
    return out
