"""Worker processes: where a line runs (relay), the links between workers (peers), their frames."""
