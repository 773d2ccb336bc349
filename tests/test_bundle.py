"""The bundle writer: deterministic bytes, lock, atomic swap, refusals, carried user files, tar."""

from __future__ import annotations

import io
import json
import os
import stat
import tarfile
from pathlib import Path

import pytest

from bundle_fixtures import standin_renderers
from gpuprov import bundle
from gpuprov.bundle_tar import tar_bytes
from gpuprov.errors import GpuprovError
from gpuprov.plan import Plan
from plan_fixtures import sample_plan


def _files(cloud: str = "aws", **kw) -> dict[str, str]:
    return bundle.build_bundle(sample_plan(cloud, **kw), standin_renderers())


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {p.relative_to(root).as_posix(): (p.read_bytes(), stat.S_IMODE(p.stat().st_mode))
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_build_is_deterministic_and_locked() -> None:
    first, second = _files(), _files()
    assert first == second
    assert list(first) == sorted(first)
    lock = json.loads(first[bundle.LOCK_NAME])
    assert set(lock["files"]) == set(first) - {bundle.LOCK_NAME}
    for path, digest in lock["files"].items():
        assert bundle.sha256_text(first[path]) == digest
    assert lock["spec"]["cloud"] == "aws" and lock["spec"]["model"] == "llama-3.1-8b"
    assert lock["gpuprov_version"] and lock["catalog_version"]
    for expected in ("README.md", "topology.svg", "plan.json", "terraform/main.tf", "ansible/site.yml",
                     "launch/train.sh"):
        assert expected in first


def test_plan_json_round_trips_with_sorted_keys() -> None:
    plan = sample_plan("gcp")
    text = bundle.plan_json(plan)
    assert Plan.model_validate_json(text) == plan
    data = json.loads(text)
    assert list(data) == sorted(data)


def test_real_renderers_give_stable_output() -> None:
    renderers = bundle.default_renderers()
    assert [folder for folder, _ in renderers] == ["terraform", "ansible", "launch", ""]
    for cloud in ("aws", "onprem"):
        plan = sample_plan(cloud)
        assert bundle.build_bundle(plan, renderers) == bundle.build_bundle(plan, renderers)


def test_write_new_bundle_modes_and_rewrite_is_a_no_op(tmp_path: Path) -> None:
    files = _files()
    target = tmp_path / "infra"
    result = bundle.write_bundle(target, files)
    assert result.files == len(files) and not result.replaced
    snap = _snapshot(target)
    assert {p: data.decode() for p, (data, _) in snap.items()} == files
    assert snap["launch/train.sh"][1] == 0o755 and snap["README.md"][1] == 0o644
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    bundle.write_bundle(target, files)
    assert _snapshot(target) == snap
    assert bundle.compare_bundle(target, files) == []
    assert [p.name for p in tmp_path.iterdir()] == ["infra"]  # no staging directory left behind


def test_umask_does_not_change_modes(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        bundle.write_bundle(tmp_path / "b", _files())
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "b" / "README.md").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "b" / "launch").stat().st_mode) == 0o755


def test_refuses_non_empty_foreign_directory(tmp_path: Path) -> None:
    target = tmp_path / "infra"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(GpuprovError, match="not a gpuprov bundle"):
        bundle.write_bundle(target, _files())
    assert [p.name for p in target.iterdir()] == ["notes.txt"]


def test_empty_directory_is_fine(tmp_path: Path) -> None:
    (tmp_path / "infra").mkdir()
    bundle.write_bundle(tmp_path / "infra", _files())
    assert (tmp_path / "infra" / bundle.LOCK_NAME).is_file()


def test_target_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "infra").write_text("x")
    with pytest.raises(GpuprovError, match="not a directory"):
        bundle.write_bundle(tmp_path / "infra", _files())


def test_hand_edits_are_refused_unless_forced(tmp_path: Path) -> None:
    target = tmp_path / "infra"
    bundle.write_bundle(target, _files())
    (target / "terraform" / "main.tf").write_text("# my change\n")
    new = _files(nodes=4)
    with pytest.raises(GpuprovError, match="edited by hand.*terraform/main.tf"):
        bundle.write_bundle(target, new)
    assert (target / "terraform" / "main.tf").read_text() == "# my change\n"
    bundle.write_bundle(target, new, force=True)
    assert _snapshot(target)["terraform/main.tf"][0].decode() == new["terraform/main.tf"]


