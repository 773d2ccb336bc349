"""The GPU catalog (data/gpus.yaml) as GpuSpec records."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from gpuprov.catalog import load_data
from gpuprov.errors import GpuprovError

MIB = 2**20


@dataclass(frozen=True)
class GpuSpec:
    """One GPU type of catalog/data/gpus.yaml: memory, peak speeds, interconnect."""
    slug: str
    name: str
    architecture: str  # ampere, ada, hopper, blackwell
    memory_bytes: int  # usable, as the driver reports it
    hbm_gbytes_per_s: float
    bf16_tflops: float  # dense
    fp8_tflops: float | None
    nvlink_gbytes_per_s: float | None  # per GPU, one direction, all peers; None = PCIe only
    pcie_gen: int
    tdp_w: int
    source: str
    nvlink_bridge_gbytes_per_s: float | None = None  # 2-way bridge only (A6000, 3090)
    memory_source: str = ""

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / 2**30

    def as_dict(self) -> dict:
        return {
            "slug": self.slug,
            "name": self.name,
            "architecture": self.architecture,
            "memory_bytes": self.memory_bytes,
            "hbm_gbytes_per_s": self.hbm_gbytes_per_s,
            "bf16_tflops": self.bf16_tflops,
            "fp8_tflops": self.fp8_tflops,
            "nvlink_gbytes_per_s": self.nvlink_gbytes_per_s,
            "nvlink_bridge_gbytes_per_s": self.nvlink_bridge_gbytes_per_s,
            "pcie_gen": self.pcie_gen,
            "tdp_w": self.tdp_w,
            "source": self.source,
            "memory_source": self.memory_source,
        }


@lru_cache(maxsize=None)
def _all() -> dict[str, GpuSpec]:
    out: dict[str, GpuSpec] = {}
    for slug, e in load_data("gpus.yaml")["gpus"].items():
        out[slug] = GpuSpec(
            slug=slug,
            name=e["name"],
            architecture=e["architecture"],
            memory_bytes=int(e["memory_mib"]) * MIB,
            hbm_gbytes_per_s=float(e["hbm_gbytes_per_s"]),
            bf16_tflops=float(e["bf16_tflops"]),
            fp8_tflops=None if e.get("fp8_tflops") is None else float(e["fp8_tflops"]),
            nvlink_gbytes_per_s=None if e.get("nvlink_gbytes_per_s") is None else float(e["nvlink_gbytes_per_s"]),
            pcie_gen=int(e["pcie_gen"]),
            tdp_w=int(e["tdp_w"]),
            source=e["source"],
            nvlink_bridge_gbytes_per_s=e.get("nvlink_bridge_gbytes_per_s"),
            memory_source=e.get("memory_source", ""),
        )
    return out


def list_gpus() -> list[GpuSpec]:
    return list(_all().values())


def accelerator_name(name: str) -> tuple[str, int | None] | None:
    """A SkyPilot-style accelerator name ("H100", "A100-80GB:8", case-insensitive) as (slug, total
    GPUs or None); None when `name` is not one (a slug, or unknown)."""
    base, _, count = str(name).strip().partition(":")
    names = {k.lower(): v for k, v in (load_data("gpus.yaml").get("accelerator_names") or {}).items()}
    slug = names.get(base.lower())
    if slug is None:
        return None
    if count and not count.isdigit():
        raise GpuprovError(f"--gpu {name!r}: expected NAME or NAME:COUNT (H100:8)")
    if count and int(count) < 1:
        raise GpuprovError(f"--gpu {name!r}: the count must be at least 1")
    return slug, int(count) if count else None


def get_gpu(slug: str) -> GpuSpec:
    """A GPU by slug (case-insensitive); unknown names get the closest slugs."""
    key = (slug or "").strip().lower()
    gpus = _all()
    if key in gpus:
        return gpus[key]
    named = accelerator_name(key)
    if named is not None:
        return gpus[named[0]]
    import difflib  # lazy: only a name the catalog lacks needs it
    close = difflib.get_close_matches(key, list(gpus), n=4, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(gpus)}"
    raise GpuprovError(f"unknown GPU {slug!r}{hint}")
