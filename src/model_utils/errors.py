"""The one exception type for user mistakes: its message says what is wrong and how to fix it."""


class ConfigError(ValueError):
    """Bad input from the user (flags, config files, data, paths). Reported as one line, exit status 2."""


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (libraries raise multi-line ones), or its type's name."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
