"""Dockerfile parsing: the instructions aenv builds, with line continuations, ARG/ENV substitution.

Single-stage files only; an instruction aenv does not carry out is an error naming its line,
never silently skipped (EXPOSE, LABEL and the like are kept as metadata).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from aenv.errors import InvalidRequest, parse_json

BUILT = {"FROM", "RUN", "ENV", "ARG", "WORKDIR", "USER", "COPY", "ADD", "CMD", "ENTRYPOINT"}
METADATA = {"EXPOSE", "LABEL", "MAINTAINER", "STOPSIGNAL", "HEALTHCHECK", "VOLUME", "SHELL", "ONBUILD"}
VAR = re.compile(r"\$(?:\{(\w+)(?::?([-+])([^}]*))?\}|(\w+))")


class DockerfileError(InvalidRequest):
    pass


@dataclass
class Instruction:
    line: int
    keyword: str
    args: str  # the raw argument text, continuations joined
    flags: dict[str, str] = field(default_factory=dict)

    def exec_form(self) -> list[str] | None:
        """The JSON array form (``["a", "b"]``), or None for the shell form."""
        text = self.args.strip()
        if text.startswith("["):
            try:
                value = parse_json(text)
            except ValueError:
                return None
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                return value
        return None

    def __str__(self) -> str:
        flags = " ".join(f"--{k}={v}" for k, v in sorted(self.flags.items()))
        return f"{self.keyword} {flags + ' ' if flags else ''}{self.args}".strip()


def substitute(text: str, env: dict[str, str]) -> str:
    """$VAR, ${VAR}, ${VAR:-default} and ${VAR:+alt}, as Docker expands them."""

    def one(m: re.Match[str]) -> str:
        name, op, word = m.group(1) or m.group(4), m.group(2), m.group(3) or ""
        value = env.get(name, "")
        if op == "-":
            return value or word
        if op == "+":
            return word if value else ""
        return value

    return VAR.sub(one, text)


def parse(text: str) -> list[Instruction]:
    out: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # comments inside a continued instruction are dropped, as Docker does
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        pending += stripped
        out.append(_instruction(start, pending))
        pending = ""
    if pending.strip():
        out.append(_instruction(start, pending))
    if not out or out[0].keyword not in ("FROM", "ARG"):
        raise DockerfileError("a Dockerfile starts with FROM (ARG may come before it)")
    if sum(1 for i in out if i.keyword == "FROM") != 1:
        raise DockerfileError("multi-stage Dockerfiles (more than one FROM) are not supported yet")
    return out


def _instruction(line: int, text: str) -> Instruction:
    keyword, _, rest = text.strip().partition(" ")
    keyword = keyword.upper()
    if keyword not in BUILT | METADATA:
        raise DockerfileError(f"line {line}: unknown instruction {keyword}")
    flags: dict[str, str] = {}
    rest = rest.strip()
    while rest.startswith("--"):
        flag, _, rest = rest.partition(" ")
        name, _, value = flag[2:].partition("=")
        flags[name] = value
        rest = rest.strip()
    if keyword in ("COPY", "ADD") and set(flags) - {"chown", "chmod"}:
        raise DockerfileError(f"line {line}: {keyword} --{sorted(set(flags) - {'chown', 'chmod'})[0]} is not supported")
    if keyword == "RUN" and flags:
        raise DockerfileError(f"line {line}: RUN --{next(iter(flags))} is not supported")
    if keyword in ("SHELL", "ONBUILD"):
        raise DockerfileError(f"line {line}: {keyword} is not supported")
    return Instruction(line, keyword, rest, flags)


def env_pairs(instr: Instruction, env: dict[str, str]) -> dict[str, str]:
    """ENV a=1 b="two words"  or the legacy  ENV a 1."""
    text = instr.args
    words = shlex.split(text, posix=True)
    if words and "=" not in words[0]:
        name, _, value = text.strip().partition(" ")
        return {name: substitute(value.strip(), env)}
    out: dict[str, str] = {}
    for word in words:
        name, eq, value = word.partition("=")
        if not eq:
            raise DockerfileError(f"line {instr.line}: ENV/ARG wants name=value, got {word!r}")
        out[name] = substitute(value, {**env, **out})
    return out


def copy_args(instr: Instruction, env: dict[str, str]) -> tuple[list[str], str]:
    parts = instr.exec_form() or shlex.split(instr.args)
    parts = [substitute(p, env) for p in parts]
    if len(parts) < 2:
        raise DockerfileError(f"line {instr.line}: {instr.keyword} wants at least a source and a destination")
    for src in parts[:-1]:
        if "://" in src:
            raise DockerfileError(f"line {instr.line}: {instr.keyword} from a URL is not supported")
    return parts[:-1], parts[-1]
