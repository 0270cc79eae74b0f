from __future__ import annotations

import json
from pathlib import Path

import pytest

from serving.weights import MANIFEST_NAME, Manifest, WeightsError, build_manifest, verify_dir


def _write_manifest(directory: Path) -> Manifest:
    manifest = build_manifest(directory)
    (directory / MANIFEST_NAME).write_text(manifest.to_json())
    return manifest


def test_manifest_lists_every_file_with_size_and_sha256(model_dir: Path) -> None:
    manifest = build_manifest(model_dir)
    assert [e.path for e in manifest.files] == ["config.json", "model.safetensors", "tokenizer/vocab.txt"]
    assert manifest.files[0].size == len('{"hidden_size": 8}\n')
    assert all(len(e.sha256) == 64 for e in manifest.files)


def test_manifest_json_round_trips(model_dir: Path) -> None:
    manifest = build_manifest(model_dir)
    assert Manifest.from_json(manifest.to_json()) == manifest


def test_verify_accepts_an_intact_directory(model_dir: Path) -> None:
    manifest = _write_manifest(model_dir)
    assert verify_dir(model_dir) == manifest


def test_verify_names_a_file_with_a_flipped_byte(model_dir: Path) -> None:
    _write_manifest(model_dir)
    target = model_dir / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[1000] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=r"model\.safetensors: sha256"):
        verify_dir(model_dir)


def test_verify_names_a_truncated_file(model_dir: Path) -> None:
    _write_manifest(model_dir)
    (model_dir / "config.json").write_text("{")
    with pytest.raises(WeightsError, match=r"config\.json: size 1 bytes"):
        verify_dir(model_dir)


def test_verify_names_a_missing_file(model_dir: Path) -> None:
    _write_manifest(model_dir)
    (model_dir / "tokenizer" / "vocab.txt").unlink()
    with pytest.raises(WeightsError, match=r"tokenizer/vocab\.txt: missing"):
        verify_dir(model_dir)


def test_verify_names_a_file_the_manifest_does_not_list(model_dir: Path) -> None:
    _write_manifest(model_dir)
    (model_dir / "extra.bin").write_bytes(b"x")
    with pytest.raises(WeightsError, match=r"extra\.bin: not listed"):
        verify_dir(model_dir)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("not json", "not valid JSON"),
        (json.dumps({"format": 1, "files": []}), "non-empty list"),
        (json.dumps({"format": 1, "files": [{"path": "../x", "size": 1, "sha256": "0" * 64}]}), "unsafe"),
        (json.dumps({"format": 1, "files": [{"path": "a", "size": -1, "sha256": "0" * 64}]}), "invalid size"),
        (json.dumps({"format": 1, "files": [{"path": "a", "size": 1, "sha256": "xyz"}]}), "invalid sha256"),
    ],
)
def test_malformed_manifest_is_refused_naming_the_manifest(body: str, message: str) -> None:
    with pytest.raises(WeightsError, match=rf"manifest\.json: .*{message}"):
        Manifest.from_json(body)


def test_a_symlinked_file_pointing_outside_is_refused(model_dir: Path, tmp_path: Path) -> None:
    manifest = _write_manifest(model_dir)
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes((model_dir / "model.safetensors").read_bytes())  # same bytes: only the link is wrong
    (model_dir / "model.safetensors").unlink()
    (model_dir / "model.safetensors").symlink_to(outside)
    with pytest.raises(WeightsError, match=r"model\.safetensors: is a symbolic link"):
        verify_dir(model_dir, manifest)


def test_a_symlinked_directory_is_refused(model_dir: Path, tmp_path: Path) -> None:
    _write_manifest(model_dir)
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "payload.bin").write_bytes(b"not listed anywhere")
    (model_dir / "plugins").symlink_to(hidden, target_is_directory=True)
    with pytest.raises(WeightsError, match=r"plugins: is a symbolic link"):
        verify_dir(model_dir)


def test_a_listed_file_under_a_symlinked_parent_is_refused(model_dir: Path, tmp_path: Path) -> None:
    manifest = _write_manifest(model_dir)
    moved = tmp_path / "tokenizer-outside"
    (model_dir / "tokenizer").rename(moved)
    (model_dir / "tokenizer").symlink_to(moved, target_is_directory=True)
    with pytest.raises(WeightsError, match=r"tokenizer: is a symbolic link"):
        verify_dir(model_dir, manifest)


def test_building_a_manifest_refuses_symlinks(model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "outside.txt").write_text("x")
    (model_dir / "link.txt").symlink_to(tmp_path / "outside.txt")
    with pytest.raises(WeightsError, match=r"link\.txt: is a symbolic link"):
        build_manifest(model_dir)


def test_a_symlinked_manifest_is_refused(model_dir: Path, tmp_path: Path) -> None:
    manifest = build_manifest(model_dir)
    elsewhere = tmp_path / "manifest-elsewhere.json"
    elsewhere.write_text(manifest.to_json())
    (model_dir / MANIFEST_NAME).symlink_to(elsewhere)
    with pytest.raises(WeightsError, match=r"manifest\.json: is a symbolic link"):
        verify_dir(model_dir)


@pytest.mark.parametrize("spelling", ["./config.json", "tokenizer//vocab.txt", "tokenizer/./vocab.txt", "tokenizer/"])
def test_non_canonical_paths_are_refused(spelling: str) -> None:
    body = json.dumps({"format": 1, "files": [{"path": spelling, "size": 1, "sha256": "0" * 64}]})
    with pytest.raises(WeightsError, match="unsafe or invalid path"):
        Manifest.from_json(body)


def test_the_same_file_listed_under_two_spellings_is_refused() -> None:
    entry = {"size": 1, "sha256": "0" * 64}
    body = json.dumps({"format": 1, "files": [{"path": "config.json", **entry}, {"path": "./config.json", **entry}]})
    with pytest.raises(WeightsError, match=r"manifest\.json: "):
        Manifest.from_json(body)
