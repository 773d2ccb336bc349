"""`gpuprov models` and `gpuprov gpus`: list the catalogs (table or --json)."""

from __future__ import annotations

import json

import click



@click.command(name="models")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def models(as_json: bool) -> None:
    """List the model presets and what each shorthand means.

    \b
    gpuprov models
    gpuprov models --json
    """
    from gpuprov.catalog.models import aliases, list_models  # lazy: `gpus` does not need it (7 ms)
    from gpuprov.sizing.families import SUPPORTED_MODEL_TYPES

    presets = list_models()
    if as_json:
        out = {"models": [m.summary() for m in presets], "aliases": aliases()}
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(f"{'name':<17}{'model':<20}{'type':<12}{'params':>17}{'layers':>7}{'hidden':>7}{'heads/kv':>10}{'vocab':>8}")
    for m in presets:
        experts = f" ({m.num_experts}x{m.experts_per_token})" if m.is_moe else ""
        click.echo(
            f"{m.name:<17}{m.display_name:<20}{m.model_type:<12}{m.params:>17,}{m.num_layers:>7}{m.hidden_size:>7}"
            f"{f'{m.num_attention_heads}/{m.num_kv_heads}':>10}{m.vocab_size:>8}{experts}"
        )
    click.echo("\nshorthands:")
    for short, entry in aliases().items():
        click.echo(f"  {short:<6} = {entry['model']:<16} ({entry['why']})")
    click.echo("\n--model also takes a preset's Hugging Face id or one of its instruct/chat ids (offline), any other id "
               f"(its config.json from the cache or the hub), or a path to a config.json ({', '.join(SUPPORTED_MODEL_TYPES)}).")


@click.command(name="gpus")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def gpus(as_json: bool) -> None:
    """List the GPU catalog (usable memory as the driver reports it; dense TFLOPS).

    \b
    gpuprov gpus
    gpuprov gpus --json
    """
    from gpuprov.catalog.gpus import list_gpus  # lazy: `models` does not need it (4 ms)

    catalog = list_gpus()
    if as_json:
        click.echo(json.dumps({"gpus": [g.as_dict() for g in catalog]}, indent=2))
        return
    click.echo(f"{'slug':<19}{'arch':<10}{'mem GiB':>8}{'HBM GB/s':>9}{'BF16 TF':>9}{'FP8 TF':>8}"
               f"{'NVLink GB/s':>12}{'PCIe':>5}{'TDP W':>6}")
    for g in catalog:
        fp8 = f"{g.fp8_tflops:g}" if g.fp8_tflops else "-"
        nvl = f"{g.nvlink_gbytes_per_s:g}" if g.nvlink_gbytes_per_s else "-"
        click.echo(
            f"{g.slug:<19}{g.architecture:<10}{g.memory_gib:>8.1f}{g.hbm_gbytes_per_s:>9g}{g.bf16_tflops:>9g}{fp8:>8}"
            f"{nvl:>12}{g.pcie_gen:>5}{g.tdp_w:>6}"
        )
