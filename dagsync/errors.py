"""The errors dagsync raises on purpose.

Every message is written for the person at the terminal: what was found and
what to do about it. ``cli.py`` is the one place that turns a ``DagsyncError``
into ``Error: <message>`` on stderr and exit status 1.
"""


class DagsyncError(Exception):
    """Base class: a problem the user can act on, described in one line."""


class NotADatabase(DagsyncError):
    """The file is missing, empty, not SQLite, or damaged."""


class UnsupportedDatabase(DagsyncError):
    """A SQLite file whose schema is not one dagsync can read or trust."""


class HashContractError(DagsyncError):
    """A message cannot be hashed under the content-hash contract."""


class NotFound(DagsyncError):
    """A message or conversation id that is not in the database."""


class MergeConflict(DagsyncError):
    """The same key holds different content on the two sides; nothing was written."""

    def __init__(self, message: str, conflicts: list[str]) -> None:
        super().__init__(message)
        self.conflicts = conflicts


class DamagedSource(DagsyncError):
    """A source whose rows contradict themselves (a cycle, a dangling reference)."""


class UnresolvedReference(DamagedSource):
    """A row of a thin source (a delta, a bundle) refers to a row that neither it nor
    the target has. In a target that forgot conversations that is no damage: the
    forget removed what the row refers to, and only the whole source has it again
    (``merge`` falls back to a full merge; a bundle must be made whole)."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail  # what refers to what, without the advice


class BlobError(DagsyncError, LookupError):
    """A packed value cannot be read: its blob or the blob's dictionary is missing or damaged."""
