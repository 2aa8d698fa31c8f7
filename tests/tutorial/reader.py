"""A reader who follows a page's steps (:mod:`tests.tutorial.pages`) on a fresh machine.

The reader has a fresh virtualenv with nothing installed, a home folder to work in, and the
services. The page's ``pip install`` of this project installs the wheel under test instead
(the same extras); everything else runs as written: the commands in a shell with the
virtualenv activated, the files written where the page says, the workers started in the
background, the Python session typed into the page's shell command and compared with what
the page shows.

Two things the reader changes to share the machine with other test runs, and only these:
once the page has made a Django project, every command of it runs with a settings module
that imports the project's settings and then points the Celery broker and result URLs at
another Redis database number (same host and port) and a PostgreSQL database at another
database name. They are in :func:`isolation_module`.
"""

from __future__ import annotations

import doctest
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.tutorial.pages import Step

#: How long one command may take (``pip install`` included).
COMMAND_TIMEOUT = 300.0
#: How long a Python session may take.
SESSION_TIMEOUT = 180.0
#: How long a started process may take to stop on SIGTERM before its group is killed.
STOP_TIMEOUT = 20.0
#: A Celery log line at ERROR or CRITICAL level.
ERROR_LINE = re.compile(r"^\[[^\]]*: (ERROR|CRITICAL)/", re.MULTILINE)
#: Environment variables of the test run that a reader's fresh shell does not have.
NOT_INHERITED = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "DJANGO_SETTINGS_MODULE")
NOT_INHERITED_PREFIXES = ("CELERY_", "POOLS_", "PYTEST_")
#: Name of the settings module the reader runs the page's project with.
ISOLATION_MODULE = "reader_isolation"
#: What doctest ignores when it compares a session with what the page shows.
OUTPUT_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


class StepFailed(AssertionError):
    """A step of the page did not do what the page says."""


@dataclass(frozen=True)
class Isolation:
    """Where the reader's project keeps its data on the shared services."""

    #: Redis database number for the Celery broker and result backend.
    redis_db: int
    #: PostgreSQL database name (created and dropped by the test); unused on SQLite.
    pg_name: str


@dataclass
class Started:
    """A long-running command of the page (a worker, beat)."""

    command: str
    process: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def shorter(text: str, keep: int = 3000) -> str:
    """The start and the end of a long output (a session's first failure comes first)."""
    if len(text) <= 2 * keep:
        return text
    return f"{text[:keep]}\n[... {len(text) - 2 * keep} characters ...]\n{text[-keep:]}"


def matches(want: str, got: str) -> bool:
    """``got`` is what the page shows as ``want`` (``...`` for any text, spaces free)."""
    return doctest.OutputChecker().check_output(want, got, OUTPUT_FLAGS)


def isolation_module(settings_module: str, isolation: Isolation) -> str:
    """The settings module the reader's commands run with: the page's settings, then the
    test's own Redis database and PostgreSQL database name."""
    return f'''"""The page's settings on the test's own Redis database and PostgreSQL database."""
from urllib.parse import urlsplit, urlunsplit

from {settings_module} import *  # noqa: F403


def _own_redis_db(url):
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        return url
    return urlunsplit(parts._replace(path="/{isolation.redis_db}"))


for _name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
    if isinstance(globals().get(_name), str):
        globals()[_name] = _own_redis_db(globals()[_name])
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":  # noqa: F405
    DATABASES["default"]["NAME"] = {isolation.pg_name!r}  # noqa: F405
'''


def project_requirement(token: str, project: str) -> str | None:
    """The extras of ``token`` if it names ``project`` (``"name[a,b]"`` -> ``"[a,b]"``)."""
    match = re.fullmatch(r"([A-Za-z0-9._-]+)(\[[^\]]*\])?", token)
    if match and re.sub(r"[-_.]+", "-", match[1]).lower() == project:
        return match[2] or ""
    return None


