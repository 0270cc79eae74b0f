"""The stdlib corpus split: deterministic, test-free, and held-out files never trained on."""

from __future__ import annotations

import sys

import pytest

from serving.demo import corpus


@pytest.fixture(scope="module")
def split():
    return corpus.split()


def test_heldout_disjoint_from_training(split):
    train, heldout = split
    assert heldout
    assert not set(train) & set(heldout)
    assert not set(train) & set(corpus.committed_heldout())


def test_heldout_fraction_is_about_three_percent(split):
    train, heldout = split
    assert 0.015 < len(heldout) / (len(train) + len(heldout)) < 0.06


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="held-out list was recorded from Python 3.11's stdlib")
def test_committed_list_matches_recomputed_split(split):
    assert split[1] == corpus.committed_heldout()


def test_corpus_excludes_tests_and_tables(split):
    for rel in split[0] + split[1]:
        parts = rel.split("/")
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts), rel
        assert parts[0] not in ("encodings", "pydoc_data"), rel
        assert not parts[-1].startswith("test_"), rel


def test_split_is_keyed_by_path_and_seed():
    assert corpus.is_heldout("json/__init__.py") == corpus.is_heldout("json/__init__.py")
    flips = sum(corpus.is_heldout(f"m{i}.py") != corpus.is_heldout(f"m{i}.py", seed=7) for i in range(2000))
    assert flips > 0
