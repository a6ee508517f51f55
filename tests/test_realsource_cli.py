"""The real-source soak's command line (``python -m tests.realsource``), without a source."""

from __future__ import annotations


def test_the_soak_removes_its_own_folder_after_a_clean_run_and_keeps_it_otherwise(tmp_path, capsys):
    """``python -m tests.realsource`` without ``--work`` left ~0.5 GB in /tmp per run."""
    from tests.realsource.__main__ import put_away

    folders = {}
    for name, owned, failed in (("clean", True, False), ("differed", True, True), ("given", False, False)):
        folders[name] = tmp_path / name
        (folders[name] / "cdc_home").mkdir(parents=True)
        (folders[name] / "cdc_home" / "catalog.db").write_text("x")
        put_away(folders[name], owned=owned, failed=failed)
    assert not folders["clean"].exists()
    assert (folders["differed"] / "cdc_home" / "catalog.db").exists() and (folders["given"] / "cdc_home").exists()
    assert f"work folder kept: {folders['differed']}" in capsys.readouterr().out
