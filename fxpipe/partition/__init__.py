"""Choosing stage cuts: the problem as plain data, the CP-SAT program, the baselines."""
