"""Errors the worker raises; each names what went wrong in words a user can act on."""


class ModelFileError(ValueError):
    """A weights, config or tokenizer file is unreadable, incomplete or unsupported."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class WorkerError(ValueError):
    """A worker op was called in a way the contract refuses (wrong role, bad shape, unknown request)."""


class ModelNameError(ValueError):
    """A model argument that is neither a built-in model, a path that exists nor a known name."""


class PrefixMissing(WorkerError):
    """A request was to start from a prefix-cache entry this stage does not hold (evicted here, or the stage
    was replaced): stage 0 computes that request again from its first token."""


class InvalidParam(WorkerError):
    """A request's own parameter, valid as far as admission could tell, cannot be computed: the request fails
    alone, and the client hears a 400 naming `param` (a response_format whose grammar passes the library's check
    but exceeds its limits as the answer grows: issue 54)."""

    def __init__(self, param: str, problem: str):
        super().__init__(f"{param}: {problem}")
        self.param = param
