"""What the engines read and write: trace schemas and I/O, synthetic generators, model cards, hardware profiles."""
