"""Issue 12's injection findings, each reproduced twice: the validator refuses the hostile value at
parse time (exit 2, one line), and the escaping wall holds if a value gets past it (a Plan built
without validation renders to the same Terraform blocks, YAML keys and shell commands as a
benign one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gpuprov.errors import GpuprovError
from injection_support import (
    PWNED, assert_one_line_error, bash_n, bundle_to, cli, run_launch, scripts, terraform_shape, yaml_files,
    key_tree,
)
from plan_fixtures import TINY_LLAMA_CONFIG, sample_plan

SHELL_PAYLOAD = f"10.0.0.9\ntouch {PWNED}\n$(touch {PWNED})`touch {PWNED}`'\"; touch {PWNED} #"
HCL_PAYLOAD = ('x")\n}\nresource "null_resource" "pwn" {\n  provisioner "local-exec" {\n'
               '    command = "touch pwned"\n  }\n}\nlocals { y = "${path.cwd}%{ if true }" }\n# ')
YAML_PAYLOAD = 'x"\nextra_key: [1]\n\u2028also: 1\n\x85- item\n# '


def _with_hosts(plan, addresses: list[str], names: list[str] | None = None):
    hosts = [h.model_copy(update={"address": a, **({"name": names[i]} if names else {})})
             for i, (h, a) in enumerate(zip(plan.hosts, addresses))]
    return plan.model_copy(update={"hosts": hosts, "spec": plan.spec.model_copy(update={"hosts": hosts})})


def _with_model(plan, display_name: str):
    return plan.model_copy(update={"model": plan.model.model_copy(update={"display_name": display_name})})


def _with_region(plan, region: str):
    return plan.model_copy(update={
        "spec": plan.spec.model_copy(update={"region": region}),
        "cluster": plan.cluster.model_copy(update={"region": region}),
        "instance": plan.instance.model_copy(update={"region": region})})


def _hosts_file(tmp_path: Path, entries: list[dict]) -> Path:
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump(entries))
    return path


# ---- 1: a host address with a newline ran a command from train.sh --------------------------------

def test_host_address_with_newline_is_refused(tmp_path: Path) -> None:
    hosts = _hosts_file(tmp_path, [{"name": "gpu0", "address": SHELL_PAYLOAD}])
    line = assert_one_line_error(*cli("generate", "--hosts", str(hosts), "-o", str(tmp_path / "out"))[::2])
    assert "address" in line and "host name" in line
    assert not (tmp_path / "out").exists()


def test_host_address_stays_quoted_in_launch_scripts(tmp_path: Path) -> None:
    plan = _with_hosts(sample_plan("onprem", nodes=2), [SHELL_PAYLOAD, "10.0.0.11"])
    root = bundle_to(tmp_path / "bundle", plan)
    for script in scripts(root):
        assert bash_n(script) == "", script
    argv = run_launch(root)
    assert not (root / PWNED).exists(), "a host address ran as a command"
    assert "10.0.0.9" in " ".join(argv)  # the payload is the head address, as data
    hosts = yaml.safe_load((root / "ansible" / "inventory.yml").read_text())["all"]["children"]["gpu_nodes"]["hosts"]
    assert hosts["gpu0"]["ansible_host"] == SHELL_PAYLOAD


# ---- 2: config.json `_name_or_path` (or its folder) reached first-line comments --------------------

def _config(tmp_path: Path, folder: str = "m", **extra) -> Path:
    path = tmp_path / folder / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**TINY_LLAMA_CONFIG, **extra}))
    return path


@pytest.mark.parametrize("name", [HCL_PAYLOAD, 7, ["a"], "a\u2028b", "tab\there"])
def test_bad_name_or_path_is_refused(tmp_path: Path, name: object) -> None:
    config = _config(tmp_path, _name_or_path=name)
    line = assert_one_line_error(*cli("plan", "--model", str(config))[::2])
    assert "_name_or_path" in line


def test_bad_folder_name_is_refused(tmp_path: Path) -> None:
    config = _config(tmp_path, folder="m\nresource")
    line = assert_one_line_error(*cli("plan", "--model", str(config.parent))[::2])
    assert "folder name" in line or "control character" in line


def test_display_name_stays_a_comment_in_terraform_and_yaml(tmp_path: Path) -> None:
    benign = sample_plan("aws", nodes=2)
    hostile = _with_model(benign, HCL_PAYLOAD + YAML_PAYLOAD)
    good, bad = bundle_to(tmp_path / "good", benign), bundle_to(tmp_path / "bad", hostile)
    assert terraform_shape(bad / "terraform") == terraform_shape(good / "terraform")
    assert {k: key_tree(v) for k, v in yaml_files(bad).items()} == {k: key_tree(v) for k, v in yaml_files(good).items()}
    first = (bad / "terraform" / "variables.tf").read_text().splitlines()[0]
    assert first.startswith("# Defaults come from the gpuprov plan (") and "null_resource" in first


# ---- 3: --region reached terraform.tfvars.example and comments ------------------------------------

@pytest.mark.parametrize("region", ['us-east-1"\nssh_cidr = "0.0.0.0/0', "us-east-1\n", "US-EAST-1", "eastus"])
def test_bad_region_is_refused(tmp_path: Path, region: str) -> None:
    line = assert_one_line_error(*cli("plan", "--cloud", "aws", "--region", region)[::2])
    assert line.startswith("gpuprov: error: --region: region ")


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure", "oci"])
def test_region_stays_a_value_in_tfvars(tmp_path: Path, cloud: str) -> None:
    benign = sample_plan(cloud, nodes=2)
    payload = 'r1"\nssh_cidr = "0.0.0.0/0"\n# ${x}'
    good = bundle_to(tmp_path / "good", benign)
    bad = bundle_to(tmp_path / "bad", _with_region(benign, payload))
    assert terraform_shape(bad / "terraform") == terraform_shape(good / "terraform")
    example = (bad / "terraform" / "terraform.tfvars.example").read_text()
    assert not any(line.startswith("ssh_cidr") for line in example.splitlines())


# ---- 4: host names YAML reads as non-strings lost their hosts -------------------------------------

NON_STRING_NAMES = ["yes", "null", "True", "0777", "1_000", "0x1F", "1.5", "on", "no", "1e3", "2024-01-01"]


def test_yaml_ambiguous_host_names_stay_strings(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("".join(f"- name: {json.dumps(n)}\n  address: 10.0.1.{i + 1}\n"
                             for i, n in enumerate(NON_STRING_NAMES)))
    code, out, err = cli("generate", "--hosts", str(hosts), "--max-nodes", "1", "-o", str(tmp_path / "out"))
    assert code == 0, err
    inventory = yaml.safe_load((tmp_path / "out" / "ansible" / "inventory.yml").read_text())
    listed = inventory["all"]["children"]["gpu_nodes"]["hosts"]
    assert all(isinstance(k, str) for k in listed), listed
    assert list(listed) == NON_STRING_NAMES[:len(listed)]


def test_unquoted_numeric_host_name_is_refused(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("0777: 10.0.0.1\ngpu1: 10.0.0.2\n")
    line = assert_one_line_error(*cli("plan", "--hosts", str(hosts))[::2])
    assert "quote it" in line


def test_yaml_ambiguous_host_names_in_a_rendered_inventory(tmp_path: Path) -> None:
    plan = sample_plan("onprem", nodes=2)
    plan = _with_hosts(plan, ["10.0.0.10", "10.0.0.11"], names=["yes", "0777"])
    root = bundle_to(tmp_path / "b", plan)
    listed = yaml.safe_load((root / "ansible" / "inventory.yml").read_text())["all"]["children"]["gpu_nodes"]["hosts"]
    assert list(listed) == ["yes", "0777"]


# ---- 7: config.json values silently misread --------------------------------------------------------

@pytest.mark.parametrize("key,value", [
    ("tie_word_embeddings", "false"), ("tie_word_embeddings", 0), ("mlp_bias", "yes"), ("attention_bias", 1),
    ("num_key_value_heads", 0), ("num_key_value_heads", {}), ("num_key_value_heads", -0.0),
    ("num_key_value_heads", 3), ("num_key_value_heads", 2.0), ("max_position_embeddings", 4096.5),
    ("max_position_embeddings", "4096"), ("hidden_size", True),
])
def test_config_values_are_strict(tmp_path: Path, key: str, value: object) -> None:
    from gpuprov.catalog.models import get_model

    config = _config(tmp_path, **{key: value})
    with pytest.raises(GpuprovError, match=key):
        get_model(str(config))


def test_config_null_kv_heads_means_multi_head(tmp_path: Path) -> None:
    from gpuprov.catalog.models import get_model

    arch = get_model(str(_config(tmp_path, num_key_value_heads=None)))
    assert arch.num_kv_heads == TINY_LLAMA_CONFIG["num_attention_heads"]


# ---- the other user strings: CIDR, reservation ids, users ---------------------------------------

@pytest.mark.parametrize("flag,value,word", [
    ("--ssh-cidr", "0.0.0.0/0\"\n", "ssh_cidr"), ("--ssh-cidr", "10.0.0.1/24", "host bits"),
    ("--ssh-cidr", "10.0.0.1", "prefix length"), ("--ssh-cidr", "300.1.1.0/24", "CIDR"),
    ("--capacity-reservation-id", "cr-123; rm", "capacity reservation id"),
    ("--reservation", "My_Reservation", "reservation"),
])
def test_other_user_strings_are_validated(flag: str, value: str, word: str) -> None:
    cloud = "gcp" if flag == "--reservation" else "aws"
    line = assert_one_line_error(*cli("plan", "--cloud", cloud, flag, value)[::2])
    assert word in line and flag in line


def test_valid_user_strings_pass() -> None:
    code, out, err = cli("plan", "--cloud", "aws", "--region", "us-west-2",
                         "--capacity-reservation-id", "cr-0123456789abcdef0", "--json")
    assert code == 0, err
    code, out, err = cli("plan", "--cloud", "azure", "--ssh-cidr", "203.0.113.0/24", "--json")
    assert code == 0, err
    assert json.loads(out)["spec"]["ssh_cidr"] == "203.0.113.0/24"


def test_aws_refuses_ssh_cidr_in_one_line() -> None:
    """AWS EFA nodes get no public address (one would limit them to one network interface): SSM
    reaches them, so --ssh-cidr is refused in one line, exit 2, never accepted and dropped."""
    from gpuprov.catalog import load_data

    assert load_data("bringup.yaml")["access"]["aws"]["no_public_address"]
    code, out, err = cli("plan", "--cloud", "aws", "--ssh-cidr", "203.0.113.0/24")
    line = assert_one_line_error(code, err)
    assert "--ssh-cidr" in line and "SSM" in line
