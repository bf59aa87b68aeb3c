"""User-facing errors: reported as one line, without a traceback (``--debug`` shows it)."""


class UserError(Exception):
    """Bad input from the user: a config key, a file, a flag. The message names it and says what was expected."""
