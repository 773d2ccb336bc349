"""Cloud region names (regions.yaml): `--region` is checked against them before planning."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Iterable

from gpuprov.catalog import load_data
from gpuprov.errors import GpuprovError


@lru_cache(maxsize=1)
def _regions() -> dict[str, Any]:
    return load_data("regions.yaml")


def region_entry(cloud: str) -> dict | None:
    return _regions().get(cloud)


def regions(cloud: str) -> list[str]:
    entry = _regions().get(cloud)
    return list(entry["regions"]) if entry else []


def check_region(cloud: str, region: str | None, instances: Iterable[Any]) -> None:
    """One line when `region` is not a region of `cloud`: close names and where the catalog prices its types."""
    known = regions(cloud)
    if region is None or not known or region in known:
        return
    import difflib  # lazy: only a name the catalog lacks needs it
    close = difflib.get_close_matches(region, known, n=3)
    priced: dict[str, list[str]] = {}
    for i in instances:
        if i.cloud == cloud and i.region:
            priced.setdefault(i.region, []).append(i.name)
    where = "; ".join(f"{r}: {', '.join(sorted(n)[:4])}{' ...' if len(n) > 4 else ''}" for r, n in sorted(priced.items()))
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise GpuprovError(f"--region {region} is not a {cloud} region{hint}; the catalog's {cloud} GPU types are "
                       f"priced in {where or 'no region'} (`gpuprov instances --cloud {cloud}`)")
