"""``dcr <command> --help`` for every command: placeholders as the README writes them (``LOG``,
``--receiver DIR``), never typer's raw ``{log}`` or a flag's ``<bool>``, and help strings whose
only line breaks are paragraph breaks (the renderer wraps; a break in the source would cut a
sentence in the middle of the terminal line)."""

from __future__ import annotations

import re

import pytest
import typer

from dcr_log.cli import app, main
from dcr_log.cli.app import help_text

PLACEHOLDER = re.compile(r"\{[A-Za-z_][A-Za-z0-9_]*\}")  # typer's usage for a required argument: {log}
BREAK_IN_A_PARAGRAPH = re.compile(r"[^\n]\n(?!\n)")


def _commands(group=None, path=()):
    """(command path, click command) for the group and every command under it."""
    group = typer.main.get_command(app) if group is None else group
    yield path, group
    for name, cmd in getattr(group, "commands", {}).items():
        yield from _commands(cmd, (*path, name))


COMMANDS = [path for path, _ in _commands()]


def test_every_command_is_listed():
    assert {"init", "append", "apply", "gc", "mirror", "cache"} <= {p[0] for p in COMMANDS if p}
    assert ("cache", "ls") in COMMANDS and len(COMMANDS) >= 20


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "dcr")
def test_help_has_no_raw_placeholders(path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert main([*path, "--help"]) == 0
    text = capsys.readouterr().out
    assert "Usage:" in text and "--help" in text
    assert not PLACEHOLDER.search(text), PLACEHOLDER.findall(text)
    assert "<bool>" not in text
    usage = next(line for line in text.splitlines() if "Usage:" in line)
    assert not re.search(r"[{}<>]", usage), usage
    assert all(len(line.rstrip()) <= 100 for line in text.splitlines())  # wrapped to the terminal


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "dcr")
def test_help_strings_break_only_between_paragraphs(path):
    cmd = dict(_commands())[path]
    texts = {"command": cmd.help or ""}
    texts.update({f"{p.name}": getattr(p, "help", None) or "" for p in cmd.params})
    for what, text in texts.items():
        assert not BREAK_IN_A_PARAGRAPH.search(text), (what, text)
        assert text == text.strip(), (what, text)


def test_help_text_joins_a_paragraph_and_keeps_paragraphs_apart():
    doc = """First sentence that goes
        on. Second

        Another paragraph
        here."""
    assert help_text(doc) == "First sentence that goes on. Second\n\nAnother paragraph here."
    assert help_text(None) == ""


def test_init_help_states_the_writer_default_features():
    from dcr_log.cli.write_commands import FEATURES_DEFAULT
    from dcr_log.write.sharded import DEFAULT_FEATURES

    assert FEATURES_DEFAULT == ",".join(DEFAULT_FEATURES)


def test_arguments_named_in_usage(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["show", "--help"]) == 0
    assert "show [OPTIONS] LOG VERSION" in capsys.readouterr().out
    assert main(["apply", "--help"]) == 0
    text = capsys.readouterr().out
    assert "apply [OPTIONS] LOG" in text and "--receiver" in text and " DIR " in text


@pytest.mark.parametrize("path", [(), ("cache",)], ids=["dcr", "dcr cache"])
def test_a_group_without_a_command_prints_its_help_then_one_usage_line(path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert main(list(path)) == 2
    captured = capsys.readouterr()
    usage = captured.out.splitlines()[0]
    assert usage.startswith("Usage: ") and usage.endswith(" ".join((*path, "[OPTIONS] COMMAND [ARGS]...")))
    assert "Commands:" in captured.out
    assert captured.err.splitlines() == ["dcr: usage: missing command (see --help)"]


def test_the_command_list_gives_each_first_paragraph_whole(capsys, monkeypatch):
    """click would cut a command's line at its first sentence, with "...". (Compared without
    whitespace: the lines are wrapped, at a hyphen too.)"""
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["--help"]) == 0
    text = "".join(capsys.readouterr().out.split())
    for path, cmd in _commands():
        if len(path) == 1:
            first = "".join((cmd.help or "").split("\n\n")[0].split())
            assert first and first in text, (path, first)
    assert "..." not in text.replace("[ARGS]...", "")


@pytest.mark.parametrize("columns", ["60", "80", "100"])
def test_no_help_line_ends_at_a_hyphen(columns, capsys, monkeypatch):
    """A flag (--allow-layout-change, --no-snapshot) or a path (~/.cache/dcr-log) stays whole
    on its line: click would wrap after its hyphens."""
    monkeypatch.setenv("COLUMNS", columns)
    ended = []
    for path in COMMANDS:
        assert main([*path, "--help"]) == 0
        text = capsys.readouterr().out
        assert "\u2011" not in text  # the held hyphens are given back
        ended += [(path, line) for line in text.splitlines() if line.rstrip().endswith("-")]
    assert not ended, ended[:5]
