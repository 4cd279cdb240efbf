"""The release, in one place: the package face and the command line both read it."""

__version__ = "0.1.0"
