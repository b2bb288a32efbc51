"""The `aenv` command line: a thin shell over the public SDK (plus `server`, which runs a node).

Tables on a terminal, JSON when piped; errors are caught in one place and become exit code 1
(:mod:`aenv.cli.common`). The commands are one module per group, imported here in the order
``aenv --help`` lists them: :mod:`~aenv.cli.servers`, :mod:`~aenv.cli.sandboxes`, :mod:`~aenv.cli.desktop`,
:mod:`~aenv.cli.nodes`, :mod:`~aenv.cli.templates`, :mod:`~aenv.cli.artifacts`,
:mod:`~aenv.cli.observe`, :mod:`~aenv.cli.doctor`, :mod:`~aenv.cli.shared` (volumes, secrets,
events, webhooks), :mod:`~aenv.cli.teams`. ``aenv`` (pyproject.toml) runs :data:`app`.
"""

from __future__ import annotations

# isort: off
# Importing a group registers its commands on ``app``: in this order, the order `aenv --help` lists them.
from aenv.cli import servers, sandboxes, desktop, nodes, templates, artifacts, observe, doctor, shared

# isort: on
from aenv.cli.common import _emit, _run, app, err, next_step, out
from aenv.cli.teams import register as _register_teams

__all__ = ["COMMAND_GROUPS", "app", "main", "next_step"]

COMMAND_GROUPS = (servers, sandboxes, desktop, nodes, templates, artifacts, observe, doctor, shared)
_register_teams(app, run=_run, emit=_emit, out=out, err=err)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
