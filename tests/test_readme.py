"""The README's command list against the command line: each synopsis names only options that the command's parser
has, and every command of the CLI is listed. The parsers are built as `specmoe` builds them (`cli.build_parser`),
which imports no torch; `specmoe` alone takes `specmoe run`'s options."""

import re
from pathlib import Path

from specmoe.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def commands_section(text: str) -> list[str]:
    """The lines of the README's "## Commands" section."""
    lines = text.splitlines()
    start = lines.index("## Commands")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    return lines[start + 1:end]


def synopses(text: str) -> dict[str, str]:
    """Command name ('' for bare `specmoe`) -> the synopsis in the first cell of its row of the command table."""
    out = {}
    for line in commands_section(text):
        if not line.startswith("| `specmoe"):
            continue
        cell = re.split(r"(?<!\\)\|", line)[1].strip()
        assert cell.startswith("`") and cell.endswith("`"), line
        words = cell.strip("`").split()
        name = words[1] if len(words) > 1 and not words[1].startswith(("-", "[")) else ""
        assert name not in out, f"{name or 'specmoe'} is listed twice"
        out[name] = cell.strip("`")
    return out


def parsers() -> dict[str, object]:
    sub = build_parser()._subparsers._group_actions[0].choices
    return {"": sub["run"], **sub}


def test_readme_lists_every_command_with_only_its_own_options():
    listed = synopses((ROOT / "README.md").read_text())
    known = parsers()
    assert set(listed) == set(known), (f"not in the README: {sorted(set(known) - set(listed))}; "
                                       f"not commands: {sorted(set(listed) - set(known))}")
    for name, synopsis in listed.items():
        options = {o for action in known[name]._actions for o in action.option_strings}
        named = set(OPTION.findall(synopsis))
        assert named <= options, f"`{synopsis[:40]}...` names {sorted(named - options)}, not options of the command"


def test_synopses_are_found():
    """The parse above reads the table (guards against a reformatted table that would make it check nothing)."""
    listed = synopses((ROOT / "README.md").read_text())
    assert "--drafters" in listed["sd"] and "--set" in listed[""] and listed["compare"].startswith("specmoe compare")
