"""Where the strict schema checks find the real JobSet CRD (tests/jobset_crd.py): the pinned version, from the
cluster build's cache first, then the Go module cache; a skip only when it is nowhere, saying where it looked.
Over made-up directories: nothing is downloaded here."""

from __future__ import annotations

import shutil

import pytest

from tests import jobset_crd
from tests.cluster.build import build, versions


def test_the_version_is_the_clusters_pin():
    assert jobset_crd.version() == versions()["JOBSET"]
    assert f"jobset-{jobset_crd.version()}" in build().dir.name


def test_the_cluster_builds_copy_comes_first(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUJOB_CLUSTER_CACHE", str(tmp_path))
    crd = build().manifests / jobset_crd.IN_BUILD
    crd.parent.mkdir(parents=True)
    crd.write_text("kind: CustomResourceDefinition\n")
    monkeypatch.setattr(jobset_crd, "_go", lambda *a, **k: pytest.fail("Go asked although the build has the CRD"))
    assert jobset_crd.find() == (crd, f"the cluster build's cache (JobSet {jobset_crd.version()})")


@pytest.mark.skipif(shutil.which("go") is None, reason="no Go on PATH: `go env GOMODCACHE` cannot be asked")
def test_then_the_go_module_cache_at_the_pinned_version(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUJOB_CLUSTER_CACHE", str(tmp_path / "no-build"))
    monkeypatch.setenv("GOMODCACHE", str(tmp_path / "mod"))
    other = tmp_path / "mod" / f"{jobset_crd.MODULE}@v0.0.1" / jobset_crd.IN_MODULE
    other.parent.mkdir(parents=True)
    other.write_text("kind: CustomResourceDefinition\n")
    assert jobset_crd.in_module_cache() is None  # another version is not the pinned one
    crd = tmp_path / "mod" / f"{jobset_crd.MODULE}@{jobset_crd.version()}" / jobset_crd.IN_MODULE
    crd.parent.mkdir(parents=True)
    crd.write_text("kind: CustomResourceDefinition\n")
    assert jobset_crd.find() == (crd, f"the Go module cache (JobSet {jobset_crd.version()})")


def test_nowhere_is_a_reason_that_names_every_place(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUJOB_CLUSTER_CACHE", str(tmp_path))
    monkeypatch.setattr(jobset_crd.shutil, "which", lambda name: None)  # no Go
    monkeypatch.setattr(jobset_crd, "SHARED", tmp_path / "shared" / "schemas" / "x.yaml")
    path, why = jobset_crd.find()
    assert path is None
    assert str(tmp_path) in why and "Go module cache" in why and "no Go on PATH" in why and "x.yaml" in why, why
