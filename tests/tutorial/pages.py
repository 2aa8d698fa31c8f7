"""The steps of a documentation page, read from its fenced blocks and their markers.

Every fenced block of a page under test carries a marker, an HTML comment on the line
right before its opening fence (invisible in the rendered page), that says what a reader
does with it::

    <!-- test: run -->               each line is a shell command, run in order (`cd DIR`
                                     moves to DIR for the following commands)
    <!-- test: output -->            what the last command of the previous `run` block prints
                                     (`...` stands for any text, spaces are not compared)
    <!-- test: write PATH -->        the block is the whole file PATH
    <!-- test: append PATH -->       the block is added at the end of PATH
    <!-- test: start -->             each line is a long-running command (a worker, beat),
                                     started in the background and kept up to the end
    <!-- test: shell -->             the command that opens a Python shell; the `session`
                                     blocks that follow are typed into it
    <!-- test: session -->           a Python session (`>>>` lines and what they print)
    <!-- test: skip WHY -->          not run, and why

``; variant NAME`` after the action limits a block to one variant of the page (the tabs of
a choice, such as PostgreSQL or SQLite); the page is run once per variant. A fenced block
without a marker is an error, so a new block cannot go untested by oversight.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

#: Actions a marker may name, and whether they take an argument.
ACTIONS = {
    "run": False,
    "output": False,
    "write": True,
    "append": True,
    "start": False,
    "shell": False,
    "session": False,
    "skip": True,
}

MARKER = re.compile(r"^\s*<!--\s*test:\s*(?P<body>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")


class PageError(ValueError):
    """A page whose blocks cannot be run: an unmarked block, an unknown action, ..."""


@dataclass(frozen=True)
class Step:
    """One fenced block and what its marker says to do with it."""

    action: str
    #: The marker's argument: a path for write/append, the reason for skip, else "".
    arg: str
    #: The variant the block belongs to ("" for every variant).
    variant: str
    #: The block's text, without the fence and the common indentation.
    body: str
    #: 1-based line of the opening fence, for messages.
    line: int
    lang: str = ""

    def lines(self) -> list[str]:
        """The non-blank lines of the block that are not comments (commands)."""
        return [
            line.strip()
            for line in self.body.splitlines()
            if line.strip() and not line.strip().startswith("#")
        ]

    def where(self, page: Path | str) -> str:
        return f"{page}:{self.line} ({self.action}{' ' + self.arg if self.arg else ''})"


def parse_marker(text: str, line: int) -> tuple[str, str, str]:
    """``"append proj/settings.py; variant sqlite"`` -> ``("append", "proj/settings.py",
    "sqlite")``."""
    head, _, rest = text.partition(";")
    action, _, arg = head.strip().partition(" ")
    if action not in ACTIONS:
        raise PageError(f"line {line}: unknown action {action!r} (one of {sorted(ACTIONS)})")
    if ACTIONS[action] != bool(arg.strip()):
        need = "needs an argument" if ACTIONS[action] else "takes no argument"
        raise PageError(f"line {line}: {action!r} {need}")
    variant = ""
    if rest.strip():
        word, _, name = rest.strip().partition(" ")
        if word != "variant" or not name.strip() or " " in name.strip():
            raise PageError(f"line {line}: after ';' expected 'variant NAME', got {rest!r}")
        variant = name.strip()
    return action, arg.strip(), variant


@dataclass(frozen=True)
class Block:
    """A fenced block: its language, text (fence and indentation removed) and place."""

    lang: str
    body: str
    #: 0-based index of the opening fence's line.
    index: int


def blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, in order (indented ones, in tabs, too)."""
    lines = text.splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        start = i
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i == len(lines):
            raise PageError(f"line {start + 1}: the block opened here is never closed")
        i += 1
        found.append(Block(opening["lang"], "\n".join(body) + "\n", start))
    return found


def steps(text: str) -> list[Step]:
    """The page's fenced blocks in order, each with its marker's action."""
    lines = text.splitlines()
    found: list[Step] = []
    for block in blocks(text):
        before = block.index - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = MARKER.match(lines[before]) if before >= 0 else None
        if marker is None:
            raise PageError(
                f"line {block.index + 1}: a fenced block without a marker (put "
                "'<!-- test: run -->', '<!-- test: skip WHY -->', ... on the line before it)"
            )
        action, arg, variant = parse_marker(marker["body"], before + 1)
        step = Step(action, arg, variant, block.body, block.index + 1, block.lang)
        check_named_file(step)
        found.append(step)
    check_order(found)
    return found


def section(text: str, heading: str) -> str:
    """The part of a Markdown text under ``heading`` (a ``## ...`` line), up to the next
    heading of the same or a higher level."""
    lines = text.splitlines()
    level = len(heading) - len(heading.lstrip("#"))
    try:
        start = lines.index(heading)
    except ValueError:
        raise PageError(f"no heading {heading!r}") from None
    end = start + 1
    fence = ""
    while end < len(lines):
        line = lines[end]
        opening = FENCE.match(line)
        if fence and line.strip().startswith(fence):
            fence = ""
        elif not fence and opening:
            fence = opening["fence"]
        elif not fence:
            hashes = len(line) - len(line.lstrip("#"))
            if 0 < hashes <= level and line[hashes : hashes + 1] == " ":
                break
        end += 1
    return "\n".join(lines[start:end]) + "\n"


def check_named_file(step: Step) -> None:
    """A block that opens with ``# some/file.py`` writes that file and no other."""
    first = step.body.split("\n", 1)[0].strip()
    named = re.match(r"#\s*([\w./-]+\.\w+)\b", first)
    if named and step.action in {"write", "append"} and named[1] != step.arg:
        raise PageError(
            f"line {step.line}: the block says it is {named[1]} but its marker {step.action}s "
            f"{step.arg}"
        )


def check_order(found: list[Step]) -> None:
    """An ``output`` follows a ``run``; ``session`` blocks follow a ``shell``."""
    previous: Step | None = None
    in_shell = False
    for step in found:
        if step.action == "output" and (previous is None or previous.action != "run"):
            raise PageError(f"line {step.line}: an output block must follow a run block")
        if step.action == "session" and not in_shell:
            raise PageError(f"line {step.line}: a session block must follow a shell block")
        if step.action == "shell":
            in_shell = True
        elif step.action not in {"session", "skip"}:
            in_shell = False
        if step.action != "skip":
            previous = step


def variants(found: list[Step]) -> list[str]:
    """The variants the page names, in the order it names them (``[""]`` if none)."""
    names = list(dict.fromkeys(s.variant for s in found if s.variant))
    return names or [""]


def for_variant(found: list[Step], variant: str) -> list[Step]:
    """The steps a reader of ``variant`` runs: the common ones and that variant's."""
    return [s for s in found if s.variant in {"", variant} and s.action != "skip"]


def read(path: Path) -> list[Step]:
    """:func:`steps` of the page at ``path``, its file name in errors."""
    try:
        return steps(path.read_text())
    except PageError as exc:
        raise PageError(f"{path}: {exc}") from None
