"""Kernel side: starts, supervises and reads back runs, in a notebook's kernel or the command
line. It may import the rank side (names, the metric vocabulary), never the notebook side."""
