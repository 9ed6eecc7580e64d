"""The one exception type for user mistakes: its message says what is wrong and how to fix it."""


class ConfigError(ValueError):
    """Bad input from the user (flags, config files, data, paths). Reported as one line, exit status 2."""
