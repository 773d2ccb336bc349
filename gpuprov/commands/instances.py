"""`gpuprov instances`: the cloud instance catalog and on-prem server templates."""

from __future__ import annotations

import json

import click

from gpuprov.catalog.instances import list_instances
from gpuprov.targets import CHOICES
from gpuprov.units import GiB


def _spot(inst) -> dict:
    """The spot offer of a type in its own region: sold or not, and the recorded price where there is one."""
    from gpuprov import spot
    from gpuprov.catalog.bringup import offered_options

    sold = not inst.onprem and "spot" in offered_options(inst)
    sp = spot.price(inst.name, inst.cloud, inst.region) if sold else None
    return {"sold": sold, "price_per_hour_usd": sp.usd if sp else None, "region": inst.region if sold else None,
            "date": sp.date if sp else None, "source": sp.source if sp else None,
            "other_regions": dict(spot.other_regions(inst.name, inst.region)) if sold else {}}


def _spot_cell(s: dict) -> str:
    """`1.23`, `none` (sold, no recorded price) or `-` (not sold on spot)."""
    if not s["sold"]:
        return "-"
    return "none" if s["price_per_hour_usd"] is None else f"{s['price_per_hour_usd']:,.2f}"


def _row(inst) -> dict:
    return {
        "cloud": inst.cloud,
        "name": inst.name,
        "gpu": inst.gpu,
        "gpus": inst.gpus,
        "vcpus": inst.vcpus,
        "ram_bytes": inst.ram_bytes,
        "local_nvme_count": inst.nvme_count,
        "local_nvme_bytes_each": inst.nvme_bytes_each,
        "network_cards": inst.network_cards,
        "efa_interfaces": inst.efa_interfaces,
        "fabric": inst.fabric,
        "fabric_gbps_per_gpu": inst.fabric_gbps_per_gpu,
        "nvswitch": inst.nvswitch,
        "pcie_gen": inst.pcie_gen,
        "region": inst.region,
        "price_per_hour_usd": inst.price_per_hour_usd,
        "price_date": inst.price_date,
        "price_source": inst.price_source,
        "spot": _spot(inst),
        "nccl_allreduce_busbw_gbytes_per_s": inst.nccl_busbw_gbytes_per_s,
        "source": inst.source,
        "description": inst.description or None,
    }


@click.command()
@click.option("--cloud", type=click.Choice(CHOICES), default="any",
              show_default=True, help="Only this cloud's instance types (onprem: server templates)")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list")
def instances(cloud: str, as_json: bool) -> None:
    """List cloud instance types and on-prem server templates, with prices (on-demand and spot) and sources.

    \b
    gpuprov instances --cloud gcp
    gpuprov instances --cloud onprem --json
    """
    items = list_instances(cloud)
    if as_json:
        click.echo(json.dumps([_row(i) for i in items], indent=2))
        return
    header = f"{'cloud':<7}{'instance':<28}{'GPUs':<22}{'vCPU':>5}{'RAM GiB':>9}  {'local NVMe':<16}" \
             f"{'fabric (Gb/s/GPU)':<20}{'$/h':>9}{'spot $/h':>10}  region / price date"
    click.echo(header)
    for i in items:
        gpus = f"{i.gpus} x {i.gpu}"
        if i.onprem:
            click.echo(f"{i.cloud:<7}{i.name:<28}{gpus:<22}{'-':>5}{'-':>9}  {'sized by rules':<16}"
                       f"{i.fabric + ' ' + format(i.fabric_gbps_per_gpu, 'g'):<20}{'-':>9}{'-':>10}  {i.description}")
            continue
        nvme = f"{i.nvme_count} x {i.nvme_bytes_each / 1e12:.2f} TB"
        price = "quote" if i.price_per_hour_usd is None else f"{i.price_per_hour_usd:,.2f}"
        fabric = f"{i.fabric} {i.fabric_gbps_per_gpu:g}"
        click.echo(f"{i.cloud:<7}{i.name:<28}{gpus:<22}{i.vcpus:>5}{(i.ram_bytes or 0) / GiB:>9,.0f}  {nvme:<16}"
                   f"{fabric:<20}{price:>9}{_spot_cell(_spot(i)):>10}  {i.region} / {i.price_date}")
    click.echo("spot $/h: the recorded spot price in the type's region (catalog/data/spot.yaml); none: sold on spot "
               "with no recorded price (plan it with --objective time); -: not sold on spot")
