"""The command line, run as `python -m nvdnn` in a subprocess with NVDNN_CACHE_DIR set."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import pytest

import nvdnn as package
from nvdnn import cli, models, warm
from nvdnn.cache import KernelCache
from nvdnn.errors import CacheMissError
from nvdnn.kernels import matmul, pointwise


def nvdnn(cache_dir, *args, env=None, timeout=300) -> subprocess.CompletedProcess:
    environ = dict(os.environ, NVDNN_CACHE_DIR=str(cache_dir), **(env or {}))
    return subprocess.run([sys.executable, "-m", "nvdnn", *args], capture_output=True, text=True,
                          env=environ, timeout=timeout, cwd=str(cache_dir.parent))


def _json(result: subprocess.CompletedProcess):
    assert result.stdout.strip(), f"no output; stderr:\n{result.stderr}"
    return json.loads(result.stdout)


@pytest.fixture
def three_specs(make_spec):
    return [make_spec(act="gelu"), make_spec(act="relu"), make_spec(dtype="float16", act="silu")]


@pytest.fixture
def populated(cache_dir, three_specs):
    """The cache folder with the three specs compiled for sm_90, in this process."""
    cache = KernelCache(cache_dir)
    return [cache.get(s, "sm_90") for s in three_specs]


def _write_spec_file(path, specs, arch="sm_90"):
    path.write_text("".join(json.dumps({"arch": arch, "spec": s.to_dict()}) + "\n" for s in specs))
    return path


# -- warm -------------------------------------------------------------------------------------------

def test_warm_dry_run_lists_the_preset(cache_dir):
    preset = pointwise.preset()
    KernelCache(cache_dir).get(preset[0], "sm_90")
    result = nvdnn(cache_dir, "warm", "--arch", "sm_90", "--preset", "pointwise", "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    rows = _json(result)
    assert len(rows) == len(preset)
    assert {r["uri"] for r in rows} == {s.uri for s in preset}
    assert {r["arch"] for r in rows} == {"sm_90"}
    assert [r["uri"] for r in rows if r["cached"]] == [preset[0].uri]
    assert len(list(KernelCache(cache_dir).entries())) == 1  # a dry run compiles nothing


def test_warm_spec_file_compiles_then_finds_everything_cached(cache_dir, three_specs, tmp_path):
    spec_file = _write_spec_file(tmp_path / "specs.jsonl", three_specs)
    first = nvdnn(cache_dir, "warm", "--arch", "sm_90", "--spec-file", str(spec_file), "--json", "-j", "2")
    assert first.returncode == 0, first.stderr
    summary = _json(first)
    assert (summary["compiled"], summary["cached"], summary["failed"]) == (3, 0, 0)
    assert summary["archs"] == ["sm_90"] and summary["folder"] == str(cache_dir)
    entries = [e for _, e, _ in KernelCache(cache_dir).entries()]
    assert sorted(e.uri for e in entries) == sorted(s.uri for s in three_specs)
    assert {e.arch for e in entries} == {"sm_90"}

    second = nvdnn(cache_dir, "warm", "--arch", "sm_90", "--spec-file", str(spec_file), "--json")
    assert second.returncode == 0, second.stderr
    summary = _json(second)
    assert (summary["compiled"], summary["cached"], summary["failed"]) == (0, 3, 0)


def test_warm_text_output_summarizes(cache_dir, three_specs, tmp_path):
    spec_file = _write_spec_file(tmp_path / "specs.jsonl", three_specs[:1])
    result = nvdnn(cache_dir, "warm", "--arch", "sm_80", "--spec-file", str(spec_file))
    assert result.returncode == 0, result.stderr
    assert "compiled 1, already cached 0, failed 0" in result.stdout
    assert f"[1/1] {three_specs[0].uri} [sm_80]" in result.stderr  # one progress line, not a tty


def test_warm_spec_file_without_arch_uses_the_recorded_archs(cache_dir, three_specs, tmp_path):
    spec_file = _write_spec_file(tmp_path / "specs.jsonl", three_specs[:1], arch="sm_80")
    result = nvdnn(cache_dir, "warm", "--spec-file", str(spec_file), "--json",
                   env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr
    assert [e.arch for _, e, _ in KernelCache(cache_dir).entries()] == ["sm_80"]


def test_warm_unknown_arch_exits_2_naming_it(cache_dir):
    for archs in ("sm_99", "sm_80,sm_99"):
        result = nvdnn(cache_dir, "warm", "--arch", archs, "--preset", "pointwise")
        assert result.returncode == 2
        assert "sm_99" in result.stderr and "arch" in result.stderr
        assert "Traceback" not in result.stderr
    assert not (cache_dir / "kernels").exists()


def test_warm_bad_spec_file_exits_2_naming_the_entry(cache_dir, three_specs, tmp_path):
    bad = three_specs[0].to_dict()
    bad["fields"]["block"] = 100
    spec_file = tmp_path / "specs.jsonl"
    spec_file.write_text(json.dumps({"arch": "sm_90", "spec": three_specs[1].to_dict()}) + "\n"
                         + json.dumps({"arch": "sm_90", "spec": bad}) + "\n")
    result = nvdnn(cache_dir, "warm", "--arch", "sm_90", "--spec-file", str(spec_file))
    assert result.returncode == 2
    assert str(spec_file) in result.stderr and "entry 2" in result.stderr and "block" in result.stderr
    assert "Traceback" not in result.stderr


def test_warm_with_nothing_to_do_exits_2(cache_dir):
    result = nvdnn(cache_dir, "warm", "--arch", "sm_90")
    assert result.returncode == 2 and "--preset" in result.stderr


@pytest.mark.parametrize("command", ["warm", "cache"])
def test_help_has_examples(cache_dir, command):
    result = nvdnn(cache_dir, command, "--help")
    assert result.returncode == 0
    assert "examples" in result.stdout and "nvdnn " + command in result.stdout


# -- cache ------------------------------------------------------------------------------------------

def test_cache_info_shows_the_entries(cache_dir, populated):
    result = nvdnn(cache_dir, "cache", "info", "--json")
    assert result.returncode == 0, result.stderr
    info = _json(result)
    assert info["folder"] == str(cache_dir)
    assert (info["entries"], info["bad"]) == (3, 0)
    assert info["bytes"] >= sum(len(b.cubin) for b in populated)
    assert info["writable"] is True and info["nvrtc"]


def test_cache_list_filters(cache_dir, populated, three_specs):
    result = nvdnn(cache_dir, "cache", "list", "--family", "pointwise", "--json")
    assert result.returncode == 0, result.stderr
    rows = _json(result)
    assert sorted(r["uri"] for r in rows) == sorted(s.uri for s in three_specs)
    assert sorted(r["key"] for r in rows) == sorted(b.key[:16] for b in populated)
    assert all(r["arch"] == "sm_90" and r["family"] == "pointwise" and r["spill_bytes"] == 0
               and r["registers"] > 0 and r["bytes"] > 0 for r in rows)

    assert _json(nvdnn(cache_dir, "cache", "list", "--family", "pool", "--json")) == []
    rows = _json(nvdnn(cache_dir, "cache", "list", "--dtype", "float16", "--arch", "sm_90", "--json"))
    assert [r["uri"] for r in rows] == [three_specs[2].uri]


def test_cache_verify_finds_and_repairs_a_corrupt_entry(cache_dir, populated):
    victim = KernelCache(cache_dir).path_of(populated[1].key)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))

    result = nvdnn(cache_dir, "cache", "verify")
    assert result.returncode == 1
    assert victim.name in result.stdout and "checksum" in result.stdout
    assert "2 good, 1 bad" in result.stdout

    repaired = nvdnn(cache_dir, "cache", "verify", "--repair", "--json")
    assert repaired.returncode == 0, repaired.stderr
    report = _json(repaired)
    assert report["good"] == 2 and report["repaired"] is True
    assert [b["file"] for b in report["bad"]] == [victim.name]
    assert not victim.exists()
    assert all(KernelCache(cache_dir).path_of(b.key).exists() for b in (populated[0], populated[2]))

    again = nvdnn(cache_dir, "cache", "verify")
    assert again.returncode == 0 and "2 good, 0 bad" in again.stdout


def test_cache_clear_removes_everything(cache_dir, populated):
    result = nvdnn(cache_dir, "cache", "clear", "--json")
    assert result.returncode == 0, result.stderr
    assert _json(result) == {"removed": 3}
    assert list(KernelCache(cache_dir).entries()) == []
    info = _json(nvdnn(cache_dir, "cache", "info", "--json"))
    assert info["entries"] == 0 and info["bytes"] == 0


# -- bundles and plan blobs ---------------------------------------------------------------------

def test_export_clear_import_verify_round_trip(cache_dir, three_specs, tmp_path):
    spec_file = _write_spec_file(tmp_path / "specs.jsonl", three_specs, arch="sm_90")
    assert nvdnn(cache_dir, "warm", "--spec-file", str(spec_file)).returncode == 0
    bundle = tmp_path / "kernels.tar"
    assert nvdnn(cache_dir, "cache", "export", str(bundle)).returncode == 0
    assert nvdnn(cache_dir, "cache", "clear").returncode == 0
    imported = nvdnn(cache_dir, "cache", "import", str(bundle), "--json")
    assert imported.returncode == 0 and json.loads(imported.stdout)["imported"] == 3
    verified = nvdnn(cache_dir, "cache", "verify", "--json")
    assert verified.returncode == 0 and json.loads(verified.stdout)["good"] == 3


def test_a_tampered_bundle_is_refused_naming_the_entry_and_adds_nothing(cache_dir, three_specs, tmp_path):
    import io
    import tarfile
    spec_file = _write_spec_file(tmp_path / "specs.jsonl", three_specs, arch="sm_90")
    assert nvdnn(cache_dir, "warm", "--spec-file", str(spec_file)).returncode == 0
    bundle, bad = tmp_path / "kernels.tar", tmp_path / "tampered.tar"
    assert nvdnn(cache_dir, "cache", "export", str(bundle)).returncode == 0
    with tarfile.open(bundle) as src, tarfile.open(bad, "w") as dst:
        members = src.getmembers()
        victim = next(m.name for m in members if m.name.endswith(".nvk"))
        for m in members:
            data = bytearray(src.extractfile(m).read())
            if m.name == victim:
                data[len(data) // 2] ^= 0x01
            info = tarfile.TarInfo(m.name)
            info.size = len(data)
            dst.addfile(info, io.BytesIO(bytes(data)))
    assert nvdnn(cache_dir, "cache", "clear").returncode == 0
    refused = nvdnn(cache_dir, "cache", "import", str(bad))
    assert refused.returncode == 2 and victim[:-4] in refused.stderr
    info = json.loads(nvdnn(cache_dir, "cache", "info", "--json").stdout)
    assert info["entries"] == 0


def test_plan_inspect_and_verify(cache_dir, tmp_path):
    from .graphs import three_kernel_graph
    blob = tmp_path / "model.plan"
    blob.write_bytes(three_kernel_graph("sm_90").build().serialize())
    inspected = nvdnn(cache_dir, "plan", "inspect", str(blob), "--json")
    assert inspected.returncode == 0
    info = json.loads(inspected.stdout)
    assert info["arch"] == "sm_90" and len(info["kernels"]) == 4 and info["graph"] == "three_outputs"
    assert nvdnn(cache_dir, "plan", "verify", str(blob)).returncode == 0
    data = bytearray(blob.read_bytes())
    data[-40] ^= 0x10
    blob.write_bytes(bytes(data))
    broken = nvdnn(cache_dir, "plan", "verify", str(blob))
    assert broken.returncode == 2 and "checksum" in broken.stderr


# -- no traceback, ever ------------------------------------------------------------------------------

def _one_line_error(result: subprocess.CompletedProcess, *names: str) -> None:
    """A bad argument, file or setting: one line on stderr naming it, exit 2; never a traceback."""
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert all(name in result.stderr for name in names), result.stderr


def test_missing_or_unreadable_files_are_one_line(cache_dir, tmp_path, three_specs):
    missing = tmp_path / "missing"
    _one_line_error(nvdnn(cache_dir, "plan", "inspect", str(missing)), str(missing))
    _one_line_error(nvdnn(cache_dir, "plan", "verify", str(missing)), str(missing))
    _one_line_error(nvdnn(cache_dir, "warm", "--arch", "sm_90", "--spec-file", str(missing)), str(missing))
    not_json = tmp_path / "specs.jsonl"
    not_json.write_text("{not json\n")
    _one_line_error(nvdnn(cache_dir, "warm", "--arch", "sm_90", "--spec-file", str(not_json)), str(not_json),
                    "line 1")
    bundle = tmp_path / "no-such-folder" / "kernels.tar"
    _one_line_error(nvdnn(cache_dir, "cache", "export", str(bundle)), str(bundle.parent))
    assert not bundle.parent.exists()
    record = tmp_path / "no-such-folder" / "specs.jsonl"
    spec_file = _write_spec_file(tmp_path / "one.jsonl", three_specs[:1])
    for jobs in ("1", "2"):
        result = nvdnn(cache_dir, "warm", "--spec-file", str(spec_file), "-j", jobs, env={"NVDNN_RECORD": str(record)})
        _one_line_error(result, "NVDNN_RECORD", str(record))


def test_a_miss_with_a_record_file_in_a_missing_folder_is_a_named_error(cache_dir, tmp_path, spec, monkeypatch):
    """In a program: the recording's folder is named, not a raw FileNotFoundError."""
    from nvdnn.errors import ValidationError
    monkeypatch.setenv("NVDNN_RECORD", str(tmp_path / "no-such-folder" / "specs.jsonl"))
    with pytest.raises(ValidationError, match="NVDNN_RECORD") as info:
        KernelCache(cache_dir).get(spec, "sm_90")
    assert info.value.arg == "NVDNN_RECORD"


