"""Bounded, seeded fuzzing of every user string (issue 12): a few hundred cases, well under a minute.

1. Through the CLI (in-process, so any uncaught exception fails the test): hostile values in every
   user-string field of a spec and a hosts file give exit 0 or a one-line exit 2, never a traceback
   or exit 1; a bundle that is written parses (Terraform loads, YAML loads, bash -n passes).
2. Past the validators (a Plan built without validation): hostile values in every user-string
   field render to the same Terraform resources/variables/locals, the same YAML keys and the same
   launch commands as a benign run; the launch scripts pass `bash -n` and running them creates no
   file (the payload stays quoted data).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st

from gpuprov.errors import GpuprovError
from gpuprov.render.ansible import copy_roles
from injection_support import (
    PWNED, bash_n, bundle_to, cli, key_tree, run_launch, scripts, terraform_shape, yaml_files,
)
from plan_fixtures import sample_plan

FRAGMENTS = [
    '"', "'", "`", "\\", "\n", "\r\n", "\t", "${", "%{", "}", "{", "[", "]", "#", ": ", "- ", "&a ", "*a",
    "$(touch " + PWNED + ")", "`touch " + PWNED + "`", "; touch " + PWNED + " #", "\ntouch " + PWNED + "\n",
    '")\n}\nresource "null_resource" "x" {}\n', "\u2028", "\u2029", "\x85", "\ufeff", "!!python/object:os.system ",
    "yes", "null", "0777", "1e3", "<<", "EOF", "*/", "/*", "<script>", "|", "\x7f", "é", "🙂",
    "us-east-1", "10.0.0.1", "203.0.113.0/24", "cr-0123456789abcdef0", "/", "..", "-",
]
payloads = st.lists(st.one_of(st.sampled_from(FRAGMENTS),
                              st.text(st.characters(blacklist_categories=("Cs",)), max_size=3)),
                    min_size=1, max_size=6).map("".join)
FAST = settings(deadline=None, derandomize=False, suppress_health_check=list(HealthCheck), database=None)
CLOUDS = ["aws", "gcp", "azure", "oci"]


# ---- 1. the CLI ----------------------------------------------------------------------------------

SPEC_FIELDS = ["region", "ssh_cidr", "capacity_reservation_id", "reservation", "model", "lora_targets", "gpus"]


def _check_bundle(root: Path) -> None:
    if (root / "terraform").is_dir() and any((root / "terraform").glob("*.tf")):
        terraform_shape(root / "terraform")  # loads, or the helper fails the test
    yaml_files(root)
    for script in scripts(root):
        assert bash_n(script) == "", script


@seed(12)
@settings(FAST, max_examples=200)
@given(field=st.sampled_from(SPEC_FIELDS + ["host_name", "host_address", "host_user"]), value=payloads,
       cloud=st.sampled_from(CLOUDS), write=st.integers(0, 9))
@example(field="host_address", value="10.0.0.1\ntouch " + PWNED, cloud="aws", write=0)
@example(field="host_name", value="yes", cloud="aws", write=0)
@example(field="region", value='us-east-1"\nssh_cidr = "0.0.0.0/0', cloud="aws", write=0)
def test_cli_hostile_values(field: str, value: str, cloud: str, write: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="gpuprov-fuzz-"))
    try:
        spec = {"model": "7b", "gpus": ["h100-80gb"], "max_nodes": 2}
        args = []
        if field.startswith("host_"):
            host = {"name": "gpu0", "address": "10.0.0.1", field.removeprefix("host_"): value}
            (work / "hosts.json").write_text(json.dumps([host]))
            args = ["--hosts", str(work / "hosts.json")]
        else:
            spec.update({"cloud": cloud, field: [value] if field == "gpus" else value})
        (work / "spec.yaml").write_text(json.dumps(spec))  # JSON is YAML: the value arrives exactly
        command = "generate" if write == 0 else "plan"
        out = ["-o", str(work / "out")] if command == "generate" else []
        code, _, err = cli(command, "-f", str(work / "spec.yaml"), *args, *out)
        assert code in (0, 2), (code, err)
        assert "Traceback" not in err
        if code == 2:
            assert len(err.strip().splitlines()) == 1, err
        elif command == "generate":
            _check_bundle(work / "out")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- 2. past the validators -----------------------------------------------------------------------

BENIGN = {"region": "us-east-1", "ssh_cidr": "203.0.113.0/24", "cr": "cr-0123456789abcdef0",
          "reservation": "my-res", "display": "Benign Model", "model": "/models/benign/config.json",
          "address": "10.0.0.10", "user": "ubuntu", "note": "a note", "dtype": "bfloat16", "name": "gpu0"}


def _inject(plan, values: dict[str, str]):
    """Every user-string field of the plan set from `values` (validation bypassed on purpose)."""
    hosts = [h.model_copy(update={"address": values["address"], "name": values["name"]} if i == 0 else {})
             .model_copy(update={"user": values["user"]}) for i, h in enumerate(plan.hosts or [])] or None
    spec = plan.spec.model_copy(update={
        "region": values["region"], "ssh_cidr": values["ssh_cidr"],
        "capacity_reservation_id": values["cr"], "reservation": values["reservation"], "model": values["model"],
        "hosts": hosts})
    model = plan.model.model_copy(update={
        "name": values["model"], "display_name": values["display"], "source": values["model"],
        "hf_config": {**plan.model.hf_config, "torch_dtype": values["dtype"]}})
    return plan.model_copy(update={
        "spec": spec, "hosts": hosts or plan.hosts, "model": model, "notes": [*plan.notes, values["note"]],
        "cluster": plan.cluster.model_copy(update={"region": values["region"]}),
        "instance": plan.instance.model_copy(update={"region": values["region"]})})


@lru_cache(maxsize=None)
def _roles() -> dict:
    return dict(copy_roles())


@lru_cache(maxsize=None)
def _benign(cloud: str) -> tuple:
    root = Path(tempfile.mkdtemp(prefix=f"gpuprov-benign-{cloud}-")) / "b"
    bundle_to(root, _inject(sample_plan(cloud, nodes=2), BENIGN))
    shape = terraform_shape(root / "terraform") if cloud != "onprem" else {}
    names = [h.name for h in _inject(sample_plan(cloud, nodes=2), BENIGN).hosts or []]
    return shape, _yaml_shapes(root, names), _launch_argv(root, cloud), _report_shape(root)


def _launch_argv(root: Path, cloud: str) -> list[str]:
    """The launcher's arguments, paths and the run id (a slug of the model name) masked."""
    argv = run_launch(root, GPUPROV_HEAD_ADDR="127.0.0.1")
    return ["RUN-ID" if i and argv[i - 1] == "--rdzv-id" else "PATH" if a.startswith("/") else a
            for i, a in enumerate(argv)]


