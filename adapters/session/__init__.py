"""One session's run (docs/SPEC.md §8, §11, §15): seeded, the agent driven, its evidence
captured and journalled, verified, closed.

    runner.py            `SessionRunner`: a session from seed to close, in its sandbox
    sessions.py          what a runner is given and gives back
    preflight.py         what is checked before anything is seeded
    scripted.py          the oracle and nop agents
    recorder.py          appends to the store, fenced, with the journal behind it
    journal.py           the evidence journal (journalfile.py: its format and integrity)
    capture.py           what the agent left, read bounded and scrubbed
    artifacts.py         the session's artifact folder
    verifying.py         after the agent: hooks, artifacts and the verifier
    separateverifier.py  the separate verifier's own container
    steprun.py           one attempt of a multi-step task
    logfile.py           a JSONL log a user hands us, read as untrusted input

Nothing is imported here: each module is imported by name.
"""
