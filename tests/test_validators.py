"""The parse-time validators (gpuprov/validators.py) against the catalog's own data: every region the
instance catalog prices passes its cloud's pattern, every documented example passes, and the
shapes the clouds reject (and injection payloads) fail."""

from __future__ import annotations

import pytest

from gpuprov import validators as v
from gpuprov.catalog.instances import list_instances

CLOUD_REGIONS = sorted({(i.cloud, i.region) for i in list_instances() if i.region and not i.onprem})


def test_catalog_lists_regions() -> None:
    assert {cloud for cloud, _ in CLOUD_REGIONS} == {"aws", "gcp", "azure", "oci"}


@pytest.mark.parametrize("cloud,region", CLOUD_REGIONS)
def test_catalog_regions_pass(cloud: str, region: str) -> None:
    assert v.region(region) == region
    assert v.region_for(cloud, region) is None


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure", "oci"])
def test_region_examples_and_other_clouds(cloud: str) -> None:
    entry = v.patterns()["regions"][cloud]
    assert v.region_for(cloud, entry["example"]) is None
    assert entry["source"].startswith("https://")
    others = [e["example"] for c, e in v.patterns()["regions"].items() if c != cloud]
    assert any(v.region_for(cloud, other) for other in others)  # the patterns tell clouds apart


@pytest.mark.parametrize("key,check", [("aws_capacity_reservation_id", v.aws_reservation_id),
                                       ("gcp_reservation", v.gcp_reservation)])
def test_id_examples_pass(key: str, check) -> None:
    entry = v.patterns()[key]
    assert check(entry["example"]) == entry["example"] and entry["source"].startswith("https://")


BAD_STRINGS = ['x"\ny', "a b", "x;rm", "$(id)", "`id`", "a\u2028b", "", "-flag", "é"]


@pytest.mark.parametrize("check", [v.region, v.host_name, v.address, v.user_name, v.aws_reservation_id,
                                   v.gcp_reservation, v.cidr])
@pytest.mark.parametrize("value", BAD_STRINGS)
def test_hostile_values_fail(check, value: str) -> None:
    with pytest.raises(ValueError):
        check(value)


@pytest.mark.parametrize("value,normal", [("10.0.0.1", "10.0.0.1"), ("2001:db8::1", "2001:db8::1"),
                                          ("gpu-01.example.com", "gpu-01.example.com"), ("node7", "node7")])
def test_addresses_pass(value: str, normal: str) -> None:
    assert v.address(value) == normal


@pytest.mark.parametrize("value", ["10.0.0.256", "1.2.3", "-a.example.com", "a..b", "x" * 64 + ".com"])
def test_bad_addresses_fail(value: str) -> None:
    with pytest.raises(ValueError):
        v.address(value)


@pytest.mark.parametrize("value,normal", [("203.0.113.0/24", "203.0.113.0/24"), ("0.0.0.0/0", "0.0.0.0/0"),
                                          ("2001:db8::/32", "2001:db8::/32"), ("10.1.2.3/32", "10.1.2.3/32")])
def test_cidrs_pass(value: str, normal: str) -> None:
    assert v.cidr(value) == normal


def test_catalog_display_names_pass() -> None:
    from gpuprov.catalog.models import list_models

    for arch in list_models():
        assert v.display_name(arch.display_name, arch.name) == arch.display_name


@pytest.mark.parametrize("value", ['a"b', "x${y}", "a`b`", "a<b>", "a|b", "a;b", "a#b", "a\nb", "", " " * 3, 7])
def test_bad_display_names_fail(value: object) -> None:
    with pytest.raises(ValueError):
        v.display_name(value, "_name_or_path")
