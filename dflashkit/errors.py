"""One exception type for user-facing mistakes: the CLI prints its message on one line and exits 2."""


class DFlashError(Exception):
    """Bad input or an environment problem the user can fix; the message says what and how."""
