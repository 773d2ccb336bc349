"""validate, check, status and `up --dry-run` on a bundle nobody trusts (issue 39).

The rule: these commands execute nothing from the bundle and let nothing in it configure the tools
they call. Each attack below plants a program that would create a marker file; the marker proves
whether anything ran. One generated bundle is shared; each case edits its own copy.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from gpuprov import bundle
from gpuprov.commands import gitops
from injection_support import assert_one_line_error, cli

HAVE_ANSIBLE = gitops._find_tool("ansible-playbook") is not None
needs_ansible = pytest.mark.skipif(not HAVE_ANSIBLE, reason="ansible-core is not installed")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "b"
    code, _, err = cli("generate", "--model", "70b", "-o", str(root))
    assert code == 0, err
    # a job `up` recorded, so status goes past "no job" to what it reads from the bundle
    (root / bundle.UP_STATE_NAME).write_text(json.dumps({"job": {"id": "4242"}}) + "\n")
    return root


@pytest.fixture()
def copy(pristine: Path, tmp_path: Path) -> Path:
    root = tmp_path / "b"
    shutil.copytree(pristine, root, symlinks=True)
    return root


def _program(path: Path, marker: Path) -> None:
    """An executable that leaves `marker` when anything runs it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\ntouch {marker}\necho secret\n")
    path.chmod(0o755)


