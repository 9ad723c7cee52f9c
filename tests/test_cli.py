"""The command line, run as `python -m nvdnn` in a subprocess with NVDNN_CACHE_DIR set."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nvdnn.cache import KernelCache
from nvdnn.kernels import pointwise


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

    assert _json(nvdnn(cache_dir, "cache", "list", "--family", "conv2d", "--json")) == []
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
