"""The configuration reference page is generated from the config dataclasses and current."""

from __future__ import annotations

import dataclasses

from areal.config import RunConfig, describe_options
from areal.config_docs import PAGE, _cell, main, render


def test_the_committed_page_is_current():
    assert PAGE.read_text() == render(), (
        "docs/reference/configuration.md is stale: run `python -m areal.config_docs`"
    )


def test_every_option_appears_with_its_default_and_help():
    page = render()
    for key, default, help_text in describe_options():
        row = next((line for line in page.splitlines() if line.startswith(f"| `{key}` |")), None)
        assert row is not None, f"{key} missing from the page"
        assert f"`{default}`" in row, (key, default, row)
        first_words = " ".join(help_text.split("[")[0].split()[:3])
        assert _cell(first_words) in row, (key, row)


def test_types_are_shown_as_annotated():
    page = render()
    assert (
        "| `run_dir` | str \\| None | `null` | output directory; null: runs/&lt;timestamp&gt; |"
        in page
    )
    assert "| `rollout.devices` | list[str] | `[]` |" in page
    assert "(one of: `async`, `sync`)" in page


def test_check_fails_on_a_stale_page_and_writing_fixes_it(tmp_path, capsys):
    out = tmp_path / "configuration.md"
    out.write_text("# old\n")
    assert main(["--check", "--out", str(out)]) == 1
    assert "not current" in capsys.readouterr().err
    assert main(["--out", str(out)]) == 0
    assert main(["--check", "--out", str(out)]) == 0


def test_every_section_has_a_heading():
    page = render()
    sections = [
        f.name
        for f in dataclasses.fields(RunConfig)
        if f.default_factory is not dataclasses.MISSING
        and dataclasses.is_dataclass(f.default_factory())
    ]
    for name in sections:
        assert f"## `{name}`" in page