def _python_plugin(path: Path, marker: Path) -> None:
    """A Python file that leaves `marker` when imported (a plugin, module or collection file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")


def _refused(code: int, err: str) -> str:
    """Exit 2 with one error line (a `note:` on edited files may come before it), no traceback."""
    assert code == 2 and "Traceback" not in err, (code, err)
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("note: ")]
    assert len(lines) == 1, err
    return lines[0]


def _rows(output: str) -> dict[str, str]:
    return {line[6:23].strip(): line[:4].strip() for line in output.splitlines() if line[:4] in ("ok  ", "fail", "skip", "n/a ")}


# ---------------------------------------------------------------- 1. configs naming programs

def _hostile_ansible(root: Path, marker: Path) -> None:
    """Every way a bundle could configure Ansible to run a program of its own."""
    ansible = root / "ansible"
    _program(root / "terraform" / "terraform.tfstate.pw", marker)  # a name the default keep list covers
    cfg = (ansible / "ansible.cfg").read_text().replace("[defaults]\n", (
        "[defaults]\nvault_password_file = ../terraform/terraform.tfstate.pw\n"
        "callback_plugins = ./cb\ncallbacks_enabled = evil\nstdout_callback = evil\n"
        "library = ./lib\nfilter_plugins = ./fp\nlookup_plugins = ./lp\nvars_plugins = ./vp\n"
        "inventory_plugins = ./ip\nstrategy_plugins = ./sp\nstrategy = evil\n"
        "collections_path = ./coll\n"), 1) + "\n[inventory]\nenable_plugins = evil, script, yaml\n"
    (ansible / "ansible.cfg").write_text(cfg)
    for folder, name in (("cb", "evil.py"), ("lib", "evil.py"), ("fp", "evil.py"), ("lp", "evil.py"),
                         ("vp", "evil.py"), ("ip", "evil.py"), ("sp", "evil.py"),
                         ("callback_plugins", "evil.py"), ("filter_plugins", "evil.py"),
                         ("lookup_plugins", "evil.py"), ("vars_plugins", "evil.py"), ("library", "evil.py"),
                         ("test_plugins", "evil.py"), ("module_utils", "evil.py"),
                         ("roles/nccl/filter_plugins", "evil.py"), ("roles/nccl/library", "evil.py"),
                         ("collections/ansible_collections/evil/x/plugins/filter", "evil.py")):
        _python_plugin(ansible / folder / name, marker)
    (ansible / "collections/ansible_collections/evil/x/__init__.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    # an executable inventory is a script Ansible runs; group_vars and host_vars hold lookups
    _program(ansible / "inventory.yml", marker)
    with open(ansible / "group_vars" / "all.yml", "a") as handle:
        handle.write(f"evil: \"{{{{ lookup('pipe', 'touch {marker}') }}}}\"\n")
    (ansible / "host_vars").mkdir()
    (ansible / "host_vars" / "node0.yml").write_text(f"evil: \"{{{{ lookup('pipe', 'touch {marker}') }}}}\"\n")


def _hostile_terraform(root: Path, marker: Path) -> None:
    terraform = root / "terraform"
    _program(terraform / ".terraform" / "providers" / "evil", marker)
    (terraform / ".terraformrc").write_text('provider_installation {\n  dev_overrides {\n'
                                            f'    "hashicorp/aws" = "{terraform / ".terraform" / "providers"}"\n  }}\n}}\n')
    _program(terraform / "terraform.d" / "plugins" / "registry.terraform.io" / "hashicorp" / "aws" / "9.9.9"
             / "linux_amd64" / "terraform-provider-aws", marker)
    (terraform / ".terraform" / "terraform.tfstate").write_text(json.dumps(
        {"version": 3, "backend": {"type": "http", "config": {"address": "http://127.0.0.1:9/"}}}))


@needs_ansible
def test_validate_takes_no_setting_or_program_from_the_bundle(copy: Path, tmp_path: Path, monkeypatch) -> None:
    marker = tmp_path / "ran"
    _hostile_ansible(copy, marker)
    _hostile_terraform(copy, marker)
    monkeypatch.setenv("TF_CLI_CONFIG_FILE", str(copy / "terraform" / ".terraformrc"))  # even if a CI job set one
    code, out, err = cli("validate", str(copy), "--offline")
    assert not marker.exists(), out + err
    rows = _rows(out)
    assert rows["ansible syntax"] == "ok", out  # the check ran, on the playbooks, with gpuprov's config
    assert rows["added files"] == "fail" and code == 1, out  # the planted plugin folders are drift


@needs_ansible
def test_validate_runs_no_lookup_a_playbook_names(copy: Path, tmp_path: Path) -> None:
    """A syntax check templates role and import names: a lookup there would run a program."""
    marker = tmp_path / "ran"
    site = copy / "ansible" / "site.yml"
    site.write_text(site.read_text().replace(
        "- role: gpu_preflight", f"- role: \"{{{{ lookup('pipe', 'touch {marker}') }}}}gpu_preflight\"", 1))
    code, out, _ = cli("validate", str(copy), "--offline")
    assert not marker.exists()
    assert _rows(out)["ansible syntax"] == "fail" and "refused" in out and code == 1


def test_validate_runs_terraform_outside_the_bundle_with_its_own_config(copy: Path, tmp_path: Path,
                                                                      monkeypatch) -> None:
    """Whatever Terraform is installed gets a folder with the bundle's .tf files only, an empty CLI
    config and a data folder of gpuprov's: no .terraformrc, plugin folder or backend of the bundle."""
    record = tmp_path / "record.jsonl"
    fake = tmp_path / "bin" / "terraform"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"open({str(record)!r}, 'a').write(json.dumps({{'argv': sys.argv[1:], 'cwd': os.getcwd(), "
                    "'files': sorted(os.listdir('.')), 'env': {k: v for k, v in os.environ.items() "
                    "if k.startswith('TF_')}}) + '\\n')\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("TF_CLI_CONFIG_FILE", str(copy / "terraform" / ".terraformrc"))
    monkeypatch.setenv("TF_PLUGIN_CACHE_DIR", str(copy / "terraform" / "terraform.d"))
    _hostile_terraform(copy, tmp_path / "ran")
    for check in (gitops.check_terraform_fmt, gitops.check_terraform_config):
        assert check(copy.absolute())[0] == "ok"
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert [c["argv"][0] for c in calls] == ["fmt", "providers"]
    for call in calls:
        assert not Path(call["cwd"]).resolve().is_relative_to(copy.resolve())
        assert {".terraform", "terraform.d", ".terraformrc"}.isdisjoint(call["files"]) and "main.tf" in call["files"]
        assert set(call["env"]) >= {"TF_CLI_CONFIG_FILE", "TF_DATA_DIR"} and "TF_PLUGIN_CACHE_DIR" not in call["env"]
        assert Path(call["env"]["TF_CLI_CONFIG_FILE"]).read_text() == "" if Path(call["env"]["TF_CLI_CONFIG_FILE"]).exists() else True
        assert not any(str(copy) in v for v in call["env"].values())


# ---------------------------------------------------------------- 2. keep patterns never hide code

LOADABLE = ["terraform/terraform.tfstate.backup.tf", "terraform/terraform.tfstate.x.backup.tf",
            "terraform/terraform.tfstate.tf.json", "terraform/x.auto.tfvars", "terraform/terraform.tfvars.json",
            "terraform/terraform.d/plugins/p", "terraform/tfplan.tf", "ansible/x.retry.yml", "ansible/ansible.cfg",
            "ansible/inventory.yml.j2", "ansible/library/evil", "ansible/filter_plugins/evil.py",
            "ansible/roles/x/tasks/main.yml", "launch/train.sh", "launch/evil"]


