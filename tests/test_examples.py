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
def test_example_is_in_sync(example: Path) -> None:
    """The committed files of each example are what gpuprov generates from its spec today: the
    whole bundle for the full example (as `gpuprov check` compares it), plan.json and README.md for
    the others."""
    from gpuprov.commands.gitops import regenerate

    files = regen_examples.example_files(example)
    target, committed = regen_examples.committed_files(example, files)
    if example.name != regen_examples.FULL_BUNDLE:
        assert set(committed) == set(regen_examples.SHOWN)
        for name, text in committed.items():
            assert (target / name).is_file(), f"run: python scripts/regen_examples.py {example.name}"
            assert (target / name).read_text() == text, f"{example.name}/{name}: run scripts/regen_examples.py"
        return
    assert (target / bundle.LOCK_NAME).is_file(), f"run: python scripts/regen_examples.py {example.name}"
    # the lock records the example's spec (spec file + hosts), and regenerating from it changes nothing
    lock = bundle.read_lock(target)
    assert bundle.spec_from_lock(lock) == regen_examples.example_spec(example)
    _, regenerated = regenerate(target)
    differences = bundle.compare_bundle(target, regenerated)
    assert not differences, "\n".join(f"{d.status} {d.path}\n{d.diff}" for d in differences)


def test_exactly_one_example_commits_its_whole_bundle() -> None:
    # the roles are copied into every bundle: one committed copy shows them, eight made every role
    # edit an eight-fold diff
    full = [d.name for d in EXAMPLES if (d / "bundle").exists()]
    assert full == [regen_examples.FULL_BUNDLE]
