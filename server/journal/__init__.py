"""The write-ahead log: its record kinds, frames committed to disk, confirms, replay."""
