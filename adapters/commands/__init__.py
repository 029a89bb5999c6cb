"""The `trialledger` command line, command by command: each module holds its commands'
parsers beside their handlers, and `cli.py` only assembles them and runs one.

- `common`: exit codes, `Refused`, the store opened for a command, the one-line usage
  error, the options several commands take;
- `store`: `replay`, `db upgrade`, `import`, `export`, `audit`, `sql`, `ls`, `show`,
  `artifacts`, `recover`;
- `running`: `run`, `setup`, `cache`, `demo`, and the options `run`, `job run` and
  `worker` share;
- `jobs`: `job run`, `job show`, `job diff`, `job ls`, `worker`;
- `harbor`: `import-harbor`, `export-harbor`;
- `view`: `view`.

What the commands print lives in `adapters/console/`.
"""
