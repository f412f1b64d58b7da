"""The config's errors: every rule raises a ConfigError whose message names the key to change."""


class ConfigError(ValueError):
    """A configuration that cannot run; the message says which key to change."""


class FrozenConfigError(ConfigError):
    """An assignment to a loaded (validated) config; derive a new one instead."""
