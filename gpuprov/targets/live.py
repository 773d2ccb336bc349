"""What validate's checks are made of, shared by the pre-flight (gpuprov/preflight.py) and the targets'
live checks (gpuprov/targets/<name>_live.py): a check result, the CLI runner, and the helpers they share.
Standard library only: the targets import it, and the registry stays cheap to import."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any, Callable

Runner = Callable[[list[str]], tuple[int, str]]


@dataclass(frozen=True)
class Check:
    """One check of a deployed cluster: its status, what was seen and how to fix a failure."""
    status: str  # ok | fail | skip
    name: str
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class LiveCli:
    """How validate reaches a target's own CLI: the command that shows who is signed in, and the fixes."""

    login: tuple[str, ...]  # prints the signed-in identity as JSON
    install_fix: str
    login_fix: str
    identity_key: str = ""  # the login JSON is an object whose key names the identity ("": any non-empty JSON)

    def logged_in(self, out: str) -> bool:
        try:
            data = json.loads(out or "null")
        except ValueError:
            return False
        if self.identity_key:
            return isinstance(data, dict) and bool(data.get(self.identity_key))
        return bool(data)


LiveCheck = Callable[[Any, dict, Runner], Check]  # (plan, settings from terraform.tfvars, runner) -> Check


def q(value: Any) -> str:
    """One shell word: a fix line is pasted into a shell, and tfvars values are the user's text."""
    return shlex.quote(str(value))


def cli_json(run: Runner, argv: list[str]) -> Any:
    """The CLI's JSON answer, or None when it failed or printed something else."""
    code, out = run(argv)
    if code != 0:
        return None
    try:
        return json.loads(out)
    except ValueError:
        return None


def offered_in(s: dict, zones: list[str], kind: str, zone_hint: str) -> Check:
    """The live offering check from the zones the cloud lists for the plan's machine type."""
    if not zones:
        return Check("fail", "offered (live)", f"{s['instance']} is not offered in {s['region']}",
                     f"pick another region (--region) or {kind}")
    if s["zone"] and s["zone"] not in zones:
        return Check("fail", "offered (live)", f"{s['instance']} is offered in {', '.join(zones)}, not {s['zone']}",
                     zone_hint)
    return Check("ok", "offered (live)", f"{s['instance']} in {', '.join(zones)}")
