"""A Dockerfile read as its build runs it: each instruction with the stage it is in and the USER
and ENV in effect there (tests/test_image_builds.py judges them; no Docker engine runs here),
and the check that nothing under /cache is left to root.

Deliberately small: line continuations, comments, `ENV k=v ...` and `ENV k v`, `FROM x AS name`
(a stage FROM an earlier one inherits its USER and ENV), `USER`. No ARG substitution or heredocs:
the project's Dockerfiles use neither, and `steps()` refuses a heredoc rather than misread it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT_USERS = ("root", "0")


@dataclass
class Step:
    instruction: str  # RUN, COPY, ENV, ... (upper case)
    args: str  # the rest of the instruction, continuations joined
    stage: str  # the stage's `AS` name, else its index
    user: str  # the USER in effect (root unless set)
    env: dict[str, str] = field(default_factory=dict)  # the ENV in effect (before this step)
    line: int = 0  # where it starts, 1-based

    @property
    def as_root(self) -> bool:
        return self.user.split(":")[0] in ROOT_USERS

    def commands(self) -> list[str]:
        """A RUN's shell commands, split at `&&`, `||` and `;` outside quotes (a `python -c
        "a; b"` is one command)."""
        out, current, quote, i = [], "", "", 0
        while i < len(self.args):
            ch = self.args[i]
            if quote:
                quote = "" if ch == quote else quote
            elif ch in "'\"":
                quote = ch
            elif self.args.startswith(("&&", "||"), i) or ch == ";":
                out.append(current)
                current, i = "", i + (1 if ch == ";" else 2)
                continue
            current += ch
            i += 1
        return [c.strip() for c in [*out, current] if c.strip()]


def _logical_lines(text: str) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    buf, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):  # a comment inside a continuation is dropped
            continue
        if not buf:
            start = number
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        out.append((start, buf + line))
        buf = ""
    if buf:
        out.append((start, buf))
    return out


def _env_pairs(args: str) -> dict[str, str]:
    tokens = shlex.split(args)
    if tokens and "=" not in tokens[0]:  # the legacy `ENV key value with spaces`
        return {tokens[0]: " ".join(tokens[1:])}
    return dict(token.split("=", 1) for token in tokens)


def steps(path: Path) -> list[Step]:
    out: list[Step] = []
    ended: dict[str, tuple[str, dict[str, str]]] = {}  # stage -> (USER, ENV) at its end
    stage, user, env = "", "root", {}
    for line, text in _logical_lines(path.read_text()):
        instruction, _, args = text.partition(" ")
        instruction, args = instruction.upper(), args.strip()
        assert "<<" not in args or instruction != "RUN", f"{path}:{line}: heredocs are not read"
        if instruction == "FROM":
            if stage:
                ended[stage] = (user, env)
            words = args.split()
            base = next(w for w in words if not w.startswith("--"))
            named = len(words) >= 3 and words[-2].upper() == "AS"
            stage = words[-1] if named else str(len(ended))
            user, env = ended.get(base, ("root", {}))
            env = dict(env)
        out.append(Step(instruction, args, stage, user, dict(env), line))
        if instruction == "ENV":
            env.update(_env_pairs(args))
        elif instruction == "USER":
            user = args.split()[0]
    return out


def final_stage(all_steps: list[Step]) -> list[Step]:
    """The steps of the last stage: what the image is (earlier ones only feed COPY --from)."""
    return [s for s in all_steps if s.stage == all_steps[-1].stage]


# ---- /cache: made for the runtime user, never written as root -----------------------------------


def under_cache(value: str) -> bool:
    return any(p == "/cache" or p.startswith("/cache/") for p in value.split(":"))


def uid_of(name: str, all_steps: list[Step]) -> str:
    """A user name's uid, from the `useradd --uid N name` that made it."""
    if name.isdigit():
        return name
    for step in all_steps:
        for cmd in step.commands() if step.instruction == "RUN" else ():
            words = shlex.split(cmd)
            if words[0] == "useradd" and words[-1] == name and "--uid" in words:
                return words[words.index("--uid") + 1]
    return name


def chown_of_cache(cmd: str, all_steps: list[Step]) -> tuple[str, bool] | None:
    """(uid, recursive) of a `chown [-R] OWNER /cache`, else None."""
    words = shlex.split(cmd)
    if words[0] != "chown" or words[-1].rstrip("/") != "/cache":
        return None
    return uid_of(words[-2].split(":")[0], all_steps), "-R" in words


def runtime_uid(all_steps: list[Step]) -> str:
    users = [s.args.split()[0] for s in final_stage(all_steps) if s.instruction == "USER"]
    assert users, "the image should set a USER"
    return uid_of(users[-1].split(":")[0], all_steps)


def root_writes_under_cache(path: Path) -> list[str]:
    """The build steps that, as root, may leave files under /cache that the runtime user does
    not own: a RUN as root with a variable pointing into /cache in effect, or a command touching
    /cache other than making it and chowning it, unless the RUN ends with `chown -R <runtime
    user> /cache`; a COPY/ADD into /cache without --chown."""
    all_steps, problems = steps(path), []
    uid = runtime_uid(all_steps)
    for step in all_steps:
        where = f"{path.name}:{step.line}"
        if step.instruction in ("COPY", "ADD"):
            words = shlex.split(step.args)
            if under_cache(words[-1]) and not any(w.startswith("--chown") for w in words):
                problems.append(f"{where}: {step.instruction} into /cache without --chown")
        if step.instruction != "RUN" or not step.as_root:
            continue
        commands = step.commands()
        envs = sorted(k for k, v in step.env.items() if under_cache(v))
        touching = [
            c
            for c in commands
            if "/cache" in c and c != "mkdir -p /cache" and not chown_of_cache(c, all_steps)
        ]
        if (envs or touching) and chown_of_cache(commands[-1], all_steps) != (uid, True):
            why = f"{', '.join(envs)} point into /cache" if envs else f"it runs {touching}"
            problems.append(f"{where}: a RUN as root where {why}, without a final chown -R")
    return problems


def makes_cache_for(step: Step, uid: str, all_steps: list[Step]) -> bool:
    """Whether a RUN makes /cache and then chowns it to `uid`."""
    commands = step.commands() if step.instruction == "RUN" else []
    if "mkdir -p /cache" not in commands:
        return False
    after = commands[commands.index("mkdir -p /cache") + 1 :]
    return any((chown_of_cache(c, all_steps) or ("",))[0] == uid for c in after)