def test_user_file_where_gpuprov_now_writes_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "infra"
    files = _files()
    bundle.write_bundle(target, {k: v for k, v in files.items() if k != "launch/env.sh"} | {
        bundle.LOCK_NAME: bundle.lock_text(sample_plan().spec, {k: v for k, v in files.items()
                                                                 if k not in ("launch/env.sh", bundle.LOCK_NAME)})})
    (target / "launch" / "env.sh").write_text("my own env\n")
    with pytest.raises(GpuprovError, match="launch/env.sh"):
        bundle.write_bundle(target, files)


def test_user_files_are_carried_and_stale_files_dropped(tmp_path: Path) -> None:
    target = tmp_path / "infra"
    old = _files()
    old_extra = dict(old)
    old_extra["launch/old.sh"] = "#!/bin/sh\n"
    del old_extra[bundle.LOCK_NAME]
    old_extra[bundle.LOCK_NAME] = bundle.lock_text(sample_plan().spec, old_extra)
    bundle.write_bundle(target, old_extra)
    (target / "terraform" / "terraform.tfstate").write_text('{"serial": 7}')
    (target / "terraform" / ".terraform" / "providers").mkdir(parents=True)
    (target / "terraform" / ".terraform" / "providers" / "bin").write_bytes(b"\x7fELF")
    (target / "terraform" / ".terraform" / "link").symlink_to("providers")
    (target / bundle.UP_STATE_NAME).write_text("{}")
    result = bundle.write_bundle(target, old)
    assert sorted(result.carried) == [".gpuprov-up.json", "terraform/.terraform/link",
                                      "terraform/.terraform/providers/bin", "terraform/terraform.tfstate"]
    assert (target / "terraform" / "terraform.tfstate").read_text() == '{"serial": 7}'
    assert (target / "terraform" / ".terraform" / "link").is_symlink()
    assert not (target / "launch" / "old.sh").exists()
    assert bundle.compare_bundle(target, old) == []  # user files are not drift


def _boom(plan):
    raise RuntimeError("renderer crashed half-way")


def test_renderer_failure_leaves_old_bundle_untouched(tmp_path: Path) -> None:
    target = tmp_path / "infra"
    bundle.write_bundle(target, _files())
    before = _snapshot(target)
    renderers = standin_renderers()
    renderers.insert(2, ("launch", _boom))
    with pytest.raises(RuntimeError):
        bundle.write_bundle(target, bundle.build_bundle(sample_plan(nodes=4), renderers))
    assert _snapshot(target) == before
    assert [p.name for p in tmp_path.iterdir()] == ["infra"]


@pytest.mark.parametrize("where", ["write", "swap"])
def test_interrupted_write_leaves_old_bundle_and_no_debris(tmp_path: Path, monkeypatch, where: str) -> None:
    target = tmp_path / "infra"
    bundle.write_bundle(target, _files())
    before = _snapshot(target)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(bundle, "_write_tree" if where == "write" else "_swap_in", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bundle.write_bundle(target, _files(nodes=4))
    assert _snapshot(target) == before
    assert [p.name for p in tmp_path.iterdir()] == ["infra"]


def test_disk_error_is_one_clear_error(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "infra"
    bundle.write_bundle(target, _files())
    before = _snapshot(target)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "x"))

    monkeypatch.setattr(bundle, "_write_tree", full)
    with pytest.raises(GpuprovError, match="cannot write bundle .*No space left"):
        bundle.write_bundle(target, _files(nodes=4))
    assert _snapshot(target) == before
    assert [p.name for p in tmp_path.iterdir()] == ["infra"]


