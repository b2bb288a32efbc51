"""Sandbox states and the one table of legal transitions."""

from __future__ import annotations

from enum import Enum

from aenv.errors import WrongState


class SandboxState(str, Enum):
    CREATING = "creating"  # restoring from a template or snapshot; not yet answering
    RUNNING = "running"  # the agent answers; processes run
    PAUSING = "pausing"  # checkpoint in progress; ends paused, or running if it failed
    PAUSED = "paused"  # only files on disk: no CPU, no memory
    RESUMING = "resuming"  # restoring a paused sandbox
    SNAPSHOTTING = "snapshotting"  # checkpoint + restore of a running sandbox
    FORKING = "forking"  # snapshotting, plus N children restored from the same image
    KILLING = "killing"  # tearing down; the record goes away when done
    KILLED = "killed"  # terminal; never stored


TRANSITIONS: dict[SandboxState, frozenset[SandboxState]] = {
    SandboxState.CREATING: frozenset({SandboxState.RUNNING, SandboxState.KILLING}),
    SandboxState.RUNNING: frozenset(
        {SandboxState.PAUSING, SandboxState.SNAPSHOTTING, SandboxState.FORKING, SandboxState.KILLING}
    ),
    SandboxState.PAUSING: frozenset({SandboxState.PAUSED, SandboxState.RUNNING, SandboxState.KILLING}),
    SandboxState.PAUSED: frozenset({SandboxState.RESUMING, SandboxState.KILLING}),
    SandboxState.RESUMING: frozenset({SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.KILLING}),
    # ... -> PAUSED: the checkpoint was taken but the source could not be restarted from it.
    SandboxState.SNAPSHOTTING: frozenset({SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.KILLING}),
    SandboxState.FORKING: frozenset({SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.KILLING}),
    SandboxState.KILLING: frozenset({SandboxState.KILLED}),
    SandboxState.KILLED: frozenset(),
}

# Where a sandbox rests between operations; any other state is an operation in progress.
SETTLED = frozenset({SandboxState.RUNNING, SandboxState.PAUSED})

# What the E2B API shows for each internal state.
PUBLIC_STATE = {
    SandboxState.CREATING: "running",
    SandboxState.RUNNING: "running",
    SandboxState.PAUSING: "paused",  # as E2B: a sandbox being paused is paused to its clients
    SandboxState.PAUSED: "paused",
    SandboxState.RESUMING: "paused",
    SandboxState.SNAPSHOTTING: "running",
    SandboxState.FORKING: "running",
    SandboxState.KILLING: "running",
    SandboxState.KILLED: "killed",
}


def check_transition(sandbox_id: str, current: SandboxState, target: SandboxState) -> None:
    if target not in TRANSITIONS[current]:
        raise WrongState(f"sandbox {sandbox_id} is {current.value}; cannot go to {target.value}", sandbox_id=sandbox_id)
