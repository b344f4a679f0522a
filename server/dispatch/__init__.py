"""The declared actions and the process they run in: its one broker, slot range, figures."""