def test_a_closed_pipe_ends_quietly(cache_dir, populated):
    for args in (["cache", "list", "--json"], ["warm", "--arch", "sm_90", "--preset", "pointwise", "--dry-run"]):
        environ = dict(os.environ, NVDNN_CACHE_DIR=str(cache_dir))
        proc = subprocess.Popen([sys.executable, "-m", "nvdnn", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=environ)
        proc.stdout.close()  # the reader is gone before the first line is written (`| head -0`)
        stderr = proc.stderr.read().decode()
        assert proc.wait(timeout=120) != 0 and stderr == "", stderr


def test_version(cache_dir):
    result = nvdnn(cache_dir, "--version")
    assert result.returncode == 0 and result.stdout.strip() == f"nvdnn {package.__version__}"


@pytest.mark.parametrize("jobs", ["0", "-2", "many"])
def test_jobs_must_be_a_positive_count(cache_dir, jobs):
    result = nvdnn(cache_dir, "warm", "--arch", "sm_90", "--preset", "pointwise", "-j", jobs)
    assert result.returncode == 2 and "-j/--jobs" in result.stderr and "Traceback" not in result.stderr
    assert not (cache_dir / "kernels").exists()


def test_every_option_and_argument_has_help():
    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, f"{path} {name}")
            elif action.dest != "help":
                yield f"{path} {'/'.join(action.option_strings) or action.dest}", action.help
    undocumented = [name for name, text in walk(cli.parser(), "nvdnn") if not text]
    assert undocumented == []


