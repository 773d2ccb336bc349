"""Issue 25: injection and overwrite paths, one test (or more) per finding.

1 a host address or --ssh-cidr with an IPv6 zone id carrying Jinja; the wall on rendered Ansible files
2 up / hosts probe --write writing through a symlink planted at a temporary name
3 special files (FIFO, directory, /dev/zero) at bundle paths and at an HF cache's config.json
4 YAML that hangs the constructor (collection keys) or the composer (depth)
5 probe --write: names that YAML reads as non-strings, addresses that add keys
6 keep patterns that hide added code from check, and validate's view of added files
7 DIR/FILE.json taken for a Hugging Face id; init writing it relative to the wrong folder
8 the "unexpected ..." cases; 9 validate's fix: line quoting
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bundle_fixtures import standin_renderers
from gpuprov import bundle, validators
from gpuprov.errors import GpuprovError
from injection_support import assert_one_line_error, cli
from plan_fixtures import sample_plan

PAYLOAD = "{{lookup('pipe','touch PWNED')}}"


def _bundle(tmp_path: Path, cloud: str = "aws", name: str = "infra") -> Path:
    root = tmp_path / name
    bundle.write_bundle(root, bundle.build_bundle(sample_plan(cloud, nodes=2), standin_renderers()), force=True)
    return root


def _gpuprov(*args: str, cwd: Path | None = None, timeout: int = 60, env: dict | None = None,
             **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env or {}), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env, **kw)


# ---- 1. zone ids -----------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [f"fe80::1%{PAYLOAD}", "fe80::1%$(id)", "fe80::1%a\nb", "fe80::1%\u202e",
                                   "fe80::1%", "fe80::1%" + "e" * 16])
def test_address_zone_id_must_be_an_interface_name(value: str) -> None:
    with pytest.raises(ValueError, match="zone id"):
        validators.address(value)


def test_interface_zone_id_and_plain_addresses_pass() -> None:
    assert validators.address("fe80::1%eth0") == "fe80::1%eth0"
    assert validators.address("10.0.0.1") == "10.0.0.1"
    assert validators.address("gpu0.example.com") == "gpu0.example.com"


@pytest.mark.parametrize("value", [f"fe80::%{PAYLOAD}/64", "fe80::%eth0/64"])
def test_cidr_has_no_zone_id(value: str) -> None:
    with pytest.raises(ValueError, match="zone id"):
        validators.cidr(value)


@pytest.mark.parametrize("kind", ["yaml", "ini"])
def test_hostile_zone_id_in_a_hosts_file_is_refused(tmp_path: Path, kind: str) -> None:
    if kind == "yaml":
        hosts = tmp_path / "hosts.yaml"
        hosts.write_text(json.dumps([{"name": "gpu0", "address": f"fe80::1%{PAYLOAD}"}]))
    else:
        hosts = tmp_path / "hosts.ini"
        hosts.write_text(f"[gpu_nodes]\ngpu0 ansible_host=fe80::1%{PAYLOAD}\n")
    line = assert_one_line_error(*cli("plan", "--model", "7b", "--hosts", str(hosts))[::2])
    assert "zone id" in line


def test_hostile_zone_id_in_ssh_cidr_is_refused() -> None:
    line = assert_one_line_error(*cli("plan", "--model", "7b", "--ssh-cidr", f"fe80::%{PAYLOAD}/64")[::2])
    assert "zone id" in line


def test_jinja_wall_refuses_a_marker_outside_unsafe() -> None:
    from gpuprov.render.ansible import jinja_wall

    for marker in ("{{ x }}", "{% if x %}", "{# x #}"):
        with pytest.raises(GpuprovError, match="Jinja marker"):
            jinja_wall("group_vars/all.yml", f"a: 1\nb: \"{marker}\"\n")
        assert jinja_wall("x.yml", f'b: !unsafe "{marker}"\n')


def _past_validators(plan, **host):
    hosts = [h.model_copy(update=host) for h in plan.hosts]
    return plan.model_copy(update={"hosts": hosts, "spec": plan.spec.model_copy(update={"hosts": hosts})})


def test_rendered_inventory_marks_jinja_values_unsafe() -> None:
    """Past the validators, a marker in a host value is written !unsafe; nothing else carries one."""
    from gpuprov.render.ansible import JINJA_MARKER, render_ansible

    files = render_ansible(_past_validators(sample_plan("onprem", nodes=2), address=f"fe80::1%{PAYLOAD}",
                                            user="{% raw %}u"))
    inventory = files["inventory.yml"]
    assert f'ansible_host: !unsafe "fe80::1%{{{{lookup(\'pipe\',\'touch PWNED\')}}}}"' in inventory
    assert 'ansible_user: !unsafe "{% raw %}u"' in inventory
    for name, text in files.items():
        if not name.startswith("roles/"):
            stripped = "\n".join(line for line in text.splitlines() if "!unsafe" not in line)
            assert not JINJA_MARKER.search(stripped), name


@pytest.mark.slow
def test_ansible_templates_nothing_from_a_hostile_bundle(tmp_path: Path) -> None:
    """Real ansible-inventory and ansible -m debug on a bundle whose host values carry lookups."""
    venv = Path(sys.executable).parent
    if not (venv / "ansible-inventory").exists():
        pytest.skip("ansible-core is not installed beside this Python")
    from gpuprov.render.ansible import render_ansible

    marker = tmp_path / "PWNED"
    lookup = "{{ lookup('pipe', 'touch " + str(marker) + "') }}"
    plan = _past_validators(sample_plan("onprem", nodes=2), address="fe80::1%" + lookup, user=lookup)
    root = tmp_path / "ansible"
    for name, text in render_ansible(plan).items():
        if not name.startswith("roles/"):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
    env = dict(os.environ, ANSIBLE_HOME=str(tmp_path / "home"), ANSIBLE_LOCAL_TEMP=str(tmp_path / "tmp"),
               ANSIBLE_NOCOLOR="1")
    listed = subprocess.run([str(venv / "ansible-inventory"), "-i", "inventory.yml", "--list"], cwd=root,
                            capture_output=True, text=True, env=env, timeout=120)
    assert listed.returncode == 0, listed.stderr
    hostvars = json.loads(listed.stdout)["_meta"]["hostvars"]["gpu0"]
    assert "lookup('pipe'" in json.dumps(hostvars["ansible_host"])
    shown = subprocess.run([str(venv / "ansible"), "gpu_nodes", "-i", "inventory.yml", "-m", "ansible.builtin.debug",
                            "-a", '{"msg": "{{ ansible_host }} {{ ansible_user }}"}'], cwd=root, capture_output=True,
                           text=True, env=env, timeout=120)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "lookup('pipe'" in shown.stdout  # printed as text, never run
    assert not marker.exists()


def test_up_refuses_jinja_in_terraform_inventory(tmp_path: Path) -> None:
    from gpuprov.bringup import StepFailed, write_inventory

    root = _bundle(tmp_path)
    output = {"all": {"children": {"gpu_nodes": {"hosts": {"node-0": {"ansible_host": PAYLOAD}}}}}}
    with pytest.raises(StepFailed, match="Jinja marker"):
        write_inventory(root, json.dumps(output))
    assert not (root / "ansible" / "inventory.yml").exists()


# ---- 2. planted symlinks at temporary names ---------------------------------------------------------

def test_write_state_and_inventory_never_follow_a_planted_symlink(tmp_path: Path) -> None:
    from gpuprov.bringup import write_inventory, write_state

    root = _bundle(tmp_path)
    victims = {name: tmp_path / f"victim-{i}" for i, name in enumerate(
        [".gpuprov-up.json.tmp", "ansible/inventory.yml.tmp", ".gpuprov-up.json"])}
    for name, victim in victims.items():
        victim.write_text("precious\n")
        os.symlink(victim, root / name)
    write_state(root, {"completed": []})
    from test_up import INVENTORY as reachable

    write_inventory(root, json.dumps(reachable))
    assert all(v.read_text() == "precious\n" for v in victims.values())
    assert json.loads((root / ".gpuprov-up.json").read_text()) == {"completed": []}
    assert not (root / ".gpuprov-up.json").is_symlink()


def test_probe_write_never_follows_a_planted_symlink(tmp_path: Path, monkeypatch) -> None:
    from gpuprov.commands import hosts as hosts_command

    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("- {name: gpu0, address: 10.0.0.1}\n")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.symlink(victim, tmp_path / ".hosts.yaml.gpuprov-tmp")
    monkeypatch.setattr(hosts_command, "_ssh", lambda host, script, timeout: _PROBE_OUTPUT)
    code, out, err = cli("hosts", "probe", str(hosts), "--write")
    assert code == 0, err
    assert victim.read_text() == "precious\n"
    assert "h100" in hosts.read_text()


# ---- 3. special files ------------------------------------------------------------------------------

BUNDLE_PATHS = ["gpuprov.lock", "plan.json", ".gpuprov-up.json", "terraform/main.tf", "terraform/terraform.tfvars"]


def _plant(path: Path, kind: str) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    else:
        os.symlink("/dev/zero", path)


@pytest.mark.slow  # 45 processes; tests/test_security_fuzz.py runs the same classes in-process
@pytest.mark.parametrize("kind", ["fifo", "dir", "zero"])
@pytest.mark.parametrize("rel", BUNDLE_PATHS)
def test_special_file_in_a_bundle_is_refused_quickly(tmp_path: Path, rel: str, kind: str) -> None:
    root = _bundle(tmp_path)
    _plant(root / rel, kind)
    for args in (["validate", str(root), "--offline"], ["up", str(root), "--dry-run"], ["down", str(root), "--dry-run"]):
        result = _gpuprov(*args, timeout=10)
        assert result.returncode in (1, 2), (args, result.stderr)
        assert "Traceback" not in result.stderr and "unexpected" not in result.stderr, result.stderr


def test_fifo_config_json_in_an_hf_cache_is_refused(tmp_path: Path) -> None:
    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    os.mkfifo(snapshot / "config.json")
    result = _gpuprov("estimate", "--model", "org/name", "--gpu", "h100-80gb", timeout=10,
                      env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2 and "FIFO" in result.stderr, result.stderr


def test_long_hf_ref_is_one_line(tmp_path: Path, monkeypatch) -> None:
    repo = tmp_path / "models--org--name"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("b" * 300)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    line = assert_one_line_error(*cli("estimate", "--model", "org/name", "--gpu", "h100-80gb")[::2])
    assert "commit hash" in line


def test_guarded_reader_refuses_symlinks_in_a_bundle_and_caps_size(tmp_path: Path) -> None:
    from gpuprov.safefile import read_bytes

    (tmp_path / "real").write_bytes(b"x" * 100)
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(GpuprovError, match="symbolic link"):
        read_bytes(tmp_path / "link")
    assert read_bytes(tmp_path / "link", follow=True) == b"x" * 100
    with pytest.raises(GpuprovError, match="larger than"):
        read_bytes(tmp_path / "real", limit=10)


@pytest.mark.parametrize("folder", ["ansible", "terraform"])
def test_symlinked_bundle_folder_is_refused(tmp_path: Path, folder: str) -> None:
    root = _bundle(tmp_path)
    outside = tmp_path / "outside"
    (root / folder).rename(outside)
    os.symlink(outside, root / folder)
    for args in (["up", str(root), "--dry-run"], ["validate", str(root), "--offline"]):
        line = assert_one_line_error(*cli(*args)[::2])
        assert "symbolic link" in line


# ---- 4. YAML that hangs ----------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["{" * 20 + "}" * 20 + ": 1\n", "? [[[[]]]]\n: 1\n", "a: " + "[" * 5000 + "]" * 5000 + "\n"])
@pytest.mark.parametrize("use", ["spec", "hosts"])
def test_yaml_that_would_hang_is_refused_within_a_second(tmp_path: Path, text: str, use: str) -> None:
    import time

    path = tmp_path / "input.yaml"
    path.write_text(text)
    args = ["plan", "-f", str(path)] if use == "spec" else ["plan", "--model", "7b", "--hosts", str(path)]
    start = time.monotonic()
    code, _, err = cli(*args)
    assert time.monotonic() - start < 1.0
    line = assert_one_line_error(code, err)
    assert "nested" in line or "mapping key" in line


# ---- 5. probe --write through the YAML escaping -----------------------------------------------------

_PROBE_OUTPUT = ("### nvidia-smi\n" + "NVIDIA H100 80GB HBM3, 81559\n" * 8 + "### free\nMem: 2151706738688 0\n"
                 "### lscpu\nCore(s) per socket: 48\nSocket(s): 2\n### nproc\n192\n### lsblk\n{\"blockdevices\": []}\n"
                 "### ip\n### speed\n### ibstat\n")


@pytest.mark.parametrize("name", ["null", "0777", "1e3", "yes", "true", "0x1F"])
def test_probe_write_round_trips_names_yaml_would_retype(tmp_path: Path, monkeypatch, name: str) -> None:
    from gpuprov.commands import hosts as hosts_command
    from gpuprov.specfile import load_hosts

    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(json.dumps([{"name": name, "address": "10.0.0.1", "user": "ubuntu"}]))
    monkeypatch.setattr(hosts_command, "_ssh", lambda host, script, timeout: _PROBE_OUTPUT)
    code, _, err = cli("hosts", "probe", str(hosts), "--write")
    assert code == 0, err
    [host] = load_hosts(hosts)
    assert (host.name, host.address, host.user, host.gpu, host.gpus) == (name, "10.0.0.1", "ubuntu", "h100-80gb", 8)


def test_probe_line_cannot_add_keys_or_hosts() -> None:
    from gpuprov.commands.hosts import _line
    from ruamel.yaml import YAML

    entry = {"name": "gpu0", "address": "10.0.0.1, user: root}\n- {name: evil, address: 10.6.6.6", "gpus": 8}
    loaded = YAML(typ="safe", pure=True).load(_line(entry))
    assert loaded == [entry]


# ---- 6. keep patterns ------------------------------------------------------------------------------

def _set_keep(root: Path, keep: list[str]) -> None:
    lock = json.loads((root / bundle.LOCK_NAME).read_text())
    lock["keep"] = keep
    (root / bundle.LOCK_NAME).write_text(json.dumps(lock, indent=2, sort_keys=True) + "\n")


@pytest.mark.parametrize("pattern", ["terraform/*", "terraform/*.tf", "*.tf", "terraform/x*.tf", "ansible/*.yml",
                                     "launch/*.sh", "launch/*.py", "terraform/extra.tf", "*", "terraform/*f.json",
                                     "terraform/*.tfvars.json", "terraform/terraform.tfstate.x*", "ansible/**",
                                     "terraform/*/x.log", "ansible/*.cfg", "launch/*"])
def test_keep_pattern_that_could_hide_code_is_refused(pattern: str) -> None:
    with pytest.raises(GpuprovError, match="could hide"):
        bundle.lock_keep({"keep": [*bundle.USER_FILES, pattern]})


@pytest.mark.parametrize("pattern", ["terraform/*.tfplan", "ansible/*.log", "launch/*.out", "docs/*.py",
                                     "terraform/.terraform/**", "ansible/roles/*/x.retry"])
def test_keep_pattern_for_data_files_is_allowed(pattern: str) -> None:
    assert pattern in bundle.lock_keep({"keep": [*bundle.USER_FILES, pattern]})


def test_check_refuses_a_keep_pattern_hiding_an_added_tf_and_lists_extra_ones(tmp_path: Path, monkeypatch) -> None:
    root = _bundle(tmp_path)
    (root / "terraform" / "zz.tf").write_text('resource "terraform_data" "x" {\n  provisioner "local-exec" {\n'
                                              '    command = "touch PWNED"\n  }\n}\n')
    monkeypatch.setattr("gpuprov.commands.gitops.regenerate",
                        lambda d: (bundle.read_lock(d), bundle.build_bundle(sample_plan("aws", nodes=2), standin_renderers(),
                                                                             keep=bundle.lock_keep(bundle.read_lock(d)))))
    _set_keep(root, [*bundle.USER_FILES, "terraform/z*"])
    line = assert_one_line_error(*cli("check", str(root))[::2])
    assert "terraform/z*" in line
    _set_keep(root, [*bundle.USER_FILES, "terraform/*.log"])
    code, out, _ = cli("check", str(root))
    assert code == 1 and "terraform/*.log" in out and "terraform/zz.tf" in out


def test_validate_fails_on_an_added_tf(tmp_path: Path) -> None:
    from gpuprov.commands.gitops import check_added

    root = _bundle(tmp_path)
    assert check_added(root)[0] == "ok"
    (root / "terraform" / "zz.tf").write_text('resource "terraform_data" "x" {}\n')
    status, detail = check_added(root)
    assert status == "fail" and "terraform/zz.tf" in detail
    (root / "terraform" / "tfplan").write_text("binary plan")  # data terraform writes: not code
    assert "tfplan" not in check_added(root)[1]


# ---- 7. DIR/FILE.json --------------------------------------------------------------------------------

def test_json_path_in_a_spec_is_never_a_hugging_face_id(tmp_path: Path) -> None:
    from gpuprov.catalog.models import resolve_model_ref

    assert resolve_model_ref("cfg/config.json", tmp_path) == str(tmp_path / "cfg" / "config.json")
    assert resolve_model_ref("meta-llama/Llama-3.1-8B", tmp_path) == "meta-llama/Llama-3.1-8B"


def test_init_writes_a_model_path_relative_to_the_spec(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 32000}))
    code, _, err = cli("init", "d/g.yaml", "--model", "d/config.json", cwd=tmp_path)
    assert code == 0, err
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code, out, err = cli("plan", "-f", str(tmp_path / "d" / "g.yaml"), "--json", cwd=elsewhere)
    assert code == 0, err
    assert json.loads(out)["spec"]["model"] == str(tmp_path / "d" / "config.json")


# ---- 8. the "unexpected ..." cases -------------------------------------------------------------------

def test_tfvars_node_count_that_is_no_count_is_one_line(tmp_path: Path) -> None:
    from gpuprov.preflight import settings

    root = _bundle(tmp_path)
    plan = sample_plan("aws", nodes=2)
    for value in ('"abc"', "9" * 32, "0"):
        (root / "terraform" / "terraform.tfvars").write_text(f"node_count = {value}\n")
        with pytest.raises(GpuprovError, match="node_count"):
            settings(plan, root)
    (root / "terraform" / "terraform.tfvars").write_text("node_count = 4\n")
    assert settings(plan, root)["nodes"] == 4


def test_non_utf8_tf_is_one_line(tmp_path: Path) -> None:
    root = _bundle(tmp_path)
    (root / "terraform" / "main.tf").write_bytes(b'variable "x" {\n  default = "\xff"\n}\n')
    code, _, err = cli("up", str(root), "--dry-run")
    assert code == 2 and "Traceback" not in err and "UTF-8" in err.splitlines()[-1], err
    code, out, err = cli("validate", str(root), "--offline")
    assert code in (1, 2) and "unexpected" not in err, err


def test_output_at_a_symlink_loop_is_one_line(tmp_path: Path) -> None:
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    line = assert_one_line_error(*cli("generate", "--model", "7b", "-o", str(tmp_path / "loop"))[::2])
    assert "loops" in line


@pytest.mark.parametrize("args", [["schema"], ["models", "--json"], ["plan", "--model", "7b", "--json"],
                                  ["generate", "--model", "7b", "-o", "-"]])
def test_closed_stdout_is_one_line(args: list[str]) -> None:
    result = subprocess.run(  # fd 1 closed before gpuprov starts (`>&-`): Python sets sys.stdout to None
        [sys.executable, "-m", "gpuprov", *args], preexec_fn=lambda: os.close(1),
        stderr=subprocess.PIPE, text=True, timeout=60,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    assert result.returncode == 2
    assert result.stderr.strip() == "gpuprov: error: standard output is closed; redirect it (> file, or > /dev/null)"


@pytest.mark.parametrize("section", [
    "### nvidia-smi\nNVIDIA H100 80GB HBM3, 1e999\n",
    "### nvidia-smi\nNVIDIA H100 80GB HBM3, [N/A]\n",
    "### lsblk\n" + '{"blockdevices": [{"name": "nvme0n1", "type": "disk", "size": 1, "children": '
    + "[" * 50_000 + "]" * 50_000 + "}]}\n",
    "### lsblk\n" + '{"blockdevices": [{"name": "nvme0n1", "type": "disk", "size": 1, "children": '
    + '[{"children": ' * 20 + "[]" + "}]" * 20 + "}]}\n",
    "### lsblk\n" + '{"blockdevices": [{"name": "nvme0n1", "type": "disk", "size": null}]}\n',
])
def test_hostile_probe_output_is_a_value_error(section: str) -> None:
    from gpuprov.catalog.gpus import list_gpus
    from gpuprov.probe import parse_probe

    with pytest.raises(ValueError):
        parse_probe(section, list_gpus())


def test_lsblk_sizes_as_strings_still_parse() -> None:
    from gpuprov.probe import parse_nvme

    text = json.dumps({"blockdevices": [{"name": "nvme0n1", "type": "disk", "size": "3840755982336"},
                                        {"name": "nvme1n1", "type": "disk", "size": 3840755982336}]})
    assert parse_nvme(text) == (2, 3841)


# ---- 9. fix: lines -------------------------------------------------------------------------------------

def test_fix_lines_quote_tfvars_values(tmp_path: Path) -> None:
    import shlex

    from gpuprov.preflight import offline_checks

    root = _bundle(tmp_path)
    region = "us-east-1; touch X $(id)"
    (root / "terraform" / "terraform.tfvars").write_text(f'region = "{region}"\n')
    fixes = [c.fix for c in offline_checks(sample_plan("aws", nodes=2), root) if c.fix]
    assert fixes
    for fix in fixes:
        if region in fix.replace("'", ""):
            words = shlex.split(fix.split("  (")[0])
            assert region in words, fix
            assert "touch" not in words


# ---- gpuprov up on a bundle with planted symlinks ----------------------------------------------------

from test_up import INVENTORY, _up, fakes  # noqa: E402,F401  (the fake terraform/ansible fixture)


def _snapshot(folder: Path, skip: Path) -> dict[str, bytes]:
    """Every regular file under `folder` outside `skip`, by content."""
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.is_symlink() and skip not in p.parents}


@pytest.mark.parametrize("plant", ["root temporary names", "folder temporary names", "state and inventory",
                                   "ansible folder", "terraform folder"])
def test_up_with_planted_symlinks_changes_nothing_outside_the_bundle(tmp_path: Path, fakes: dict, plant: str) -> None:
    root = _bundle(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    links = {"root temporary names": [".gpuprov-up.json.tmp", ".gpuprov-up.json.gpuprov-tmp"],
             # inside terraform/ and ansible/ every symlink is refused: terraform writes tfplan itself
             "folder temporary names": ["ansible/inventory.yml.tmp", "terraform/tfplan"],
             "state and inventory": [".gpuprov-up.json", "ansible/inventory.yml"]}.get(plant, [])
    for index, name in enumerate(links):
        (outside / f"victim-{index}").write_text("precious\n")
        os.symlink(outside / f"victim-{index}", root / name)
    if plant.endswith("folder"):
        folder = plant.split()[0]
        shutil.move(root / folder, outside / folder)
        os.symlink(outside / folder, root / folder)
    before = _snapshot(tmp_path, root)
    result = _up(root, fakes["env"])
    if plant == "root temporary names":
        assert result.returncode == 0, result.stderr
        assert (root / "ansible" / "inventory.yml").is_file() and not (root / "ansible" / "inventory.yml").is_symlink()
    else:
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert "symbolic link" in result.stderr.splitlines()[-1]
    after = _snapshot(tmp_path, root)
    after.pop(str(fakes["log"]), None)
    before.pop(str(fakes["log"]), None)
    assert after == before
