"""The rating app's one error type for bad input: a message naming the file, key or value, and what was expected."""


class RateError(Exception):
    """Bad input or an unusable database: the CLI prints the message and exits with 2."""
