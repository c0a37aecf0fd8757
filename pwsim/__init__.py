"""pwsim: the trace-driven discrete-event simulator of one PagedWeight serving replica."""
