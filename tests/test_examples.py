"""Every example's committed bundle is exactly what gpuprov generates from its spec today: the
check a user's GitOps pipeline runs (`gpuprov check`), applied to examples/<name>/bundle."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpuprov import bundle

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import regen_examples  # noqa: E402

EXAMPLES = regen_examples.example_dirs()
REQUIRED_CASES = {"7b-full", "13b-full", "34b-full", "70b-full", "7b-lora", "13b-lora"}


def test_examples_cover_the_required_cases_and_every_target() -> None:
    names = {d.name for d in EXAMPLES}
    for case in REQUIRED_CASES:
        assert any(name.startswith(case) for name in names), case
    specs = [regen_examples.example_spec(d) for d in EXAMPLES]
    assert {"aws", "gcp", "azure", "oci", "onprem"} <= {s.cloud for s in specs}
    assert any(s.hosts for s in specs if s.cloud == "onprem")


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda d: d.name)
def test_example_bundle_is_in_sync(example: Path) -> None:
    from gpuprov.commands.gitops import regenerate

    target = example / "bundle"
    assert (target / bundle.LOCK_NAME).is_file(), f"run: python scripts/regen_examples.py {example.name}"
    # the lock records the example's spec (spec file + hosts), and regenerating from it changes nothing
    lock = bundle.read_lock(target)
    assert bundle.spec_from_lock(lock) == regen_examples.example_spec(example)
    _, files = regenerate(target)
    differences = bundle.compare_bundle(target, files)
    assert not differences, "\n".join(f"{d.status} {d.path}\n{d.diff}" for d in differences)
