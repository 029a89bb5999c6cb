"""Typed access to what a test expects a session view to hold."""

from __future__ import annotations

from typing import cast

from trialledger.core.events import Decision, SessionSeededData
from trialledger.core.replay import SessionView


def decided(view: SessionView) -> Decision:
    """The view's last decision; a test that expects one fails here when there is none."""
    assert view.decision is not None, f"no decision in state {view.state}"
    return view.decision


def seeded(view: SessionView) -> SessionSeededData:
    """The data of the view's first event, `session.seeded`."""
    return cast(SessionSeededData, view.events[0].data)
