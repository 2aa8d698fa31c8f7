"""The page reader itself: markers, their order, and a reader that fails when a page is wrong.

Fast (no services, no wheel): the reader's virtualenv here has nothing installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tutorial import pages
from tests.tutorial.reader import Isolation, Reader, StepFailed, matches, project_requirement

ROOT = Path(__file__).resolve().parents[2]


def page(*parts: str) -> str:
    return "\n".join(parts) + "\n"


RUN = page("<!-- test: run -->", "```bash", "echo hello", "```")


def test_pages__every_block_needs_a_marker():
    with pytest.raises(pages.PageError, match="line 3: a fenced block without a marker"):
        pages.steps(page("Text", "", "```bash", "echo hi", "```"))


def test_pages__unknown_actions_and_arguments_are_refused():
    with pytest.raises(pages.PageError, match="unknown action 'exec'"):
        pages.steps(page("<!-- test: exec -->", "```", "x", "```"))
    with pytest.raises(pages.PageError, match="'write' needs an argument"):
        pages.steps(page("<!-- test: write -->", "```", "x", "```"))
    with pytest.raises(pages.PageError, match="'run' takes no argument"):
        pages.steps(page("<!-- test: run now -->", "```", "x", "```"))
    with pytest.raises(pages.PageError, match="expected 'variant NAME'"):
        pages.steps(page("<!-- test: run; flavour pg -->", "```", "x", "```"))


def test_pages__output_follows_run_and_session_follows_shell():
    with pytest.raises(pages.PageError, match="output block must follow a run block"):
        pages.steps(page("<!-- test: output -->", "```", "x", "```"))
    with pytest.raises(pages.PageError, match="session block must follow a shell block"):
        pages.steps(page("<!-- test: session -->", "```pycon", ">>> 1", "1", "```"))
    shell = page("<!-- test: shell -->", "```bash", "python", "```")
    session = page("<!-- test: session -->", "```pycon", ">>> 1", "1", "```")
    assert [s.action for s in pages.steps(shell + session + session)] == [
        "shell",
        "session",
        "session",
    ]
    with pytest.raises(pages.PageError, match="line 15: a session block must follow"):
        pages.steps(shell + session + RUN + session)


def test_pages__a_block_naming_its_file_writes_that_file():
    block = page("<!-- test: append proj/settings.py -->", "```python", "# proj/urls.py", "```")
    with pytest.raises(pages.PageError, match=r"says it is proj/urls\.py but its marker appends"):
        pages.steps(block)


def test_pages__blocks_in_tabs_and_their_variants():
    text = page(
        '=== "PostgreSQL"',
        "",
        "    <!-- test: append s.py; variant postgres -->",
        "    ```python",
        "    A = 1",
        "    ```",
        '=== "SQLite"',
        "",
        "    <!-- test: append s.py; variant sqlite -->",
        "    ```python",
        "    A = 2",
        "    ```",
        "",
        "<!-- test: skip shown, not run -->",
        "```",
        "x",
        "```",
    )
    found = pages.steps(text + RUN)
    assert pages.variants(found) == ["postgres", "sqlite"]
    assert [(s.action, s.body) for s in pages.for_variant(found, "sqlite")] == [
        ("append", "A = 2\n"),
        ("run", "echo hello\n"),
    ]
    assert pages.variants(pages.steps(RUN)) == [""]


def test_pages__section_ends_at_the_next_heading_outside_code():
    text = page("# T", "## Install", "```python", "# a comment", "```", "### Sub", "## Next", "z")
    assert pages.section(text, "## Install").splitlines() == text.splitlines()[1:6]


def test_pages__the_quickstart_reads():
    found = pages.read(ROOT / "docs" / "quickstart.md")
    assert pages.variants(found) == ["postgres", "sqlite"]
    assert {"run", "output", "write", "append", "start", "shell", "session"} <= {
        s.action for s in found
    }


def test_reader__outputs_compare_with_ellipsis_and_free_spaces():
    assert matches("a   [----] 0/4 held\n", "a [----]  0/4 held\n")
    assert matches("<AsyncResult: ...>\n", "<AsyncResult: 3f0c-9e>\n")
    assert not matches("(4, 4, 0, 6)\n", "(4, 2, 2, 6)\n")


def test_reader__the_install_line_of_the_project_is_recognized():
    assert project_requirement("django-celery-pools[redis,postgres]", "django-celery-pools") == (
        "[redis,postgres]"
    )
    assert project_requirement("Django_Celery.Pools", "django-celery-pools") == ""
    assert project_requirement("django-celery-beat", "django-celery-pools") is None


@pytest.fixture
def reader(tmp_path: Path) -> Reader:
    isolation = Isolation(redis_db=1, pg_name="-")
    return Reader(tmp_path, tmp_path / "none.whl", "x", isolation, pip=False)


def test_reader__fails_on_a_failing_command_and_on_other_output(reader: Reader):
    reader.follow(pages.steps(RUN + page("<!-- test: output -->", "```", "hello", "```")))
    with pytest.raises(StepFailed, match="exited 3"):
        reader.follow(pages.steps(page("<!-- test: run -->", "```bash", "exit 3", "```")))
    with pytest.raises(StepFailed, match="the page shows\nbye"):
        reader.follow(pages.steps(RUN + page("<!-- test: output -->", "```", "bye", "```")))


def test_reader__runs_a_session_in_the_shell_command_and_compares_it(reader: Reader):
    shell = page("<!-- test: shell -->", "```bash", "python", "```")
    first = page("<!-- test: session -->", "```pycon", ">>> x = 20", "```")
    second = page("<!-- test: session -->", "```pycon", ">>> x + 1", "{}", "```")
    reader.follow(pages.steps(shell + first + second.format(21)))
    with pytest.raises(StepFailed, match="Expected:\n    22\nGot:\n    21"):
        reader.follow(pages.steps(shell + first + second.format(22)))


def test_reader__writes_appends_and_moves_between_folders(reader: Reader):
    reader.follow(
        pages.steps(
            page("<!-- test: run -->", "```bash", "mkdir p", "cd p", "```")
            + page("<!-- test: write a.txt -->", "```", "one", "```")
            + page("<!-- test: append a.txt -->", "```", "two", "```")
            + page("<!-- test: run -->", "```bash", "cat a.txt", "```")
            + page("<!-- test: output -->", "```", "one", "two", "```")
        )
    )
    with pytest.raises(StepFailed, match=r"b\.txt does not exist yet"):
        reader.follow(pages.steps(page("<!-- test: append b.txt -->", "```", "x", "```")))