@dataclass
class Reader:
    """Follows steps in ``work``: its virtualenv is ``work/venv``, its home ``work/home``."""

    work: Path
    wheel: Path
    project: str
    isolation: Isolation
    #: ``False``: a virtualenv without pip (quick to make; for tests of the reader itself).
    pip: bool = True
    #: What ran, in order, for failure messages.
    transcript: list[str] = field(default_factory=list)
    started: list[Started] = field(default_factory=list)
    installed: list[str] = field(default_factory=list)
    cwd: Path = field(init=False)
    settings_module: str = ""
    _shell: str = ""
    _session: list[Step] = field(default_factory=list)
    _last_output: str = ""

    def __post_init__(self) -> None:
        self.cwd = self.work / "home"
        self.cwd.mkdir(parents=True, exist_ok=True)
        (self.work / "isolation").mkdir(exist_ok=True)
        self.venv = self.work / "venv"
        without = [] if self.pip else ["--without-pip"]
        subprocess.run([sys.executable, "-m", "venv", *without, str(self.venv)], check=True)

    # ----------------------------------------------------------------------- environment

    def env(self) -> dict[str, str]:
        """A fresh shell's environment with the virtualenv activated."""
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in NOT_INHERITED and not k.startswith(NOT_INHERITED_PREFIXES)
        }
        env["VIRTUAL_ENV"] = str(self.venv)
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONUNBUFFERED"] = "1"
        # pip compiles every module it installs (seconds per install); Python compiles
        # the modules it imports anyway.
        env["PIP_NO_COMPILE"] = "1"
        if self.settings_module:
            env["PYTHONPATH"] = str(self.work / "isolation")
            env["DJANGO_SETTINGS_MODULE"] = ISOLATION_MODULE
        return env

    def _notice_project(self) -> None:
        """Once a ``manage.py`` is here, run the project with the isolation settings."""
        manage = self.cwd / "manage.py"
        if self.settings_module or not manage.exists():
            return
        found = re.search(r"DJANGO_SETTINGS_MODULE['\"],\s*['\"]([\w.]+)['\"]", manage.read_text())
        if not found:
            raise StepFailed(f"{manage} names no settings module")
        self.settings_module = found[1]
        (self.work / "isolation" / f"{ISOLATION_MODULE}.py").write_text(
            isolation_module(self.settings_module, self.isolation)
        )

    # ----------------------------------------------------------------------- steps

    def follow(self, steps: list[Step]) -> None:
        """Do every step in order; :class:`StepFailed` at the first that fails."""
        for step in steps:
            if step.action != "session":
                self._end_session()
            getattr(self, f"_do_{step.action}")(step)
        self._end_session()

    def _do_run(self, step: Step) -> None:
        for line in step.lines():
            if line.startswith("cd "):
                self.cwd = (self.cwd / line[3:].strip()).resolve()
                self.transcript.append(f"$ {line}")
                continue
            done = self.sh(self._installing_the_wheel(line), what=f"line {step.line}")
            self._last_output = done.stdout
            self._notice_project()

    def _installing_the_wheel(self, line: str) -> str:
        """``pip install "<project>[extras]"`` installs the wheel under test, same extras."""
        words = shlex.split(line, comments=True)
        if "pip" not in words or "install" not in words:
            return line
        changed = False
        for i, word in enumerate(words):
            extras = project_requirement(word, self.project)
            if extras is not None:
                words[i] = f"{self.wheel}{extras}"
                changed = True
        if changed:
            self.installed.append(line)
        return shlex.join(words)

    def _do_output(self, step: Step) -> None:
        if not matches(step.body, self._last_output):
            raise StepFailed(
                f"line {step.line}: the command printed\n{self._last_output}\nthe page shows\n"
                f"{step.body}"
            )

    def _file(self, step: Step) -> Path:
        path = (self.cwd / step.arg).resolve()
        if not path.is_relative_to(self.work):
            raise StepFailed(f"line {step.line}: {step.arg} is outside the reader's folder")
        return path

    def _do_write(self, step: Step) -> None:
        path = self._file(step)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(step.body)
        self.transcript.append(f"(wrote {step.arg})")

    def _do_append(self, step: Step) -> None:
        path = self._file(step)
        if not path.exists():
            raise StepFailed(f"line {step.line}: {step.arg} does not exist yet: nothing to add to")
        path.write_text(path.read_text().rstrip("\n") + "\n\n" + step.body)
        self.transcript.append(f"(added to {step.arg})")

    def _do_start(self, step: Step) -> None:
        for line in step.lines():
            log = self.work / f"started-{len(self.started) + 1}.log"
            with log.open("wb") as out:
                process = subprocess.Popen(
                    ["bash", "-c", f"exec {line}"],
                    cwd=self.cwd,
                    env=self.env(),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.started.append(Started(line, process, log))
            self.transcript.append(f"$ {line} &")

    def _do_shell(self, step: Step) -> None:
        (self._shell,) = step.lines() or [""]
        if not self._shell:
            raise StepFailed(f"line {step.line}: a shell block names no command")

    def _do_session(self, step: Step) -> None:
        self._session.append(step)

    def _end_session(self) -> None:
        """Type the session blocks collected so far into the shell command, as one session."""
        if not self._session:
            return
        blocks, self._session = self._session, []
        text = "\n".join(s.body for s in blocks)
        path = self.work / f"session-{blocks[0].line}.txt"
        path.write_text(text)
        code = (
            "import doctest, sys; "
            f"r = doctest.testfile({str(path)!r}, module_relative=False, "
            f"optionflags={OUTPUT_FLAGS}, report=True); sys.exit(1 if r.failed else 0)"
        )
        self.sh(
            f"{self._shell} -c {shlex.quote(code)}",
            what=f"the session of lines {', '.join(str(s.line) for s in blocks)}",
            timeout=SESSION_TIMEOUT,
            show=f"{self._shell}  <<< {path.name}",
        )

    # ----------------------------------------------------------------------- commands

    def sh(
        self, line: str, *, what: str, timeout: float = COMMAND_TIMEOUT, show: str = ""
    ) -> subprocess.CompletedProcess[str]:
        """Run one shell command in the reader's folder; :class:`StepFailed` unless it exits 0."""
        self.transcript.append(f"$ {show or line}")
        try:
            done = subprocess.run(
                ["bash", "-c", line],
                cwd=self.cwd,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise StepFailed(f"{what}: `{show or line}` did not end within {timeout:.0f}s") from exc
        if done.returncode:
            raise StepFailed(
                f"{what}: `{show or line}` exited {done.returncode}\n--- stdout\n"
                f"{shorter(done.stdout)}\n--- stderr\n{shorter(done.stderr)}"
            )
        return done

    def python(self, code: str, *, what: str) -> str:
        """Run ``code`` in the page's project (``manage.py shell -c``); its standard output."""
        return self.sh(
            f"python manage.py shell -c {shlex.quote(code)}",
            what=what,
            show=f"python manage.py shell -c <{what}>",
        ).stdout

    # ----------------------------------------------------------------------- ending

    def exited(self) -> list[Started]:
        """Started commands that are no longer running."""
        return [s for s in self.started if s.process.poll() is not None]

    def errors(self) -> list[str]:
        """ERROR and CRITICAL lines of the started commands' logs."""
        return [
            f"{s.command}: {line}"
            for s in self.started
            for line in s.text().splitlines()
            if ERROR_LINE.match(line)
        ]

    def stop(self) -> None:
        """SIGTERM each started command's process group, SIGKILL it after a while."""
        for s in self.started:
            if s.process.poll() is None:
                os.killpg(s.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        for s in self.started:
            try:
                s.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(s.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            s.process.wait()

    def report(self) -> str:
        """What ran and the tail of every started command's log, for a failure message."""
        parts = ["--- what the reader did", *self.transcript]
        for s in self.started:
            parts += [f"--- log of `{s.command}`", s.text()[-4000:]]
        return "\n".join(parts)


@contextmanager
def reading(work: Path, wheel: Path, project: str, isolation: Isolation) -> Iterator[Reader]:
    """A :class:`Reader` whose started commands are stopped on the way out."""
    reader = Reader(work, wheel, project, isolation)
    try:
        yield reader
    finally:
        reader.stop()
