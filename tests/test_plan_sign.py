"""Signed plan blobs: an HMAC-SHA256 trailer under a key from code or a file
(NVDNN_PLAN_KEY_FILE, `--key-file`), required whenever a key is given; `nvdnn plan sign` /
`verify --key-file`. The checksum alone proves integrity; only a signature ties a blob to a key
holder."""
from __future__ import annotations

import hashlib
import hmac
import json
import os

import pytest

import nvdnn
from nvdnn import cli, config, plan, plan_sign
from nvdnn.errors import PlanFormatError, ValidationError
from tests.blobs import build, refused, seal, split

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build(tmp_path_factory)


@pytest.fixture
def signed(built):
    return built.graph.serialize(key=KEY)


def _key_file(tmp_path, data=KEY, name="plan.key"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_a_signed_blob_is_the_blob_and_its_hmac(built, signed):
    assert signed[:len(built.blob)] == built.blob
    assert signed[len(built.blob):] == b"NVDNNSIG" + hmac.new(KEY, built.blob, hashlib.sha256).digest()
    assert nvdnn.Graph.deserialize(signed, key=KEY).explain() == built.graph.explain()
    assert nvdnn.Graph.deserialize(signed).explain() == built.graph.explain()   # no key: integrity only


def test_a_key_requires_a_signature(built):
    error = refused(built.blob, key=KEY)
    assert error.field == "signature" and "not signed" in str(error)


def test_another_key_is_refused(signed):
    assert refused(signed, key=OTHER).field == "signature"


def test_a_change_resealed_under_a_kept_signature_is_refused(built, signed):
    _, header, images = split(built.blob)
    header["workspace_size"] += 256           # checksum recomputed; the signature is the old one
    forged = seal(header, images) + signed[len(built.blob):]
    error = refused(forged, key=KEY)
    assert error.field == "signature" and "changed after signing" in str(error)


@pytest.mark.parametrize("where", ["mac", "magic"])
def test_a_damaged_signature_is_refused(built, signed, where):
    data = bytearray(signed)
    data[-1 if where == "mac" else len(built.blob)] ^= 0x01
    assert refused(bytes(data), key=KEY).field == ("signature" if where == "mac" else "length")


def test_a_stripped_signature_is_refused(built, signed):
    assert refused(signed[:len(built.blob)], key=KEY).field == "signature"
    assert refused(signed[:-1], key=KEY).field == "length"


@pytest.mark.parametrize("key,rule", [("a string key of enough length....", "bytes"), (b"short", "at least 32")])
def test_keys_are_32_bytes_or_more(built, key, rule):
    with pytest.raises(ValidationError, match=rule) as info:
        built.graph.serialize(key=key)
    assert info.value.arg == "key"
    with pytest.raises(ValidationError, match=rule):
        nvdnn.Graph.deserialize(built.blob, key=key)


def test_sign_replaces_a_signature_and_checks_the_blob_first(built, signed):
    again = plan.sign(signed, OTHER)
    assert len(again) == len(signed) and nvdnn.Graph.deserialize(again, key=OTHER)
    assert refused(again, key=KEY).field == "signature"
    with pytest.raises(PlanFormatError) as info:
        plan.sign(built.blob[:-1], KEY)
    assert info.value.field == "length"


# -- the setting: a key file that signs and refuses -------------------------------------------------

def test_the_setting_is_in_the_table():
    assert "NVDNN_PLAN_KEY_FILE" in config.SETTINGS
    assert any(row["name"] == "NVDNN_PLAN_KEY_FILE" for row in config.describe())


def test_the_key_file_setting_refuses_unsigned_blobs_and_signs(built, tmp_path, monkeypatch):
    monkeypatch.setenv("NVDNN_PLAN_KEY_FILE", str(_key_file(tmp_path)))
    assert refused(built.blob).field == "signature"
    blob = built.graph.serialize()
    assert blob.endswith(plan_sign.trailer(built.blob, KEY))
    assert nvdnn.Graph.deserialize(blob).explain() == built.graph.explain()
    assert refused(plan.sign(blob, OTHER)).field == "signature"


@pytest.mark.parametrize("kind", ["missing", "short", "directory", "fifo", "large"])
def test_a_bad_key_file_is_a_validation_error_naming_it(built, tmp_path, monkeypatch, kind):
    path = tmp_path / "plan.key"
    if kind == "short":
        path.write_bytes(b"0123456789")
    elif kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "large":
        with open(path, "wb") as out:
            out.truncate(1 << 30)         # sparse: never read
    monkeypatch.setenv("NVDNN_PLAN_KEY_FILE", str(path))
    with pytest.raises(ValidationError) as info:
        nvdnn.Graph.deserialize(built.blob)
    assert str(path) in str(info.value)


# -- the command line ----------------------------------------------------------------------------------

def _cli(capsys, *args):
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_sign_then_verify_with_the_key_file(built, tmp_path, capsys):
    blob, key = tmp_path / "model.plan", _key_file(tmp_path)
    blob.write_bytes(built.blob)
    code, out, _ = _cli(capsys, "plan", "verify", str(blob))
    assert code == 0 and "integrity only: not signed" in out
    assert _cli(capsys, "plan", "verify", str(blob), "--key-file", str(key))[0] == 2
    code, out, _ = _cli(capsys, "plan", "sign", str(blob), "--key-file", str(key))
    assert code == 0 and blob.read_bytes() == built.graph.serialize(key=KEY)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []
    code, out, _ = _cli(capsys, "plan", "verify", str(blob), "--key-file", str(key), "--json")
    assert code == 0 and json.loads(out) == {"blob": str(blob), "ok": True, "signed": True, "signature_verified": True}
    code, out, _ = _cli(capsys, "plan", "inspect", str(blob), "--json")
    assert code == 0 and json.loads(out)["signed"] is True
    code, _, err = _cli(capsys, "plan", "verify", str(blob), "--key-file", str(_key_file(tmp_path, OTHER, "other")))
    assert code == 2 and err.startswith("nvdnn: signature: ")


def test_plan_verify_takes_the_key_file_setting(built, tmp_path, capsys, monkeypatch):
    blob = tmp_path / "model.plan"
    blob.write_bytes(built.blob)
    monkeypatch.setenv("NVDNN_PLAN_KEY_FILE", str(_key_file(tmp_path)))
    code, _, err = _cli(capsys, "plan", "verify", str(blob))
    assert code == 2 and "not signed" in err
    assert _cli(capsys, "plan", "sign", str(blob))[0] == 0
    code, out, _ = _cli(capsys, "plan", "verify", str(blob))
    assert code == 0 and "signature verified" in out


def test_plan_sign_without_a_key_or_of_a_damaged_blob_changes_nothing(built, tmp_path, capsys):
    blob = tmp_path / "model.plan"
    blob.write_bytes(built.blob)
    code, _, err = _cli(capsys, "plan", "sign", str(blob))
    assert code == 2 and "--key-file" in err and blob.read_bytes() == built.blob
    blob.write_bytes(built.blob[:-1])
    code, _, err = _cli(capsys, "plan", "sign", str(blob), "--key-file", str(_key_file(tmp_path)))
    assert code == 2 and blob.read_bytes() == built.blob[:-1]
