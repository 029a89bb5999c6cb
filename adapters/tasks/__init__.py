"""The task format: a Harbor 0.26 task folder read, checked and described (docs/tasks.md).

    task.py          `Task.load`: the folder, its `task.toml` and what each part becomes
    config.py        every key of Harbor's task config and what is done with it
    env.py           the `env` tables, `${VAR}` values resolved
    files.py         the files read whole, bounded
    artifacts.py     `artifacts`, and their collection from the sandbox's layers
    collect.py       `[[verifier.collect]]` hooks, and running them
    steps.py         a multi-step task's `[[steps]]` and `steps/<name>/` folders
    healthcheck.py   `[environment.healthcheck]` (and a step's), tried as Docker's
    mcpservers.py    `[[environment.mcp_servers]]`
    compose.py       `environment/docker-compose.yaml`
    verifiermode.py  the separate verifier, as Harbor resolves its mode

Nothing is imported here: each module is imported by name.
"""
