"""`gpuprov config` (the user's defaults file) and `gpuprov completion bash|zsh|fish`."""

from __future__ import annotations

import json

import click

from gpuprov.errors import GpuprovError
from gpuprov.userconfig import KEYS, config_path, user_defaults


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: path, exists, values")
def config(as_json: bool) -> None:
    """Show the defaults file (cloud, region, objective, purchase) and what it sets.

    It lives at $XDG_CONFIG_HOME/gpuprov/config.yaml (~/.config/gpuprov/config.yaml); a spec file
    (-f) and flags override it.

    \b
    mkdir -p ~/.config/gpuprov
    printf 'cloud: aws\\nregion: us-east-1\\npurchase: [on-demand, spot]\\n' > ~/.config/gpuprov/config.yaml
    gpuprov config
    """
    path = config_path()
    values = user_defaults(path)
    exists = path.is_file()
    if as_json:
        click.echo(json.dumps({"path": str(path), "exists": exists, "values": values, "keys": list(KEYS)}, indent=2))
        return
    if not exists:
        click.echo(f"{path}: no defaults file (keys it takes: {', '.join(KEYS)})")
        return
    click.echo(f"{path}:")
    for key in KEYS:
        value = values.get(key)
        shown = "(not set)" if value is None else (",".join(value) if isinstance(value, list) else str(value))
        click.echo(f"  {key:<10} {shown}")
    click.echo("a spec file (-f) and flags override these; a --cloud other than the file's drops its region")


SHELLS = ("bash", "zsh", "fish")


@click.command()
@click.argument("shell", type=click.Choice(SHELLS))
def completion(shell: str) -> None:
    """Print the shell completion script (click's) for SHELL.

    \b
    gpuprov completion bash > ~/.local/share/bash-completion/completions/gpuprov
    gpuprov completion zsh > "${fpath[1]}/_gpuprov"
    gpuprov completion fish > ~/.config/fish/completions/gpuprov.fish
    eval "$(gpuprov completion bash)"          # this shell only
    """
    from click.shell_completion import get_completion_class

    from gpuprov.cli import cli

    cls = get_completion_class(shell)
    if cls is None:  # click.Choice(SHELLS) lets only the shells click registers through
        raise GpuprovError(f"no completion for {shell}")
    click.echo(cls(cli, {}, "gpuprov", "_GPUPROV_COMPLETE").source())
