"""Parse-time checks for every user string that can reach a rendered file, and the input limits.

Used by gpuprov/spec.py (pydantic AfterValidators: a ValueError becomes the field's one-line
error). Cloud name shapes are catalog data (catalog/data/input_patterns.yaml, with sources);
host addresses are IPs or RFC 1123 host names; CIDRs are parsed. The renderers still escape every
value for its target language (gpuprov/render/escape.py): validators keep output tidy, escaping
keeps it safe.
"""

from __future__ import annotations

import ipaddress
import re
import unicodedata
from functools import lru_cache

# Sanity bounds: far past any real run, low enough that arithmetic on them stays exact and fast
MAX_SEQ_LEN = 2**24  # 16M-token samples
MAX_BATCH_TOKENS = 2**36  # 64 Gi tokens per optimizer step (Llama 3 405B used 16M)
MAX_TOKENS = 10**16  # 10 quadrillion training tokens (Llama 3: 15.6T)
MAX_NODES = 100_000
MAX_GPUS = 2**24  # 16M GPUs; the largest training clusters hold ~10^5
MAX_HOSTS = 16_384  # 130k GPUs at 8 a node: past the largest clusters; bounds plan.json's validation time
MAX_LORA_RANK = 2**16
MAX_GPU_POWER_W = 5000  # W per GPU (B200 1,000 W; GB300 1,400 W)
MAX_CONFIG_COUNT = 2**24  # any config.json size field (Llama 3.1 405B: hidden 16,384, vocab 128,256)
MAX_PARAMS = 10**15  # a quadrillion parameters; the largest published models hold ~2 x 10^12
MAX_HOURS = 24 * 365 * 100  # a century
MAX_USD = 1e15
MAX_PATH_BYTES = 4096  # PATH_MAX on Linux
MAX_NAME_BYTES = 255  # NAME_MAX: one path component

HOST_NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$"
USER_PATTERN = "^[A-Za-z_][A-Za-z0-9_.-]{0,31}$"
SLUG_PATTERN = "^[A-Za-z0-9_][A-Za-z0-9_.,+ -]{0,127}$"
REGION_PATTERN = "^[a-z][a-z0-9-]{0,48}[a-z0-9]$"
# patterns kept as text: re compiles (and caches) each when a value of its kind is first checked, so a command
# pays only for the kinds it was given (compiling all of them cost every run about 6M instructions)
_HOST_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_INVENTORY_NAME = HOST_NAME_PATTERN.strip("^$")
_USER = USER_PATTERN.strip("^$")
_SLUG = SLUG_PATTERN.strip("^$")
_REGION_ANY = REGION_PATTERN.strip("^$")


@lru_cache(maxsize=1)
def patterns() -> dict:
    from gpuprov.catalog import load_data

    return load_data("input_patterns.yaml")


def _show(value: str) -> str:
    return repr(value[:60] + ("..." if len(value) > 60 else ""))


def _fullmatch(pattern: str, value: str) -> bool:
    return re.fullmatch(pattern, value) is not None


def host_name(value: str) -> str:
    """An inventory name: letters, digits, '.', '_', '-' (Ansible's hostname characters), <= 253."""
    if not re.fullmatch(_INVENTORY_NAME, value):
        raise ValueError(f"host name {_show(value)} must be letters, digits, '.', '_' or '-' "
                         "(starting with a letter or digit, at most 253)")
    return value


# an IPv6 zone id may name an interface only: `ipaddress` accepts any character in one (newlines,
# `$(...)`, `{{ }}`), and Ansible templates ansible_host. Linux interface names: IFNAMSIZ - 1 = 15.
_ZONE_ID = r"[A-Za-z0-9_.-]{1,15}"


def address(value: str) -> str:
    """An IPv4/IPv6 address (an IPv6 zone id only as an interface name) or an RFC 1123 host name."""
    if "%" in value:
        zone = value.partition("%")[2]
        if not re.fullmatch(_ZONE_ID, zone):
            raise ValueError(f"address {_show(value)}: an IPv6 zone id must be an interface name "
                             "(letters, digits, '.', '_', '-'; at most 15), e.g. fe80::1%eth0")
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        pass
    labels = value.removesuffix(".").split(".")
    if len(value) <= 253 and labels and all(re.fullmatch(_HOST_LABEL, label) for label in labels) \
            and not labels[-1].isdigit():
        return value
    raise ValueError(f"address {_show(value)} is neither an IP address nor an RFC 1123 host name")


