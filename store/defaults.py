"""The store's defaults that the CLI's parser names, in a module that imports nothing, so
`trialledger --help` and `replay --log` do not load SQLAlchemy."""

DEFAULT_DB = "trials.db"  # the embedded SQLite file, in the current folder
DEFAULT_TIMEOUT_S = 10.0  # `sql`: seconds before a query is stopped
MAX_TIMEOUT_S = 3600.0
READER_ROLE = "trialledger_reader"  # PostgreSQL: the reader login `sql` connects as
