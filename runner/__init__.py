"""The runner behind ppsmoke.py: starts (or rents) N nodes, converges the cluster, sends one prompt,
prints the answer, and tears everything down — atomically on any failure."""
