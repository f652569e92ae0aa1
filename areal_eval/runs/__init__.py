"""One training run's files: its directory, owner lock and stop signal, and the evaluation ledger."""
