"""One training run's files and record: its directory and owner lock, the evaluation ledger, the
record shared by flow runs, and its set-up."""