def test_two_rename_fallback_swap(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(bundle, "_exchange", lambda a, b: False)
    target = tmp_path / "infra"
    bundle.write_bundle(target, _files())
    new = _files(nodes=4)
    bundle.write_bundle(target, new)
    assert bundle.compare_bundle(target, new) == []
    assert [p.name for p in tmp_path.iterdir()] == ["infra"]


def test_unwritable_parent(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(GpuprovError, match="cannot write bundle"):
        bundle.write_bundle(blocker / "infra", _files())


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_parent(tmp_path: Path) -> None:
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        with pytest.raises(GpuprovError, match="cannot write bundle"):
            bundle.write_bundle(parent / "infra", _files())
    finally:
        parent.chmod(0o755)


def test_renderer_paths_stay_inside_their_folder() -> None:
    for bad in ("../escape.tf", "/etc/passwd", "a/../../b", ""):
        with pytest.raises(GpuprovError, match="renderer"):
            bundle.render_files(sample_plan(), [("terraform", lambda plan, bad=bad: {bad: "x"})])
    with pytest.raises(GpuprovError, match="owns"):
        bundle.render_files(sample_plan(), [("", lambda plan: {"plan.json": "{}"})])


def test_tar_is_deterministic_and_complete() -> None:
    files = _files()
    data = tar_bytes(files)
    assert data == tar_bytes(_files())
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = tar.getmembers()
        names = [m.name for m in members]
        assert names == sorted(names) and names[0] == "infra"
        for member in members:
            assert member.mtime == 0 and member.uid == 0 and member.gid == 0
            assert member.uname == "" and member.gname == ""
        contents = {m.name[len("infra/"):]: tar.extractfile(m).read().decode() for m in members if m.isfile()}
        modes = {m.name: m.mode for m in members}
    assert contents == files
    assert modes["infra/launch/train.sh"] == 0o755 and modes["infra/plan.json"] == 0o644
    assert modes["infra/terraform"] == 0o755


def test_extracted_tar_is_a_bundle_in_sync(tmp_path: Path) -> None:
    files = _files()
    with tarfile.open(fileobj=io.BytesIO(tar_bytes(files))) as tar:
        tar.extractall(tmp_path, filter="data")
    assert bundle.compare_bundle(tmp_path / "infra", files) == []


def test_compare_reports_every_kind_of_drift(tmp_path: Path) -> None:
    target = tmp_path / "infra"
    files = _files()
    bundle.write_bundle(target, files)
    (target / "README.md").write_text(files["README.md"].replace("## The plan", "## My plan"))
    (target / "launch" / "env.sh").unlink()
    (target / "launch" / "train.sh").chmod(0o644)
    newer = {k: v for k, v in files.items() if k != "topology.svg"}
    found = {(d.status, d.path): d for d in bundle.compare_bundle(target, newer)}
    assert set(found) == {("modified", "README.md"), ("missing", "launch/env.sh"), ("mode", "launch/train.sh"),
                          ("stale", "topology.svg")}
    diff = found[("modified", "README.md")].diff
    assert "-## My plan" in diff and "+## The plan" in diff


def test_bundle_parked_by_a_crash_mid_swap_is_recovered(tmp_path: Path) -> None:
    target = tmp_path / "infra"
    bundle.write_bundle(target, _files())
    (target / "terraform" / "terraform.tfstate").write_text("state")
    target.rename(tmp_path / ".infra.gpuprov-old-abc123")  # as if killed between the two renames
    bundle.write_bundle(target, _files(nodes=4))
    assert (target / "terraform" / "terraform.tfstate").read_text() == "state"  # the user's state survived
    assert [p.name for p in tmp_path.iterdir()] == ["infra"]


def test_onprem_bundle_says_which_hosts_are_left_out() -> None:
    from gpuprov.planner import make_plan
    from gpuprov.spec import HostEntry, TrainingSpec

    hosts = [HostEntry(name=f"gpu{i}", address=f"10.0.0.{i + 1}") for i in range(4)]
    plan = make_plan(TrainingSpec(model="llama-3.1-8b", task="lora", tokens=10**9, cloud="onprem", hosts=hosts,
                                  gpus=["h100-80gb"]))
    assert plan.cluster.nodes < 4
    files = bundle.build_bundle(plan)
    readme, inventory = files["README.md"], files["ansible/inventory.yml"]
    left = hosts[plan.cluster.nodes:]
    assert f"Left out ({len(left)} of the 4 hosts listed" in readme
    assert all(f"- `{h.name}`: {h.address}" in readme for h in left)
    assert f"uses {plan.cluster.nodes} of the 4 hosts listed" in readme  # the note, with the reason
    assert all(f"#   {h.name}: {h.address}" in inventory for h in left)
    assert all(f"        {h.name}:\n" not in inventory for h in left)