def user_name(value: str) -> str:
    if not re.fullmatch(_USER, value):
        raise ValueError(f"user {_show(value)} is not a login name (letters, digits, '_', '.', '-'; at most 32)")
    return value


def slug(value: str) -> str:
    """A catalog name or comma list of names (GPU slugs, LoRA targets)."""
    if not re.fullmatch(_SLUG, value):
        raise ValueError(f"{_show(value)} is not a name (letters, digits, '.', '_', '-')")
    return value


def safe_text(value: str, what: str) -> None:
    """ValueError when `value` holds a control, format or line/paragraph separator character."""
    if value.isprintable():  # C speed: printable text holds none of those categories
        return
    bad = next((ch for ch in value if unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Zl", "Zp")), None)
    if bad is not None:
        raise ValueError(f"{what} {_show(value)} holds the control character U+{ord(bad):04X}")


def model_ref(value: str) -> str:
    """A preset name or a config.json path: printable, within the filesystem's limits."""
    if not value.strip():
        raise ValueError("model is empty; give a preset name (see `gpuprov models`) or a config.json path")
    safe_text(value, "model")
    if len(value.encode("utf-8")) > MAX_PATH_BYTES:
        raise ValueError(f"model path is longer than {MAX_PATH_BYTES} bytes")
    long = next((part for part in value.split("/") if len(part.encode("utf-8")) > MAX_NAME_BYTES), None)
    if long is not None:
        raise ValueError(f"model path component {_show(long)} is longer than {MAX_NAME_BYTES} bytes")
    return value


# Remote dataset sources the nodes read (`up` stages them on the cluster). Object keys are limited
# to the characters S3 calls safe (AWS "Creating object key names": alphanumerics and ! - _ . * ' ( ),
# less the shell-special ones, plus /, = and +); bucket and account names follow each store's rules.
DATASET_URIS = {
    "s3": r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/[A-Za-z0-9._/=+,@-]{1,1024}",
    "gs": r"gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]/[A-Za-z0-9._/=+,@-]{1,1024}",
    # az://ACCOUNT/CONTAINER/PATH: a blob of https://ACCOUNT.blob.core.windows.net/CONTAINER/PATH
    "az": r"az://[a-z0-9]{3,24}/[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62}/[A-Za-z0-9._/=+,@-]{1,1024}",
    # hf:ORG/NAME[:CONFIG]: a Hugging Face dataset (prepare_data.py --hf-dataset NAME[:CONFIG])
    "hf": r"hf:[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}(?::[A-Za-z0-9][A-Za-z0-9._-]{0,63})?",
}
_SCHEME = r"^([A-Za-z][A-Za-z0-9+.-]*):(//)?"


def dataset_scheme(value: str) -> str | None:
    """The remote store a dataset source names (s3, gs, az, hf), None for a local path or a count."""
    match = re.match(_SCHEME, value.strip())
    if match is None or (match.group(2) is None and match.group(1).lower() != "hf"):
        return None  # `C:` style or a plain name: a local path
    return match.group(1).lower()


def dataset_ref(value: str) -> str:
    """A token count, a data file path, or a remote source (s3://, gs://, az://, hf:ORG/NAME)."""
    if not value.strip():
        raise ValueError("dataset is empty; give a token count (100M), a file, or s3://, gs://, az:// or hf:ORG/NAME")
    safe_text(value, "dataset")
    if len(value.encode("utf-8")) > MAX_PATH_BYTES:
        raise ValueError(f"dataset path is longer than {MAX_PATH_BYTES} bytes")
    scheme = dataset_scheme(value)
    if scheme is None:
        return value
    pattern = DATASET_URIS.get(scheme)
    if pattern is None:
        raise ValueError(f"dataset {_show(value)}: {scheme}: is not a source gpuprov stages; give a local file, "
                         "s3://BUCKET/KEY, gs://BUCKET/OBJECT, az://ACCOUNT/CONTAINER/PATH or hf:ORG/NAME")
    if not re.fullmatch(pattern, value) or "//" in value.split("://", 1)[-1] or "/../" in value + "/" \
            or "/./" in value + "/":
        shape = {"s3": "s3://BUCKET/KEY", "gs": "gs://BUCKET/OBJECT", "az": "az://ACCOUNT/CONTAINER/PATH",
                 "hf": "hf:ORG/NAME[:CONFIG]"}[scheme]
        what = "" if scheme == "hf" else " (lower-case bucket, key of letters, digits and . _ / = + , @ -)"
        raise ValueError(f"dataset {_show(value)} is not {shape}{what}")
    return value


_DISPLAY_PUNCTUATION = set(" ._-/@+:,()[]=~")


def display_name(value: object, what: str) -> str:
    """A model's display name (config.json `_name_or_path`, a folder name): letters, digits and
    the punctuation model names and paths use; no quotes, `$`, braces, `<>`, `|`, `;`, `#`."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {type(value).__name__}")
    safe_text(value, what)
    bad = next((ch for ch in value if not (ch.isalnum() or ch in _DISPLAY_PUNCTUATION)), None)
    if bad is not None:
        raise ValueError(f"{what} {_show(value)} holds {bad!r}; use letters, digits and {''.join(sorted(_DISPLAY_PUNCTUATION))}")
    if not value.strip() or len(value) > 256:
        raise ValueError(f"{what} must be 1 to 256 characters")
    return value


def region(value: str) -> str:
    """Lowercase letters, digits and '-': what every cloud's region names share (per cloud: region_for)."""
    if not re.fullmatch(_REGION_ANY, value):
        raise ValueError(f"region {_show(value)} is not a region name (lowercase letters, digits, '-')")
    return value


def region_for(cloud: str, value: str) -> str | None:
    """Why `value` is not a region of `cloud` (None: it has the cloud's shape)."""
    entry = (patterns().get("regions") or {}).get(cloud)
    if entry is None or _fullmatch(entry["pattern"], value):
        return None
    return f"region {_show(value)} is not {'an' if cloud[0] in 'aeio' else 'a'} {cloud} region name (e.g. {entry['example']})"


def zone_for(cloud: str, value: str) -> tuple[str | None, str | None]:
    """(region of zone `value` on `cloud`, None) or (None, why it is not a zone there)."""
    entry = (patterns().get("zones") or {}).get(cloud)
    if entry is None:
        return None, f"zone: {cloud} takes no zone (only AWS and GCP reservations live in one)"
    if not _fullmatch(entry["pattern"], value):
        return None, f"zone {_show(value)} is not {'an' if cloud[0] in 'aeio' else 'a'} {cloud} zone name (e.g. {entry['example']})"
    return re.sub(entry["region_suffix"] + "$", "", value), None


def cidr(value: str) -> str:
    """An IPv4/IPv6 network; host bits set is an error (the cloud would reject or widen it)."""
    if "%" in value:  # ipaddress takes any text as an IPv6 zone id; a firewall rule has none
        raise ValueError(f"ssh_cidr {_show(value)} holds a zone id ('%'); give a CIDR block such as 203.0.113.0/24")
    if "/" not in value:
        raise ValueError(f"ssh_cidr {_show(value)} needs a prefix length, e.g. 203.0.113.0/24 (a /32 for one address)")
    try:
        return str(ipaddress.ip_network(value, strict=True))
    except ValueError as exc:
        message = str(exc)
        if "host bits set" in message:
            network = ipaddress.ip_network(value, strict=False)
            raise ValueError(f"ssh_cidr {_show(value)} has host bits set; did you mean {network}?") from None
        raise ValueError(f"ssh_cidr {_show(value)} is not a CIDR block such as 203.0.113.0/24") from None


def _catalog_pattern(key: str, value: str, what: str) -> str:
    entry = patterns()[key]
    if not _fullmatch(entry["pattern"], value):
        raise ValueError(f"{what} {_show(value)} does not look like one (e.g. {entry['example']})")
    return value


def aws_reservation_id(value: str) -> str:
    return _catalog_pattern("aws_capacity_reservation_id", value, "capacity reservation id")


def gcp_reservation(value: str) -> str:
    return _catalog_pattern("gcp_reservation", value, "GCP reservation name")


def nfs_export(value: str) -> str:
    if "/../" in value + "/" or "/./" in value + "/":
        raise ValueError(f"NFS export {_show(value)} has a . or .. path component")
    return _catalog_pattern("nfs_export", value, "NFS export")
