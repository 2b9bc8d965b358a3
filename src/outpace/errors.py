"""Errors a user can cause. Each is a ValueError subclass whose message says what to change."""


class OutpaceError(ValueError):
    """Base class: the command line prints the message alone, without a traceback."""


class ModelNotFoundError(OutpaceError):
    pass


class UnsupportedModelError(OutpaceError):
    pass


class CorruptModelError(OutpaceError):
    pass


class IncompatibleModelsError(OutpaceError):
    """A draft model whose vocabulary is not the target's."""


class PromptTooLongError(OutpaceError):
    pass


class InvalidParameterError(OutpaceError):
    """param: the parameter at fault, where the check knows it (the server's 400 names it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class WorkerFailedError(OutpaceError):
    """A tensor-parallel worker died, or a collective failed: the engine cannot go on."""
