"""Argument parsing and output helpers of the command line."""
