"""OCI nodes boot Oracle's Ubuntu 22.04 GPU image by default (issue 40, item 8). Oracle publishes one
download link per GPU image and the shapes it serves (oci-hpc-oke docs/worker-node-images.json),
not per-region OCIDs: the target imports the listed image for the plan's shape, the plan carries
the decision and the renderer writes it as image_uri's default; a shape the list does not name
keeps image_id required and generate says so in one line. Tests from the catalog fact."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from gpuprov.catalog import bringup as cat
from gpuprov.catalog import images
from gpuprov.cli import cli
from gpuprov.render.terraform import render_terraform
from gpuprov.targets import oci
from plan_fixtures import sample_plan, with_bringup

FACT = cat.image("oci")["import"]


def _plan(shape: str):
    from gpuprov.targets.decide import decided

    plan = sample_plan("oci", nodes=2)
    plan = with_bringup(plan.model_copy(update={
        "instance": plan.instance.model_copy(update={"name": shape}),
        "cluster": plan.cluster.model_copy(update={"instance_type": shape})}), shape)
    return decided(plan)


def _variable(text: str, name: str) -> str:
    found = re.search(r'^variable "' + name + r'" \{\n(.*?)^\}', text, re.S | re.M)
    assert found, name
    return found.group(1)


def test_the_fact_is_sourced_and_is_the_profiles_os():
    assert FACT["source"].startswith("oracle-quickstart/oci-hpc-oke ") and re.search(r"@[0-9a-f]{40}", FACT["source"])
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(FACT["date"]))
    assert FACT["uri"].startswith("https://") and FACT["uri"].endswith("/" + FACT["name"])
    profile = images.profile(images.profile_for("oci", "BM.GPU.H100.8"))
    assert profile["os"] == "ubuntu-22.04" and FACT["name"].startswith("Canonical-Ubuntu-22.04-")


@pytest.mark.parametrize("shape", sorted(FACT["shapes"]))
def test_a_listed_shape_plans_the_import(shape):
    decision = oci.gpu_image(shape)
    assert decision is not None and decision["uri"] == FACT["uri"] and decision["name"] == FACT["name"]


def test_the_plan_carries_the_image_and_the_renderer_writes_it():
    plan = _plan("BM.GPU.H100.8")
    assert plan.infra.inputs["gpu_image"]["uri"] == FACT["uri"]
    files = render_terraform(plan)
    image_id = _variable(files["variables.tf"], "image_id")
    uri = _variable(files["variables.tf"], "image_uri")
    assert re.search(r"^\s*default\s*=\s*null$", image_id, re.M)
    assert re.search(r'^\s*default\s*=\s*"' + re.escape(FACT["uri"]) + '"$', uri, re.M)
    main = files["main.tf"]
    imported = re.search(r'resource "oci_core_image" "gpu" \{(.*?)\n\}', main, re.S).group(1)
    assert 'source_type = "objectStorageUri"' in imported and "source_uri  = var.image_uri" in imported
    assert "image_id                = local.image_id" in main
    assert 'resource "oci_core_shape_management" "gpu"' in main  # an imported image serves no shape until told
    assert not re.search(r"^image_id\s*=", files["terraform.tfvars.example"], re.M)


def test_a_shape_the_list_does_not_name_keeps_image_id_required(monkeypatch, tmp_path):
    unlisted = {**FACT, "shapes": []}
    monkeypatch.setattr(cat, "image", lambda cloud: {**cat._bringup()["images"][cloud], "import": unlisted})
    assert oci.gpu_image("BM.GPU.H100.8") is None
    plan = _plan("BM.GPU.H100.8")
    files = render_terraform(plan)
    assert "default" not in _variable(files["variables.tf"], "image_id")
    assert re.search(r"^\s*default\s*=\s*null$", _variable(files["variables.tf"], "image_uri"), re.M)
    assert re.search(r"^image_id\s*=", files["terraform.tfvars.example"], re.M)
    result = CliRunner().invoke(cli, ["generate", "--model", "8b", "--task", "lora", "--cloud", "oci",
                                      "-o", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    shape = json.loads((tmp_path / "b" / "plan.json").read_text())["instance"]["name"]
    notes = [ln for ln in result.stderr.splitlines() if "image_id has no default" in ln]
    assert len(notes) == 1 and notes[0].startswith("note: ") and shape in notes[0], result.stderr


def test_generate_says_nothing_about_the_image_for_a_listed_shape(tmp_path):
    result = CliRunner().invoke(cli, ["generate", "--model", "8b", "--task", "lora", "--cloud", "oci",
                                      "-o", str(tmp_path / "b")])
    assert result.exit_code == 0 and "image_id" not in result.stderr, result.stderr
