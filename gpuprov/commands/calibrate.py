"""`gpuprov calibrate BUNDLE METRICS.jsonl -o FILE`: a measured run against its plan, written for --calibration."""

from __future__ import annotations

import json

import click

from gpuprov import calibration
from gpuprov.commands.up import _load
from gpuprov.errors import GpuprovError
from gpuprov.safefile import read_text, write_atomic


def _cell(value, quantity: str) -> str:
    if value is None:
        return "n/a"
    if quantity == "MFU":
        return f"{value:.1%}"
    if quantity.startswith("peak memory"):
        return f"{value / 2**30:,.2f} GiB"
    return f"{value:,.0f}"


@click.command()
@click.argument("directory", metavar="BUNDLE")
@click.argument("metrics_path", metavar="METRICS.jsonl")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Calibration file to write (for plan/generate --calibration FILE)")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object")
def calibrate(directory: str, metrics_path: str, output: str, as_json: bool) -> None:
    """Measured tokens/s, MFU and peak memory of a run beside what its bundle's plan predicted, and a
    calibration file that `plan`/`generate --calibration FILE` apply to the same GPU type.

    METRICS.jsonl is the trainer's metrics file (launch/train.yaml logging.metrics_file). The steady
    state is the median of the logged steps after the first (compile and warm-up); the peak memory
    the largest reserved.

    \b
    gpuprov calibrate infra/ /shared/jobs/run1/metrics.jsonl -o h100.calibration.yaml
    gpuprov plan --model 70b --calibration h100.calibration.yaml
    """
    _root, plan = _load(directory)
    text = read_text(metrics_path, limit=calibration.MAX_METRICS_BYTES, follow=True, what="metrics file")
    measured = calibration.measure(text, metrics_path)
    rows = calibration.compare(plan, measured)
    rec = calibration.record(plan, measured, directory, metrics_path)
    try:
        write_atomic(output, calibration.dump(rec))
    except OSError as exc:
        raise GpuprovError(f"{output}: cannot write: {exc.strerror or type(exc).__name__}") from None
    if as_json:
        click.echo(json.dumps({"rows": rows, "calibration": rec, "written": output}, indent=2))
        return
    click.echo(f"{plan.model.display_name} on {plan.cluster.total_gpus} x {plan.cluster.gpu}: "
               f"{calibration.layout_of(plan)}")
    click.echo(f"  {'':<30}{'measured':>14}{'predicted':>14}{'ratio':>8}")
    for r in rows:
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.3f}"
        click.echo(f"  {r['quantity']:<30}{_cell(r['measured'], r['quantity']):>14}"
                   f"{_cell(r['predicted'], r['quantity']):>14}{ratio:>8}")
    click.echo(f"wrote {output}: plans on {rec['gpu']} scale their step time by 1 / {rec['speed_ratio']:g} "
               f"({calibration.RULE})")