@pytest.mark.parametrize("path", LOADABLE)
def test_no_keep_pattern_keeps_a_loadable_file(path: str) -> None:
    assert bundle.is_loadable(path)
    legacy = ["terraform/.terraform/*", "terraform/terraform.tfstate.*", "ansible/*.retry"]
    assert not bundle.is_kept(path, bundle.USER_FILES)
    assert not bundle.is_kept(path, bundle.lock_keep({"keep": legacy}))  # a lock of an earlier version


@pytest.mark.parametrize("path", ["terraform/terraform.tfstate.backup", "terraform/terraform.tfstate.1700000000.backup",
                                  "terraform/.terraform/providers/registry.terraform.io/hashicorp/aws/6.0.0/linux_amd64/p",
                                  "terraform/tfplan", "ansible/site.retry", "ansible/inventory.yml"])
def test_default_patterns_keep_what_terraform_and_up_write(path: str) -> None:
    assert bundle.is_kept(path, bundle.USER_FILES)


def test_keep_patterns_match_path_segments() -> None:
    assert bundle.keep_matches("ansible/site.retry", "ansible/*.retry")
    assert not bundle.keep_matches("ansible/roles/site.retry", "ansible/*.retry")  # `*` never crosses /
    assert bundle.keep_matches("terraform/.terraform/a/b/c", "terraform/.terraform/**")
    assert not bundle.keep_matches("terraform/terraform.tfstate.backup.tf", "terraform/terraform.tfstate.*.backup")


