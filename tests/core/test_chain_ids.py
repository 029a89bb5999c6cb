"""Reproducible event ids: the fast uuid5 equals the standard library's."""

from __future__ import annotations

import uuid

from hypothesis import given
from hypothesis import strategies as st

from trialledger.core.canonical import NS, event_id_for


@given(session_id=st.text(max_size=60), seq=st.integers(1, 10**12))
def test_event_id_is_uuid5_of_session_and_seq(session_id: str, seq: int) -> None:
    assert event_id_for(session_id, seq) == str(uuid.uuid5(NS, f"{session_id}:{seq}"))