def _report_shape(root: Path) -> tuple[list[str], list[str]]:
    """README.md's block structure (headings, list items, table rows) and topology.svg's elements."""
    import xml.etree.ElementTree as ET

    readme = (root / "README.md").read_text(encoding="utf-8").splitlines()
    blocks = [line.split(" ", 1)[0] if line.startswith(("#", "- ", "|")) else "text" if line else ""
              for line in readme]
    return blocks, [element.tag for element in ET.parse(root / "topology.svg").getroot().iter()]


def _yaml_shapes(root: Path, names: list[str]) -> dict[str, object]:
    """YAML key trees; the inventory's host keys must be exactly the host names, then are set aside."""
    loaded = yaml_files(root)
    inventory = loaded.get("ansible/inventory.yml")
    if inventory is not None:
        hosts = inventory["all"]["children"]["gpu_nodes"]["hosts"]
        assert list(hosts) == names
        inventory["all"]["children"]["gpu_nodes"]["hosts"] = list(hosts.values())
    return {k: key_tree(v) for k, v in loaded.items()}


@pytest.fixture(autouse=False)
def cached_roles(monkeypatch):
    monkeypatch.setattr("gpuprov.render.ansible.copy_roles", _roles)  # roles are copied verbatim


@seed(1212)
@settings(FAST, max_examples=50)
@given(cloud=st.sampled_from(CLOUDS + ["onprem"]),
       hostile=st.fixed_dictionaries({key: payloads for key in BENIGN}))
@pytest.mark.slow
def test_escaping_holds_past_the_validators(cached_roles, cloud: str, hostile: dict[str, str]) -> None:
    tf_shape, yaml_keys, argv, report = _benign(cloud)
    root = Path(tempfile.mkdtemp(prefix="gpuprov-fuzz-")) / "b"
    try:
        plan = _inject(sample_plan(cloud, nodes=2), hostile)
        try:
            bundle_to(root, plan)
        except GpuprovError as exc:  # a value no target language can hold (a NUL byte): refused, one line
            assert "\n" not in str(exc) and "\0" in "".join(hostile.values()), exc
            return
        if cloud != "onprem":
            assert terraform_shape(root / "terraform") == tf_shape
        assert _yaml_shapes(root, [h.name for h in plan.hosts or []]) == yaml_keys
        assert _report_shape(root) == report
        for script in scripts(root):
            assert bash_n(script) == "", script
        assert _launch_argv(root, cloud) == argv
        assert not (root / PWNED).exists() and not (root.parent / PWNED).exists()
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)