def test_help_no_longer_says_linear_layers_are_skipped(cache_dir):
    text = nvdnn(cache_dir, "warm", "--help").stdout
    sentences = re.split(r"[;.]\s", " ".join(text.split()))
    assert not [s for s in sentences if "skipped" in s and re.search(r"matmul|projection|\bfc\b", s)]
    assert all(models.missing_family(row.op) is None for m in models.MODELS.values() for row in m.layers
               if row.op == "matmul")


# -- one spelling of each data type and arch --------------------------------------------------------

def _one_bf16_spec_per_family() -> dict:
    picked = {}
    for name in warm.PRESETS:
        for spec in warm.PRESETS[name]():
            if spec.family not in picked and "bfloat16" in json.dumps(spec.to_dict()):
                picked[spec.family] = spec
    return picked


def test_cache_list_dtype_takes_any_spelling_and_matches_every_family(cache_dir, populated):
    picked = _one_bf16_spec_per_family()
    assert {"pointwise", "norm", "softmax", "reduce_rows", "pool", "matmul"} <= set(picked)
    cache = KernelCache(cache_dir)
    keys = {cache.get(spec, "sm_90").key[:16] for spec in picked.values()}
    for spelling in ("bf16", "bfloat16"):
        rows = _json(nvdnn(cache_dir, "cache", "list", "--dtype", spelling, "--json"))
        assert {r["key"] for r in rows} >= keys and {r["family"] for r in rows} == set(picked)
    fp16 = _json(nvdnn(cache_dir, "cache", "list", "--dtype", "fp16", "--json"))
    assert {r["key"] for r in fp16} == {populated[2].key[:16]}


