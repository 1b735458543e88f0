"""Errors a user can cause and fix. The CLI prints them as one line and exits non-zero."""


class GenspecError(Exception):
    """Base class: a bad argument, file or request. The message is shown to the user as is."""


class ConfigError(GenspecError, ValueError):
    """An argument or setting is out of range or unknown (k < 1, temperature < 0, unknown drafter...)."""


class InputFileError(GenspecError, ValueError):
    """A file is missing, unreadable or malformed (chain JSON, corpus, model directory...)."""


class ContextLengthError(GenspecError, ValueError):
    """A prompt (plus the tokens to generate) does not fit the model's context window."""


class GenerationError(GenspecError, RuntimeError):
    """A request failed while generating: its drafter raised, or a model's output was unusable."""


class NumericalError(GenerationError):
    """A model's logits (or a drafter's law) contain NaN or inf: nothing can be sampled from them, so the
    request fails rather than emit made-up tokens (e.g. a dtype whose range the activations exceed)."""
