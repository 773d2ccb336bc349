"""Fuzz the spec parser: any file or flag value gives a TrainingSpec or ONE clear GpuprovError line,
never another exception; through the CLI, exit 2, no traceback, no bundle written.

Cases the fuzzer found (and hand-picked nasty ones) live in tests/data/spec_corpus/ and are
replayed through the whole `gpuprov generate` command on every run.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gpuprov.commands.spec_options import spec_from_flags
from gpuprov.errors import GpuprovError
from gpuprov.spec import TrainingSpec

CORPUS = Path(__file__).resolve().parent / "data" / "spec_corpus"
FIELDS = sorted(TrainingSpec.model_fields)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _parse_file(tmp_path: Path, text: str | bytes) -> TrainingSpec | None:
    path = tmp_path / "gpuprov.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", errors="replace"))
    try:
        return spec_from_flags(str(path), None, {})
    except GpuprovError as exc:
        message = str(exc)
        assert message and "\n" not in message and len(message) < 2000, message
        assert "Traceback" not in message
        return None


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["20B", "1T", "4M", "30d", "12h", "-1", "0", "1e999", "nan", "inf", "~", "yes", "no",
                     "2024-01-01", "0x10", "0o17", "1_000", ".inf", "!!binary aGk=", "&a", "*a"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=8)
keys = st.one_of(st.sampled_from(FIELDS), st.text(min_size=1, max_size=10))


def _dump(data: dict) -> str:
    import io

    from ruamel.yaml import YAML

    yaml = YAML(typ="safe", pure=True)
    buffer = io.StringIO()
    yaml.dump(data, buffer)
    return buffer.getvalue()


@SETTINGS
@given(st.dictionaries(keys, values, max_size=6))
@example({"tokens": float("nan")})
@example({"deadline_hours": "1e999d"})
@example({"hosts": [{"name": "a", "address": "b"}, {"name": "a", "address": "c"}]})
@example({"gpus": "h100"})
def test_structured_specs(tmp_path: Path, data: dict) -> None:
    try:
        text = _dump(data)
    except Exception:  # the dumper cannot write it: nothing to parse
        return
    spec = _parse_file(tmp_path, text)
    if spec is not None:
        assert spec.seq_len > 0 and spec.tokens > 0
        if spec.deadline_hours is not None:
            assert math.isfinite(spec.deadline_hours) and spec.deadline_hours > 0


@SETTINGS
@given(st.text(max_size=200))
@example("model: 70b\n\ttokens: 1\n")
@example("{{{{")
@example("!!python/object:os.system {}")
@example("a: &x [*x]")
@example("model: 70b\nmodel: 13b\n")
@example("%YAML 9.9\n---\nmodel: 7b\n")
def test_arbitrary_text(tmp_path: Path, text: str) -> None:
    _parse_file(tmp_path, text)


@SETTINGS
@given(st.binary(max_size=120))
@example(b"\xff\xfe\x00m\x00o")
@example(b"model: 7b\x00\n")
def test_arbitrary_bytes(tmp_path: Path, data: bytes) -> None:
    _parse_file(tmp_path, data)


_VALID = "model: 70b\ntask: full\nseq_len: 4096\ntokens: 20B\ncloud: aws\nlora_targets: [q_proj, v_proj]\n"


@SETTINGS
@given(st.integers(min_value=0, max_value=len(_VALID)), st.integers(min_value=0, max_value=8),
       st.text(alphabet=":-[]{}'\"#&*!|>% \n\t,", max_size=4))
def test_mutated_valid_spec(tmp_path: Path, position: int, cut: int, insert: str) -> None:
    _parse_file(tmp_path, _VALID[:position] + insert + _VALID[position + cut:])


flag_text = st.one_of(st.text(max_size=12), st.sampled_from(["1T", "4Mi", "0", "-5", "1e309", "1.5", "nanh", "7d"]))


@SETTINGS
@given(st.fixed_dictionaries({}, optional={
    "tokens": flag_text, "global_batch_tokens": flag_text, "deadline_hours": flag_text, "model": flag_text,
    "region": flag_text, "lora_targets": flag_text, "gpus": st.lists(flag_text, max_size=3).map(tuple),
    "budget_usd": st.floats(), "safety_margin": st.floats(), "seq_len": st.integers(), "max_nodes": st.integers()}))
def test_flag_values(values: dict) -> None:
    try:
        spec_from_flags(None, None, values)
    except GpuprovError as exc:
        assert "\n" not in str(exc) and str(exc)


# ---------------------------------------------------------------- the corpus, through the CLI


def corpus_files() -> list[Path]:
    return sorted(p for p in CORPUS.iterdir() if p.is_file())


@pytest.mark.parametrize("case", corpus_files(), ids=lambda p: p.name)
def test_corpus_through_generate(tmp_path: Path, case: Path, capsys) -> None:
    from gpuprov.cli import main

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:
        main(["generate", "-f", str(case), "-o", str(out)])
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpuprov: error: "), err
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no staging debris either


@SETTINGS
@given(st.one_of(st.text(max_size=150), st.dictionaries(st.text(max_size=8), values, max_size=4).map(_dump),
                 st.lists(st.dictionaries(st.sampled_from(["name", "address", "user", "x"]), scalars, max_size=3),
                          max_size=3).map(lambda v: _dump({"h": v})[3:])))
@pytest.mark.slow
@example("[gpu_nodes]\ngpu0 ansible_host=\n")
@example("all:\n  children: 3\n")
@example("gpu0: {ansible_host: [1, 2]}\n")
def test_hosts_files(tmp_path: Path, text: str) -> None:
    from gpuprov.specfile import load_hosts

    path = tmp_path / "hosts"
    path.write_bytes(text.encode("utf-8", errors="replace"))
    try:
        hosts = load_hosts(path)
    except GpuprovError as exc:
        assert str(exc) and "\n" not in str(exc), str(exc)
        return
    assert hosts and all(h.name and h.address for h in hosts)
