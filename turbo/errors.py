"""The one error type a user can cause: it ends the CLI in one line, exit status 2."""


class TurboError(Exception):
    """A problem with what the user gave us (install, config, prompt, block), not a bug.

    The message names the thing (file, tensor, field, value) and what was expected.
    """
