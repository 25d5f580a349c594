"""The README and docs/ stand alone: every relative link (and #anchor) resolves, and nothing a user reads
depends on files outside the project."""

import re
from pathlib import Path

import pytest
from helpers import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # '#' lines in code blocks are not headings
    return {github_anchor(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
@pytest.mark.inprocess
def test_every_relative_link_resolves(page):
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.name}: link to {target} does not resolve"
        if anchor and resolved.suffix == ".md":
            assert anchor in anchors(resolved), f"{page.name}: no heading #{anchor} in {resolved.name}"


@pytest.mark.inprocess
def test_docs_and_code_do_not_depend_on_files_outside_the_project():
    readable = PAGES + [
        *ROOT.glob("ddp_accel/**/*.py"),
        *ROOT.glob("scripts/*"),
        *ROOT.glob("accelerate_configs/*"),
        *ROOT.glob("slurm/*"),
    ]
    for path in readable:
        text = path.read_text()
        for outside in ("DESIGN.md", "../shared"):
            assert outside not in text, f"{path.relative_to(ROOT)} mentions {outside}"


@pytest.mark.inprocess
def test_the_readme_training_script_runs_and_its_callback_is_called(tmp_path, monkeypatch):
    from helpers import check_ok, run_script

    text = (ROOT / "README.md").read_text()
    section = text.split("## Your own training script", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "my_train.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    output = check_ok(run_script(str(tmp_path / "my_train.py")))
    assert "step 10: lr " in output and "step 60: lr " in output, output[-2000:]
    assert (tmp_path / "outputs" / "my_run" / "model.safetensors").is_file()


@pytest.mark.inprocess
def test_the_architecture_page_names_every_module_of_the_package():
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "ddp_accel").rglob("*.py"))
        if path.name != "__init__.py" and path.name not in page
    ]
    assert not missing, f"docs/architecture.md does not name {missing}"
