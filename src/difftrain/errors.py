"""User-facing errors: reported as one line, without a traceback (``--debug`` shows it)."""


class UserError(Exception):
    """Bad input from the user: a config key, a file, a flag. The message names it and says what was expected."""


def check_positive(name: str, value, minimum=1) -> None:
    """A flag's value, when given, must be at least ``minimum``."""
    if value is not None and value < minimum:
        raise UserError(f"{name} {value}: expected a value >= {minimum}")
