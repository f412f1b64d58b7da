"""The one error type of the data package."""
from jaxtrain.config import ConfigError


class DataError(ConfigError):
    """Data that cannot feed a run; the message says what to change."""
