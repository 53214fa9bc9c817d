"""The base class for errors a user can act on.

The command line prints these as one clear message instead of a traceback; every
message names the file, line or key at fault and what was expected.
"""


class MegalithError(Exception):
    """A problem with the user's input, config or data, not a bug."""
