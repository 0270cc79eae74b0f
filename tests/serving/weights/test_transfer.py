"""push/pull round trips and every corruption case, against loopback moto S3 and file://."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from serving.weights import MANIFEST_NAME, WeightsError, ensure_local, pull, push, verify_dir


@dataclass
class Store:
    uri: str
    read: Callable[[str], bytes]
    write: Callable[[str], Callable[[bytes], None]]
    delete: Callable[[str], None]

    def rewrite(self, key: str, change: Callable[[bytes], bytes]) -> None:
        self.write(key)(change(self.read(key)))


@pytest.fixture(params=["s3", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "file":
        root = tmp_path / "store" / "v1"
        return Store(
            uri=f"file://{root}",
            read=lambda key: (root / key).read_bytes(),
            write=lambda key: (root / key).write_bytes,
            delete=lambda key: (root / key).unlink(),
        )
    import boto3

    bucket = request.getfixturevalue("s3_bucket")
    client = boto3.client("s3")

    def write(key: str) -> Callable[[bytes], None]:
        return lambda data: client.put_object(Bucket=bucket, Key=f"target/v1/{key}", Body=data)

    return Store(
        uri=f"s3://{bucket}/target/v1",
        read=lambda key: client.get_object(Bucket=bucket, Key=f"target/v1/{key}")["Body"].read(),
        write=write,
        delete=lambda key: client.delete_object(Bucket=bucket, Key=f"target/v1/{key}"),
    )


def _flip_byte(data: bytes) -> bytes:
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0x80
    return bytes(flipped)


def _no_partial_versions(cache: Path) -> bool:
    return not cache.exists() or not any(p.name.startswith(".") and p.suffix != ".lock" for p in cache.iterdir())


def test_round_trip_yields_identical_verified_files(store: Store, model_dir: Path, tmp_path: Path) -> None:
    pushed = push(model_dir, store.uri)
    result = pull(store.uri, tmp_path / "cache" / "target")
    assert result.fetched
    assert result.manifest == pushed
    assert verify_dir(result.path) == pushed
    for entry in pushed.files:
        assert (result.path / entry.path).read_bytes() == (model_dir / entry.path).read_bytes()
    assert _no_partial_versions(tmp_path / "cache")


def test_manifest_is_uploaded_and_parses(store: Store, model_dir: Path) -> None:
    pushed = push(model_dir, store.uri)
    assert json.loads(store.read(MANIFEST_NAME))["files"][1]["sha256"] == pushed.files[1].sha256


def test_pull_is_a_noop_when_the_verified_version_is_present(store: Store, model_dir: Path, tmp_path: Path) -> None:
    push(model_dir, store.uri)
    target = tmp_path / "cache" / "target"
    pull(store.uri, target)
    inode = (target / "model.safetensors").stat().st_ino
    assert not pull(store.uri, target).fetched
    assert (target / "model.safetensors").stat().st_ino == inode


def test_pull_replaces_a_corrupted_cached_version(store: Store, model_dir: Path, tmp_path: Path) -> None:
    push(model_dir, store.uri)
    target = tmp_path / "cache" / "target"
    pull(store.uri, target)
    (target / "config.json").write_text("{}")
    assert pull(store.uri, target).fetched
    verify_dir(target)
    assert _no_partial_versions(tmp_path / "cache")


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda s: s.rewrite("model.safetensors", _flip_byte), r"model\.safetensors: sha256 .* does not match"),
        (lambda s: s.rewrite("config.json", lambda b: b[:-3]), r"config\.json: size \d+ bytes, manifest says"),
        (lambda s: s.delete("tokenizer/vocab.txt"), r"tokenizer/vocab\.txt: missing from store"),
        (lambda s: s.rewrite(MANIFEST_NAME, lambda b: b[:40]), r"manifest\.json: not valid JSON"),
        (
            lambda s: s.rewrite(MANIFEST_NAME, lambda b: b.replace(b'"config.json"', b'"configs.json"')),
            r"configs\.json: missing from store",
        ),
        (lambda s: s.delete(MANIFEST_NAME), r"manifest\.json: missing from store"),
    ],
    ids=["flipped-byte", "truncated", "missing-file", "malformed-manifest", "wrong-manifest", "no-manifest"],
)
def test_failed_pull_names_the_file_and_leaves_no_partial_version(
    store: Store,
    model_dir: Path,
    tmp_path: Path,
    corrupt: Callable[[Store], None],
    message: str,
) -> None:
    push(model_dir, store.uri)
    corrupt(store)
    cache = tmp_path / "cache"
    with pytest.raises(WeightsError, match=message):
        pull(store.uri, cache / "target")
    assert not (cache / "target").exists()
    assert _no_partial_versions(cache)


def test_ensure_local_without_source_verifies_the_directory(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match=r"manifest\.json: manifest missing"):
        ensure_local(model_dir)


def test_unknown_scheme_is_refused(model_dir: Path) -> None:
    with pytest.raises(WeightsError, match="unsupported store URI"):
        push(model_dir, "gs://bucket/x")


def test_relative_file_uri_resolves_against_the_working_directory(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    push(model_dir, "file://.specdeploy/store/target/v1")
    assert (tmp_path / ".specdeploy/store/target/v1" / MANIFEST_NAME).is_file()
    assert pull("file://.specdeploy/store/target/v1", tmp_path / "cache").fetched