@pytest.mark.parametrize("option, value", [("--family", "conv2d"), ("--dtype", "bf17"), ("--arch", "sm_99")])
def test_cache_list_refuses_unknown_filters(cache_dir, option, value):
    result = nvdnn(cache_dir, "cache", "list", option, value)
    assert result.returncode == 2 and value in result.stderr and "Traceback" not in result.stderr


def test_dry_run_and_cache_show_the_arch_a_kernel_is_built_for(cache_dir, tmp_path):
    wgmma = next(s for s in matmul.preset() if s.kernel == "wgmma")
    spec_file = _write_spec_file(tmp_path / "specs.jsonl", [wgmma])
    planned = _json(nvdnn(cache_dir, "warm", "--arch", "sm_90", "--spec-file", str(spec_file), "--dry-run", "--json"))
    assert [(r["arch"], r["cached"]) for r in planned] == [("sm_90a", False)]
    assert nvdnn(cache_dir, "warm", "--arch", "sm_90", "--spec-file", str(spec_file)).returncode == 0
    again = _json(nvdnn(cache_dir, "warm", "--arch", "sm_90", "--spec-file", str(spec_file), "--dry-run", "--json"))
    assert [(r["arch"], r["cached"]) for r in again] == [("sm_90a", True)]
    for arch in ("sm_90", "sm_90a"):  # a Hopper device's kernels, whichever way it is spelt
        listed = _json(nvdnn(cache_dir, "cache", "list", "--arch", arch, "--json"))
        assert [(r["uri"], r["arch"]) for r in listed] == [(wgmma.uri, "sm_90a")]
    assert _json(nvdnn(cache_dir, "cache", "list", "--arch", "sm_80", "--json")) == []


