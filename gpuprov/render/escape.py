"""One escaping filter per target language: every value a template interpolates passes one.

Validators (gpuprov/spec.py) keep user strings to safe patterns at parse time; these filters are the
second wall, so a value that slips past a validator still lands as data, never as syntax:

- `hcl`: a Terraform literal; strings double-quoted with `${`/`%{` kept literal.
- `yaml`: a YAML scalar (JSON flow style, which YAML 1.1 and 1.2 readers both load exactly).
- `shq`: one shell word (POSIX single quotes where needed).
- `comment`: text for a `#` line comment in any of them: one line, printable characters only.
- `md`: Markdown text (a README line or table cell); `md_code`: a code span.
- `svg`: XML character data or a double-quoted attribute value.

ESCAPING_FILTERS names them for tests/test_template_escaping.py, which fails when a template
interpolates a user-derived value (USER_VALUES) without one.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import unicodedata

from gpuprov.errors import GpuprovError, clip

# context names and Plan paths whose strings come from the user (spec, hosts file, config.json)
USER_VALUES: tuple[str, ...] = (
    "plan.spec", "plan.hosts", "plan.model.name", "plan.model.display_name", "plan.model.source",
    "plan.model.hf_config", "plan.cluster.region", "plan.instance.region", "plan.notes",
    # terraform context
    "plan_summary", "region", "ssh_cidr", "capacity_reservation_id", "reservation_name",
    # launch context
    "plan_hosts", "checkpoint_dir", "metrics_file", "flight_recorder_dir", "job_dir", "log_dir",
    "lora_targets",
    # ansible context
    "hosts_left_out", "host",
)
# context values built from user input but reduced to [a-z0-9-] by the renderer: safe anywhere
SLUG_VALUES: tuple[str, ...] = ("run_id", "name_prefix", "tags")
ESCAPING_FILTERS: frozenset[str] = frozenset({"hcl", "yaml", "y", "shq", "comment", "oneline", "md", "svg"})

COMMENT_LIMIT = 200


def _reject_surrogates(text: str, what: str) -> None:
    if any(0xD800 <= ord(ch) <= 0xDFFF for ch in text):
        raise GpuprovError(f"{what}: {text[:40]!r} holds a lone surrogate (not valid Unicode text)")


def _unsafe_char(ch: str) -> bool:
    """Control, format, separator-line/paragraph, surrogate or unassigned: never raw in a file."""
    return unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn")


def _all_safe(text: str) -> bool:
    """True when no character of `text` is unsafe, in one C-speed pass: str.isprintable() is False for every
    character of the "Other" and "Separator" categories but the space, so a printable text holds none of the
    unsafe ones (tests/test_template_escaping.py checks every code point); others are looked at one by one."""
    return text.isprintable()


# ---------------------------------------------------------------- HCL

def hcl_string(text: str) -> str:
    """A double-quoted HCL string: quotes, backslashes and controls escaped, templates literal."""
    _reject_surrogates(text, "Terraform value")
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif _unsafe_char(ch):
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
        else:
            out.append(ch)
    return '"' + "".join(out).replace("${", "$${").replace("%{", "%%{") + '"'


def hcl(value: object) -> str:
    """A Python value as an HCL literal."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else "null"
    if isinstance(value, str):
        return hcl_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(hcl(v) for v in value) + "]"
    if isinstance(value, dict):
        if not value:
            return "{}"
        keys = [hcl_string(str(k)) for k in value]
        width = max(len(k) for k in keys)
        rows = "".join(f"\n    {k.ljust(width)} = {hcl(v)}" for k, v in zip(keys, value.values()))
        return "{" + rows + "\n  }"
    raise TypeError(f"no HCL literal for {type(value).__name__}")


# ---------------------------------------------------------------- YAML

def _yaml_printable(ch: str) -> bool:
    """YAML's printable set, minus what a YAML 1.1 reader takes as a line break (NEL, LS, PS)."""
    code = ord(ch)
    return (0x20 <= code <= 0x7E or 0xA0 <= code <= 0xD7FF or 0xE000 <= code <= 0xFFFD or code >= 0x10000) \
        and code not in (0x2028, 0x2029, 0xFEFF)


def yaml_string(text: str) -> str:
    """A double-quoted YAML scalar that PyYAML and ruamel read back as exactly `text`."""
    _reject_surrogates(text, "YAML value")
    body = json.dumps(text, ensure_ascii=False)[1:-1]
    return '"' + "".join(ch if _yaml_printable(ch) or ch in "\\" else
                         (f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
                         for ch in body) + '"'


def yaml_scalar(value: object) -> str:
    """A str/int/float/bool/None as one YAML flow scalar (JSON style)."""
    if isinstance(value, str):
        return yaml_string(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise GpuprovError(f"cannot write a non-finite number ({value}) to YAML")
    if value is None or isinstance(value, (bool, int, float)):
        return json.dumps(value)
    return yaml_string(str(value))


def yaml_flow(value: object) -> str:
    """Any JSON-like value in YAML flow style, every string through yaml_string."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{yaml_string(str(k))}: {yaml_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_flow(v) for v in value) + "]"
    return yaml_scalar(value)


# ---------------------------------------------------------------- shell

def shell_word(value: object) -> str:
    """One shell word that expands to exactly str(value)."""
    text = str(value)
    _reject_surrogates(text, "shell value")
    if "\0" in text:
        raise GpuprovError(f"shell value {text[:40]!r} holds a NUL byte")
    return shlex.quote(text)


# ---------------------------------------------------------------- comments (HCL, YAML, shell: `#` to end of line)

def comment(value: object, limit: int = COMMENT_LIMIT) -> str:
    """Text safe after `#`: one line, unsafe characters as '?', whitespace runs as one space."""
    text = str(value)
    if not _all_safe(text):
        text = "".join("?" if _unsafe_char(ch) and not ch.isspace() else ch for ch in text)
    return clip(" ".join(text.split()), limit)


# ---------------------------------------------------------------- Markdown

_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|~&#!])")


def md(value: object) -> str:
    """Markdown text for a line or table cell: one line, markup characters backslash-escaped."""
    return _MD_SPECIAL.sub(r"\\\1", comment(value, limit=10_000))


def md_code(value: object) -> str:
    """A Markdown code span holding `value` literally (fence longer than any backtick run inside)."""
    text = comment(value, limit=10_000)
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


# ---------------------------------------------------------------- SVG (XML 1.0)

def svg(value: object) -> str:
    """XML character data / attribute value: &, <, >, quotes escaped; characters XML forbids as '?'."""
    text = str(value)
    if not _all_safe(text):
        text = "".join("?" if _unsafe_char(ch) and ch not in "\t" else ch for ch in text)
    return (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;").replace("'", "&#39;"))


FILTERS = {"hcl": hcl, "yaml": yaml_flow, "shq": shell_word, "comment": comment, "oneline": comment,
           "md": md, "svg": svg}
