"""The command line of every script, frozen: each option's spellings, default and choices, checked against
tests/fixtures/options/SCRIPT.json. A change to a command line (an option added, removed, renamed, another default
or choice) then fails here until the file is written again, so it shows up as a reviewed diff of that file:

    .venv/bin/python tests/test_options_frozen.py --write       # after an intended change; commit the files

The parser is caught at its first parse, before the script reads the command line, so nothing runs (no data, no
Accelerator). What a script decides after parsing (imdb.py's schedule by model) is not part of the parser.
"""

import argparse
import contextlib
import difflib
import json
import sys
from pathlib import Path

import pytest
from helpers import ROOT, load_script

import ddp_accel

FROZEN = ROOT / "tests" / "fixtures" / "options"
SCRIPTS = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "scripts").glob("*.py"))
REWRITE = "python tests/test_options_frozen.py --write"


class ParserCaught(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


class CatchingParser(ddp_accel.ArgumentParser):
    """The scripts' ArgumentParser, stopped at its first parse: the parser is built (set_defaults included), nothing
    after it runs."""

    def parse_known_args(self, args=None, namespace=None):
        raise ParserCaught(self)


@contextlib.contextmanager
def catching_parsers(module):
    saved = module.ArgumentParser
    module.ArgumentParser = CatchingParser
    try:
        yield
    finally:
        module.ArgumentParser = saved


def script_parser(script: str) -> argparse.ArgumentParser:
    """The parser `script` builds, from its main() (every script parses first thing; imdb.py and imagenet.py through
    their parse_args)."""
    module = load_script(script)
    with catching_parsers(module):
        try:
            module.main(None)
        except ParserCaught as caught:
            return caught.parser
    raise AssertionError(f"{script}: main() returned without parsing a command line")


def options_of(parser: argparse.ArgumentParser) -> dict:
    """Each option, by its spellings ("-b, --batch-size"; a positional by its name): its default (after the script's
    set_defaults), its choices, and whether --help hides it."""
    options = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        entry = {"default": parser.get_default(action.dest)}
        if action.choices is not None:
            entry["choices"] = list(action.choices)
        if action.help == argparse.SUPPRESS:
            entry["hidden"] = True
        options[", ".join(action.option_strings) or action.dest] = entry
    return json.loads(json.dumps(options, default=repr))  # tuples as lists: as the file reads back


def frozen_file(script: str) -> Path:
    return FROZEN / f"{Path(script).stem}.json"


def as_text(options: dict) -> str:
    """One option a line, so that a change is a one-line diff."""
    lines = [f"  {json.dumps(name)}: {json.dumps(entry)}" for name, entry in options.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.inprocess
def test_the_command_line_is_the_frozen_one(script):
    current = options_of(script_parser(script))
    path = frozen_file(script)
    assert path.is_file(), f"{script} has no frozen command line {path.relative_to(ROOT)}: run `{REWRITE}`"
    frozen = json.loads(path.read_text())
    if current != frozen:
        diff = difflib.unified_diff(
            as_text(frozen).splitlines(),
            as_text(current).splitlines(),
            f"{path.relative_to(ROOT)} (frozen)",
            f"{script} (now)",
            lineterm="",
        )
        pytest.fail(
            f"{script}'s command line changed:\n" + "\n".join(diff) + f"\nIf this is intended, run `{REWRITE}` and "
            "commit the file with the change.",
            pytrace=False,
        )


@pytest.mark.inprocess
def test_every_frozen_file_belongs_to_a_script():
    # a removed or renamed script leaves its file behind
    stale = sorted({path.stem for path in FROZEN.glob("*.json")} - {Path(script).stem for script in SCRIPTS})
    assert not stale, f"frozen command lines of no script: {stale}; run `{REWRITE}`"


def write() -> None:
    FROZEN.mkdir(parents=True, exist_ok=True)
    for stale in set(FROZEN.glob("*.json")) - {frozen_file(script) for script in SCRIPTS}:
        stale.unlink()
        print(f"removed {stale.relative_to(ROOT)}")
    for script in SCRIPTS:
        path = frozen_file(script)
        text = as_text(options_of(script_parser(script)))
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(f"usage: python {Path(__file__).relative_to(ROOT)} --write   (the tests run under pytest)")
    write()