def test_a_tf_named_like_a_state_backup_is_drift(copy: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (copy / "terraform" / "terraform.tfstate.backup.tf").write_text(
        f'resource "terraform_data" "x" {{\n  provisioner "local-exec" {{\n    command = "touch {marker}"\n  }}\n}}\n')
    code, out, _ = cli("check", str(copy))
    assert code == 1 and "added   " in out and "terraform/terraform.tfstate.backup.tf" in out
    status, detail = gitops.check_added(copy)
    assert status == "fail" and "terraform.tfstate.backup.tf" in detail
    assert not marker.exists()


# ---------------------------------------------------------------- 4. catch-alls


@pytest.mark.parametrize("command", [["validate", "--offline"], ["check"], ["up", "--dry-run"], ["status"]])
def test_nul_byte_in_a_lock_path_is_one_line(copy: Path, command: list[str]) -> None:
    lock = json.loads((copy / bundle.LOCK_NAME).read_text())
    lock["files"]["ansible/x\0y"] = "0" * 64
    (copy / bundle.LOCK_NAME).write_text(json.dumps(lock))
    line = assert_one_line_error(*cli(command[0], str(copy), *command[1:])[::2])
    assert "files lists" in line


@pytest.mark.parametrize("entry", [("../outside", "0" * 64), ("/etc/passwd", "0" * 64), ("a/./b", "0" * 64),
                                   ("ansible/site.yml", "not a digest"), ("ansible/x\ny", "0" * 64)])
def test_lock_file_list_is_validated(copy: Path, entry: tuple[str, str]) -> None:
    lock = json.loads((copy / bundle.LOCK_NAME).read_text())
    lock["files"][entry[0]] = entry[1]
    (copy / bundle.LOCK_NAME).write_text(json.dumps(lock))
    assert_one_line_error(*cli("check", str(copy))[::2])


_PROBE = ("### nvidia-smi\n" + "NVIDIA H100 80GB HBM3, 81559\n" * 8 + "### free\nMem: {ram} 0\n"
          "### lscpu\nCore(s) per socket: {cores}\nSocket(s): 2\n### nproc\n192\n### lsblk\n{{\"blockdevices\": []}}\n"
          "### ip\n1: eth0: <UP> state UP\n### speed\n/sys/class/net/eth0/speed {speed}\n### ibstat\n")


@pytest.mark.parametrize("values", [{"ram": "9" * 400}, {"ram": "9" * 25}, {"cores": "9" * 30}, {"speed": "9" * 40},
                                    {"ram": "2151706738688\0"}])
def test_hosts_probe_with_absurd_figures_is_one_line(tmp_path: Path, monkeypatch, values: dict) -> None:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("- {name: gpu0, address: 10.0.0.1}\n")
    output = _PROBE.format(**{"ram": "2151706738688", "cores": "48", "speed": "100000", **values})
    monkeypatch.setattr("gpuprov.commands.hosts._ssh", lambda host, script, timeout: output)
    line = assert_one_line_error(*cli("hosts", "probe", str(hosts))[::2])
    assert "gpu0" in line


def test_hosts_probe_with_sane_figures_still_fills_the_file(tmp_path: Path, monkeypatch) -> None:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("- {name: gpu0, address: 10.0.0.1}\n")
    output = _PROBE.format(ram="2151706738688", cores="48", speed="100000")
    monkeypatch.setattr("gpuprov.commands.hosts._ssh", lambda host, script, timeout: output)
    code, out, err = cli("hosts", "probe", str(hosts))
    assert code == 0, err
    assert "ram_gib: 2004" in out and "cores: 96" in out and "nic_gbps: 100" in out


# ---------------------------------------------------------------- 3. one YAML pass


def test_a_spec_is_parsed_in_one_yaml_pass(tmp_path: Path, monkeypatch) -> None:
    from gpuprov import specfile, yamlload

    calls = []

    class Counted(yamlload._PARSER):  # one parser per YAML pass
        def __init__(self, *args):
            calls.append(1)
            super().__init__(*args)

    monkeypatch.setattr(yamlload, "_PARSER", Counted)
    spec = tmp_path / "gpuprov.yaml"
    spec.write_text("model: 70b\ntokens: 20B\nhosts:\n  - {name: gpu0, address: 10.0.0.1}\n")
    data, _ = specfile.load_spec_data(spec)
    assert data["tokens"] == 20 * 10**9 and len(calls) == 1
    calls.clear()
    (tmp_path / "hosts.yaml").write_text("- {name: gpu0, address: 10.0.0.1}\n- {name: gpu1, address: 10.0.0.2}\n")
    assert [h.name for h in specfile.load_hosts(tmp_path / "hosts.yaml")] == ["gpu0", "gpu1"] and len(calls) == 1


@pytest.mark.parametrize("text, message", [
    ("model: 70b\ntokens: 1B\nmodel: 8b\n", ":3: duplicate key 'model'"),
    ("model: 70b\n" * 1000, ":2: duplicate key 'model'"),
    ("a: &x {b: 1}\nmodel: 70b\nc:\n  <<: *x\n  b: 2\n  d: 1\n  d: 2\n", ":7: duplicate key 'd'"),
])
def test_a_duplicate_key_is_refused_with_its_line(tmp_path: Path, text: str, message: str) -> None:
    spec = tmp_path / "gpuprov.yaml"
    spec.write_text(text)
    assert message in assert_one_line_error(*cli("plan", "-f", str(spec))[::2])


@pytest.mark.parametrize("text, value", [("0777", 777), ("yes", "yes"), ("0x1F", 31), ("1_000", 1000), ("~", None),
                                         ("1e3", 1000.0), ("'1'", "1"), ("!!str 12", "12"), ("-.inf", float("-inf")),
                                         ("True", True), ("0o17", 15), ("2001-12-14", "2001-12-14")])
def test_scalars_resolve_by_the_yaml_1_2_core_schema(text: str, value) -> None:
    from gpuprov.yamlload import load

    assert load(f"k: {text}\n", max_depth=8, max_values=10)["k"] == value


def test_merge_keys_and_line_numbers(tmp_path: Path) -> None:
    from gpuprov.yamlload import load

    tree = load("base: &b {x: 1, y: 2}\nitem:\n  <<: *b\n  y: 3\nlist:\n  - a\n  - b\n", max_depth=8, max_values=100)
    assert tree["item"] == {"x": 1, "y": 3}
    assert tree.lc.key("list") == (4, 0) and tree["list"].lc.item(1) == (6, 4)


# ---------------------------------------------------------------- 5. status


def test_status_refuses_a_templated_metrics_file(copy: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    train = copy / "launch" / "train.yaml"
    text = train.read_text()
    start = text.index("metrics_file: ") + len("metrics_file: ")
    end = text.index("\n", start)
    train.write_text(text[:start] + f"\"/x/{{{{ lookup('pipe', 'touch {marker}') }}}}\"" + text[end:])
    line = _refused(*cli("status", str(copy))[::2])
    assert "metrics_file" in line and not marker.exists()


def test_status_takes_only_connection_settings_from_the_inventory(copy: Path) -> None:
    inventory = copy / "ansible" / "inventory.yml"
    for setting in ("ansible_shell_executable: /bin/sh", "ansible_become_exe: /tmp/x",
                    "ansible_connection: community.general.evil",
                    "ansible_python_interpreter: \"touch /tmp/x; python3\"",
                    f"ansible_python_interpreter: {copy / 'launch' / 'train.sh'}",
                    "ansible_user: \"-oProxyCommand=touch x\""):
        inventory.write_text("all:\n  children:\n    gpu_nodes:\n      hosts:\n        node0:\n"
                             f"          ansible_host: 10.0.0.1\n          {setting}\n")
        line = _refused(*cli("status", str(copy))[::2])
        assert setting.split(":")[0] in line
    inventory.write_text("all:\n  children:\n    gpu_nodes:\n      hosts:\n        node0:\n"
                         "          ansible_host: \"{{ lookup('pipe', 'id') }}\"\n")
    assert "Jinja" in _refused(*cli("status", str(copy))[::2])


@pytest.mark.skipif(gitops._find_tool("ansible") is None, reason="ansible-core is not installed")
def test_status_runs_ansible_with_gpuprov_config_and_no_lookup(copy: Path, tmp_path: Path, monkeypatch) -> None:
    """A real ad-hoc run on this machine (a local connection, which only a test can give): the
    bundle's ansible.cfg names a vault password program and the script holds a lookup; neither runs."""
    from gpuprov.commands import status
    from gpuprov.commands.up import _load

    marker = tmp_path / "ran"
    _hostile_ansible(copy, marker)
    _, plan = _load(str(copy))
    local = {"all": {"children": {"gpu_nodes": {"hosts": {"node0": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}}}
    monkeypatch.chdir(copy / "ansible")  # even started from inside the bundle
    proc = status._adhoc(plan, local, "echo reached")
    assert proc.returncode == 0 and "reached" in proc.stdout, proc.stdout + proc.stderr
    proc = status._adhoc(plan, local, f"echo {{{{ lookup('pipe', 'touch {marker}') }}}}")
    assert proc.returncode != 0 and "refused" in proc.stdout + proc.stderr
    assert not marker.exists()


# ---------------------------------------------------------------- the corpus


def _symlink(path: Path, marker: Path) -> None:
    path.unlink()
    path.symlink_to("/etc/hostname")


def _huge(path: Path, marker: Path) -> None:
    with open(path, "wb") as handle:
        handle.truncate(bundle_limit() + 1)


def bundle_limit() -> int:
    from gpuprov.safefile import MAX_BUNDLE_BYTES

    return MAX_BUNDLE_BYTES


def _binary(path: Path, marker: Path) -> None:
    path.write_bytes(b"\x7fELF\x00\x01\xff\xfe" + os.urandom(64))


def _program_at(path: Path, marker: Path) -> None:
    _program(path, marker)


EDITS = {"symlink": _symlink, "huge": _huge, "binary": _binary, "program": _program_at}
# one file of every kind the bundle holds, and every file gpuprov itself reads
TARGETS = ["gpuprov.lock", "plan.json", "README.md", "terraform/main.tf", "terraform/versions.tf",
           "ansible/ansible.cfg", "ansible/site.yml", "ansible/group_vars/all.yml",
           "ansible/roles/nccl/tasks/main.yml", "ansible/roles/nccl/templates/nccl.conf.j2",
           "ansible/roles/healthcheck/files/allreduce_bench.py", "launch/train.yaml", "launch/train.sh",
           bundle.UP_STATE_NAME]
# files added where each default keep pattern matches, with a name a tool would load
ADDED = ["terraform/terraform.tfstate.backup.tf", "terraform/terraform.tfstate.1.backup.tf.json",
         "terraform/tfplan.auto.tfvars", "terraform/.terraform.tfstate.lock.info.tf",
         "terraform/terraform.d/plugins/x", "ansible/x.retry.yml", "ansible/inventory.yml.d/evil.yml",
         "ansible/library/evil.py", "launch/evil.sh"]
COMMANDS = [["check"], ["up", "--dry-run"], ["status", "--local"], ["status"]]


def _run_all(root: Path, marker: Path, commands=COMMANDS) -> list[tuple[int, str, str]]:
    results = []
    for command in commands:
        code, out, err = cli(command[0], str(root), *command[1:])
        assert "Traceback" not in err and "unexpected" not in err, (command, err)
        assert code in (0, 1, 2), (command, code)
        assert not marker.exists(), command
        results.append((code, out, err))
    return results


@pytest.mark.slow  # 56 cases, each regenerating the bundle for check (~40 s)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_corpus_edited_file(copy: Path, tmp_path: Path, target: str, edit: str, monkeypatch) -> None:
    marker = tmp_path / "ran"
    monkeypatch.setattr("gpuprov.commands.status._adhoc", _no_network)
    EDITS[edit](copy / target, marker)
    results = _run_all(copy, marker)
    if target != bundle.UP_STATE_NAME:
        assert results[0][0] in (1, 2)  # check: drift or a refusal, never "in sync"


@pytest.mark.parametrize("added", ADDED)
def test_corpus_added_loadable_file_is_drift(copy: Path, tmp_path: Path, added: str, monkeypatch) -> None:
    marker = tmp_path / "ran"
    monkeypatch.setattr("gpuprov.commands.status._adhoc", _no_network)
    _program(copy / added, marker)
    results = _run_all(copy, marker)
    assert results[0][0] == 1 and added in results[0][1]
    assert gitops.check_added(copy)[0] == "fail"


@needs_ansible
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_corpus_validate_on_edited_tool_files(copy: Path, tmp_path: Path, edit: str) -> None:
    """validate runs the real tools: on each kind of damage to the files they read, nothing runs."""
    marker = tmp_path / "ran"
    for target in ("ansible/ansible.cfg", "ansible/roles/nccl/tasks/main.yml", "terraform/versions.tf"):
        EDITS[edit](copy / target, marker)
    code, out, err = cli("validate", str(copy), "--offline")
    assert "Traceback" not in err and code in (1, 2), out + err
    assert not marker.exists()


def _no_network(plan, inventory, script):
    raise AssertionError("status got past its checks to the network on a tampered bundle")


def test_up_runs_only_the_generated_ansible_cfg(copy: Path, tmp_path: Path, monkeypatch) -> None:
    """`up` (no dry run) may use the bundle's ansible.cfg only when it is the generated one."""
    ran = []
    monkeypatch.setattr("gpuprov.commands.up.bring_up", lambda *a, **k: ran.append(k))
    code, _, err = cli("up", str(copy))
    assert code == 0 and len(ran) == 1, err
    _hostile_ansible(copy, tmp_path / "ran")
    line = _refused(*cli("up", str(copy))[::2])
    assert "ansible.cfg" in line and len(ran) == 1
    assert cli("up", str(copy), "--dry-run")[0] == 0 and len(ran) == 2  # a dry run runs nothing


def test_plan_json_reads_the_same_through_python_data(pristine: Path) -> None:
    from gpuprov.plan import Plan

    text = (pristine / bundle.PLAN_NAME).read_text()
    assert bundle.parse_plan(text) == Plan.model_validate_json(text)


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"spec": {"hosts": ['
                                  + ",".join(['{"name": "a", "address": "10.0.0.1"}'] * 20_000) + "]}}"])
def test_hostile_plan_json_is_one_line(copy: Path, text: str) -> None:
    (copy / bundle.PLAN_NAME).write_text(text)
    assert "plan.json" in _refused(*cli("up", str(copy), "--dry-run")[::2])
    assert gitops.check_plan(copy)[0] == "fail"


def test_status_reads_the_connection_of_the_inventory_up_writes(copy: Path) -> None:
    from gpuprov.commands.status import _inventory

    (copy / "ansible" / "inventory.yml").write_text(
        "# written by `gpuprov up` from `terraform output ansible_inventory`\nall:\n  vars:\n    ansible_user: ubuntu\n"
        "    ansible_port: 22\n    ansible_ssh_common_args: -o ProxyCommand=\"sh -c 'aws ssm start-session --target %h'\"\n"
        "    shared_storage_mount: null\n  children:\n    gpu_nodes:\n      hosts:\n"
        "        node-0: {ansible_host: i-0123456789abcdef0, private_ip: 10.0.1.5}\n"
        "        node-1: {ansible_host: i-0123456789abcdef1, private_ip: 10.0.1.6}\n")
    hosts = _inventory(copy)["all"]["children"]["gpu_nodes"]["hosts"]
    assert hosts == {"node-0": {"ansible_user": "ubuntu", "ansible_port": 22, "ansible_host": "i-0123456789abcdef0",
                                "ansible_ssh_common_args": "-o ProxyCommand=\"sh -c 'aws ssm start-session --target %h'\""}}
