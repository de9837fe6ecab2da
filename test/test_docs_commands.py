"""The commands in README.md and docs/ run as written: every flag they pass exists.

From each fenced ``bash`` block (lines joined at their ``\\`` continuations, comments dropped):

* ``python -m sglang.launch_server ...``: every ``--flag`` is an option of SGLang 0.5.23's parser
  with GRAFT's flags added;
* ``python|bash benchmark/X`` / ``scripts/X``: the file exists, and every ``--flag`` is one its
  ``--help`` lists (Python) or its text names (bash);

every ``--speculative-graft-*`` named anywhere in README and docs is a real flag (inline code too),
every ``SGLANG_GRAFT_*`` variable the package reads is in docs/flags.md, and the ``sgl.Engine``
keywords of the README's Python block are ServerArgs fields or GRAFT's ``speculative_graft_*``."""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SCRIPT = re.compile(r"(?:python3?|bash)\s+((?:benchmark|scripts|test)/[\w/.-]+)")


def _blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), flags=re.S)


def _commands(path: Path) -> list[str]:
    """The commands of a file's bash blocks, continuations joined, comments dropped."""
    out = []
    for block in _blocks(path, "bash"):
        joined = re.sub(r"\\\n", " ", block)
        out += [line.split(" #")[0].strip() for line in joined.splitlines() if line.strip() and
                not line.lstrip().startswith("#")]
    return out


@lru_cache(maxsize=None)
def _launch_options() -> frozenset[str]:
    from sglang.srt.server_args import ServerArgs

    from sglang_graft.config import add_cli_args

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    if "--speculative-graft-source" not in parser._option_string_actions:  # the plugin's hook not applied here
        add_cli_args(parser)
    return frozenset(parser._option_string_actions)


@lru_cache(maxsize=None)
def _script_options(script: str) -> str:
    path = ROOT / script
    if path.suffix == ".py":
        out = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=300,
                             cwd=ROOT)
        assert out.returncode == 0, f"{script} --help: {out.stderr[-1500:]}"
        return out.stdout
    return path.read_text()


def _doc_commands() -> list[tuple[str, str]]:
    return [(p.relative_to(ROOT).as_posix(), c) for p in DOCS for c in _commands(p)]


def test_the_docs_have_commands_to_check():
    commands = [c for _, c in _doc_commands()]
    assert sum("sglang.launch_server" in c for c in commands) >= 4
    assert any("scripts/demo.sh" in c for c in commands) and any("scripts/test.sh" in c for c in commands)


@pytest.mark.parametrize("where,command", _doc_commands())
def test_a_documented_command_uses_flags_that_exist(where, command):
    if "sglang.launch_server" in command:
        unknown = sorted(set(FLAG.findall(command)) - _launch_options())
        assert not unknown, f"{where}: {command}\n  not flags of sglang.launch_server: {unknown}"
        return
    m = SCRIPT.search(command)
    if m is None:
        return  # pip, git, export, ...: not ours to check
    script = m.group(1)
    assert (ROOT / script).is_file(), f"{where}: {script} does not exist"
    known = _script_options(script)
    tail = command[m.end():]
    unknown = [f for f in FLAG.findall(tail) if f not in known]
    assert not unknown, f"{where}: {command}\n  {script} has no {unknown}"


def test_every_graft_flag_named_in_the_docs_exists():
    from sglang_graft.config import _FLAGS, flag_name

    real = {flag_name(n) for n in _FLAGS}
    for path in DOCS:
        named = set(re.findall(r"--speculative-graft-[a-z-]*[a-z]", path.read_text()))
        assert named <= real, f"{path.name} names {sorted(named - real)}"


def test_every_environment_variable_the_package_reads_is_listed():
    read = set()
    for path in (ROOT / "python").rglob("*.py"):
        read |= set(re.findall(r"(?<![A-Z_])SGLANG_GRAFT_[A-Z_]*[A-Z]", path.read_text()))
    listed = set(re.findall(r"`(SGLANG_GRAFT_[A-Z_]*[A-Z])", (ROOT / "docs" / "flags.md").read_text()))
    assert read <= listed, sorted(read - listed)


def test_the_readme_engine_keywords_exist():
    from sglang.srt.server_args import ServerArgs

    from sglang_graft.config import KWARG_PREFIX, config_from_kwargs

    calls = [node for block in _blocks(ROOT / "README.md", "python") for node in ast.walk(ast.parse(block))
             if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "Engine"]
    assert calls
    fields = set(ServerArgs.__struct_fields__)
    for call in calls:
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        assert {k for k in kwargs if not k.startswith(KWARG_PREFIX)} <= fields
        config_from_kwargs({k: v for k, v in kwargs.items() if k.startswith(KWARG_PREFIX)})


def test_the_flag_groups_of_the_help_are_the_tables_of_the_flags_doc():
    from sglang_graft.config import _FLAGS, FLAG_GROUPS

    names = [n for group in FLAG_GROUPS.values() for n in group]
    assert sorted(names) == sorted(_FLAGS)  # every flag in exactly one group
    doc = (ROOT / "docs" / "flags.md").read_text()
    for title, group in FLAG_GROUPS.items():
        section = doc.split(f"## {title[0].upper()}{title[1:]}\n", 1)
        assert len(section) == 2, f"docs/flags.md has no section '{title}'"
        table = section[1].split("\n## ", 1)[0]
        listed = re.findall(r"^\| `([a-z-]+)`(?:, `([a-z-]+)`)? \|", table, flags=re.M)
        assert sorted(x.replace("-", "_") for pair in listed for x in pair if x) == sorted(group), title