def test_the_cache_miss_hint_is_a_command_that_works(cache_dir, tmp_path, monkeypatch):
    """Follow the CacheMissError's advice literally: record, then run the command it gives."""
    specs = [next(s for s in matmul.preset() if s.kernel == "wgmma"), pointwise.preset()[0]]
    monkeypatch.setenv("NVDNN_NO_COMPILE", "1")
    with pytest.raises(CacheMissError) as info:
        KernelCache(cache_dir).get(specs[0], "sm_90")
    command = re.search(r"`nvdnn (.*?)`", str(info.value)).group(1).split()
    record = re.search(r"`NVDNN_RECORD=([^`]+)`", str(info.value)).group(1)
    monkeypatch.delenv("NVDNN_NO_COMPILE")
    monkeypatch.setenv("NVDNN_RECORD", str(tmp_path / record))
    for spec in specs:  # the program, run once where it may compile (another machine's cache)
        KernelCache(tmp_path / "elsewhere").get(spec, "sm_90")
    monkeypatch.delenv("NVDNN_RECORD")
    result = subprocess.run([sys.executable, "-m", "nvdnn", *command], capture_output=True, text=True,
                            env=dict(os.environ, NVDNN_CACHE_DIR=str(cache_dir)), cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    monkeypatch.setenv("NVDNN_NO_COMPILE", "1")
    for spec in specs:
        KernelCache(cache_dir).get(spec, "sm_90")
